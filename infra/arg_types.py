"""Argument types for the ``laneway`` commands: a value no run could use (a negative worker
count, a port past 65535, a speed-up of 0) is refused by argparse in one line, exit 2, before
anything starts, not met later as a traceback or a cluster that serves nothing."""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Callable


def at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text[:40]!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    parse.__name__ = "integer"  # what argparse names the type in its own messages
    return parse


def port(text: str) -> int:
    value = at_least(1)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"not a port (1-65535): {value}")
    return value


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text[:40]!r}") from None
    return value


def positive(text: str) -> float:
    """A finite number above 0."""
    value = _number(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text[:40]}")
    return value


def positive_or_zero(text: str) -> float:
    """A finite number, 0 or above."""
    value = _number(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text[:40]}")
    return value


# A served model's name as OpenAI's clients write them: no spaces, no quotes.
_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")


def pool(text: str) -> tuple[str, int]:
    """``NAME=N``: N workers serving the model NAME."""
    name, equals, count = text.partition("=")
    if not equals:
        raise argparse.ArgumentTypeError(f"not NAME=N: {text[:40]!r}")
    if _MODEL_NAME.fullmatch(name) is None:
        raise argparse.ArgumentTypeError(
            f"not a model name (letters, digits and ._:/- up to 128): {name[:40]!r}"
        )
    return name, at_least(1)(count)


def renamed(new: str) -> type[argparse.Action]:
    """An action for a flag's old names: it stores the value under the new one's name, with a
    one-line warning, so that users' scripts keep working for a release."""

    class Renamed(argparse.Action):
        def __call__(
            self,
            parser: argparse.ArgumentParser,
            namespace: argparse.Namespace,
            values: object,
            option_string: str | None = None,
        ) -> None:
            print(
                f"laneway: {option_string} is deprecated and goes in the next release: use {new}",
                file=sys.stderr,
            )
            setattr(namespace, self.dest, values)

    return Renamed
