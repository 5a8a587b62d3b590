"""Tables the docs carry that are generated from code (the README's channels, docs/security.md's
permissions): each between two marker comments, printed or rewritten in place by a module's
``--readme`` command line."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path


def section(text: str, begin: str, end: str) -> str:
    """What stands between the markers in a README's text."""
    start = text.index(begin) + len(begin) + 1
    return text[start : text.index(end, start)]


def main(description: str, begin: str, end: str, table: Callable[[], str]) -> None:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--readme", type=Path, help="rewrite the table in this README")
    args = parser.parse_args()
    if args.readme is None:
        print(table(), end="")
        return
    text = args.readme.read_text()
    old = begin + "\n" + section(text, begin, end)
    args.readme.write_text(text.replace(old, begin + "\n" + table()))
