"""What a py-spy profile says in a few lines: collapsed stacks (``py-spy record --format raw``,
one ``frame;frame;… count`` a line, root first) summed by function and by package.

A frame reads ``function (path:line)``; the path is py-spy's short one (``asyncio/events.py``,
``pydantic/main.py``, ``services/ingress/app.py``). A package is the path's first folder, two
for the project's ``services/<service>``, or the file's name for a top-level module.

A sample whose innermost Python frame is the loop's entry (``asyncio/runners.py``) was in native
code under it: uvloop's C loop, its socket reads and writes and their system calls (py-spy counts
a thread in a system call other than a wait as on CPU). Its package reads ``event loop (native)``.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

_FRAME = re.compile(r"^(?P<name>.*) \((?P<path>[^()]*?)(?::\d+)?\)$")


@dataclass
class Profile:
    samples: int = 0
    # Samples whose innermost frame is this function (where the CPU was).
    self_by_function: Counter[str] = field(default_factory=Counter)
    # Samples with this function anywhere on the stack (what its calls cost in all).
    total_by_function: Counter[str] = field(default_factory=Counter)
    self_by_package: Counter[str] = field(default_factory=Counter)


def frame_parts(frame: str) -> tuple[str, str]:
    """A frame's function name with its path, and its package."""
    m = _FRAME.match(frame)
    if m is None:
        return frame, frame
    path = m.group("path")
    return f"{m.group('name')} ({path})", package(path)


NATIVE_LOOP = "event loop (native)"


def package(path: str) -> str:
    if path == "asyncio/runners.py":
        return NATIVE_LOOP
    parts = path.split("/")
    if len(parts) == 1:
        return parts[0].removesuffix(".py")
    if parts[0] == "services" and len(parts) > 2:
        return "/".join(parts[:2])
    return parts[0]


def parse(lines: Iterable[str]) -> Profile:
    profile = Profile()
    for line in lines:
        stack, _, count_text = line.rstrip("\n").rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [frame_parts(f) for f in stack.split(";")]
        profile.samples += count
        leaf, leaf_package = frames[-1]
        profile.self_by_function[leaf] += count
        profile.self_by_package[leaf_package] += count
        for name in {name for name, _ in frames}:  # a recursive function counts once
            profile.total_by_function[name] += count
    return profile


def report(name: str, profile: Profile, top: int = 25) -> str:
    def share(n: int) -> str:
        return f"{100 * n / profile.samples:5.1f}%"

    lines = [f"# {name}: {profile.samples} samples (on CPU)", "", "## self, by package"]
    lines += [f"{share(n)}  {p}" for p, n in profile.self_by_package.most_common(top)]
    lines += ["", "## self, by function"]
    lines += [f"{share(n)}  {f}" for f, n in profile.self_by_function.most_common(top)]
    lines += ["", "## total (on the stack), by function"]
    lines += [f"{share(n)}  {f}" for f, n in profile.total_by_function.most_common(top * 2)]
    return "\n".join(lines) + "\n"
