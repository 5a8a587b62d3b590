"""Summing py-spy's collapsed stacks by function and package."""

from __future__ import annotations

from benchmarks.profile_summary import NATIVE_LOOP, package, parse, report

STACKS = [
    "main (services/ingress/main.py:3);Runner.run (asyncio/runners.py:118) 6\n",
    "main (services/ingress/main.py:3);Runner.run (asyncio/runners.py:118);"
    "handle (services/ingress/app.py:40);BaseModel.__init__ (pydantic/main.py:250) 3\n",
    "main (services/ingress/main.py:3);Runner.run (asyncio/runners.py:118);"
    "handle (services/ingress/app.py:40);walk (bus/codec.py:9);walk (bus/codec.py:12) 1\n",
    "garbage without a count\n",
]


def test_self_and_total_by_function_and_package() -> None:
    profile = parse(STACKS)
    assert profile.samples == 10
    assert profile.self_by_package == {NATIVE_LOOP: 6, "pydantic": 3, "bus": 1}
    assert profile.self_by_function["BaseModel.__init__ (pydantic/main.py)"] == 3
    # On the stack twice in one sample (recursion): counted once.
    assert profile.total_by_function["walk (bus/codec.py)"] == 1
    assert profile.total_by_function["handle (services/ingress/app.py)"] == 4
    text = report("ingress", profile)
    assert text.splitlines()[0] == "# ingress: 10 samples (on CPU)"
    assert " 60.0%  event loop (native)" in text


def test_packages() -> None:
    assert package("services/planner/decision.py") == "services/planner"
    assert package("nats/aio/client.py") == "nats"
    assert package("<frozen abc>") == "<frozen abc>"
    assert package("secrets.py") == "secrets"
