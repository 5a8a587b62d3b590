"""`laneway bench`'s KV-beyond-one-worker settings: a host-memory tier per worker, a topology of
nodes, and what output length the planner is told. Flags, settings and their report."""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from typing import Any, Literal

from services.planner.output_length import OutputLengthPredictor

OutputLengthMode = Literal["oracle", "predicted", "max-tokens"]


@dataclass(frozen=True, slots=True)
class TierSettings:
    # Host tier capacity per worker, as a multiple of its GPU KV (0: none), and its PCIe link.
    host_kv_ratio: float = 0.0
    host_link_gb_s: float = 25.0
    # Nodes × workers per node; None: no topology, hence no KV moves between workers.
    topology: tuple[int, int] | None = None
    # What the planner is told of a request's output length: the trace's true length (what
    # today's replays did), a predictor's estimate, or a fixed client max_tokens.
    output_length: OutputLengthMode = "predicted"
    max_tokens: int = 0

    def report(self) -> dict[str, Any]:
        fields = asdict(self)
        fields["topology"] = "x".join(map(str, self.topology)) if self.topology else None
        return fields


def parse_topology(text: str) -> tuple[int, int]:
    nodes, _, per_node = text.lower().partition("x")
    try:
        shape = int(nodes), int(per_node)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"topology {text!r} is not NxM (nodes x workers)"
        ) from None
    if min(shape) < 1:
        raise argparse.ArgumentTypeError(f"topology {text!r} needs at least 1x1")
    return shape


def add_tier_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = TierSettings()
    parser.add_argument(
        "--host-kv-ratio",
        type=float,
        default=defaults.host_kv_ratio,
        help="host-memory KV tier per worker, as a multiple of its GPU KV (0: none)",
    )
    parser.add_argument(
        "--host-link-gb-s",
        type=float,
        default=defaults.host_link_gb_s,
        help="PCIe bandwidth a host-tier hit loads over",
    )
    parser.add_argument(
        "--topology",
        type=parse_topology,
        help="offline: NxM, N nodes of M workers (--workers = N*M); the kv policy may then "
        "move a prompt's KV between workers (NVLink within a node, RDMA across)",
    )
    parser.add_argument(
        "--output-length",
        nargs="+",
        default=[defaults.output_length],
        metavar="MODE",
        help="output length the planner is told: oracle (the trace's), predicted (learned "
        "from finished requests), or max-tokens N (offline only)",
    )


def tier_settings(args: argparse.Namespace, workers: int) -> TierSettings:
    """The flags' settings; ValueError for a combination that makes no sense."""
    mode, *rest = args.output_length
    max_tokens = 0
    if mode == "max-tokens" and len(rest) == 1 and rest[0].isdigit() and int(rest[0]) > 0:
        max_tokens = int(rest[0])
    elif mode not in ("oracle", "predicted") or rest:
        raise ValueError("--output-length takes oracle, predicted or max-tokens N")
    if args.topology and args.topology[0] * args.topology[1] != workers:
        raise ValueError(f"--topology {args.topology[0]}x{args.topology[1]} is not the workers")
    if args.host_kv_ratio < 0 or args.host_link_gb_s <= 0:
        raise ValueError("--host-kv-ratio must be >= 0 and --host-link-gb-s positive")
    return TierSettings(args.host_kv_ratio, args.host_link_gb_s, args.topology, mode, max_tokens)


def live_env(settings: TierSettings, num_gpu_blocks: int) -> dict[str, str]:
    """The workers' and planner's settings of a live replay; ValueError for what only an
    offline one models (its workers share one environment, so no topology; the client's
    max_tokens is the length generated, so no other one to tell the planner)."""
    if settings.topology is not None:
        raise ValueError("--topology is offline only (live workers say LANEWAY_NODE themselves)")
    if settings.output_length == "max-tokens":
        raise ValueError("--output-length max-tokens is offline only")
    oracle = settings.output_length == "oracle"
    return {
        "LANEWAY_HOST_KV_BLOCKS": str(round(settings.host_kv_ratio * num_gpu_blocks)),
        "LANEWAY_HOST_LINK_GB_S": str(settings.host_link_gb_s),
        "LANEWAY_KV_HOST_LINK_GB_S": str(settings.host_link_gb_s),
        # Live, the client's max_tokens is the trace's true length: `oracle` is trusting it.
        "LANEWAY_OUTPUT_LENGTH": "max-tokens" if oracle else "predicted",
    }


def placement(index: int, topology: tuple[int, int] | None) -> str:
    """The node of the ``index``-th worker (prefill workers first): workers fill nodes in
    order ('' without topology)."""
    return f"n{index // topology[1]}" if topology else ""


class OutputLengths:
    """The output length a replay tells the planner for each request, per mode, and how far the
    predictor was from the truth."""

    def __init__(self, settings: TierSettings, context_tokens: int) -> None:
        self._mode = settings.output_length
        self._max_tokens = settings.max_tokens
        # A client that gives no max_tokens may get all the context the engine has left.
        self._context = context_tokens
        self._predictor = OutputLengthPredictor()
        # The estimate each request in flight was routed with, by request number.
        self._expected: dict[int, int] = {}
        self._abs_error = self._error = 0.0
        self._pct_error = 0.0
        self._count = 0
        self._routed = 0
        # When asked for (a list): each lesson as (requests routed before it, request number,
        # prompt tokens, output tokens), in the order the predictor learned them, so that a
        # live planner can be taught the same (tests/planner/test_decision_parity.py).
        self.lessons: list[tuple[int, int, int, int]] | None = None

    @property
    def learns(self) -> bool:
        """Whether finished requests teach the predictor (in what order matters)."""
        return self._mode == "predicted"

    def route(self, key: int, prompt_tokens: int, true_tokens: int) -> tuple[int, int | None]:
        """``(max_tokens, expected_tokens)`` of request ``key`` as the planner sees it."""
        self._routed += 1
        if self._mode == "oracle":
            return true_tokens, None
        if self._mode == "max-tokens":
            return self._max_tokens, None
        cap = max(1, self._context - prompt_tokens)
        expected = self._expected[key] = self._predictor.predict(None, prompt_tokens, cap)
        return cap, expected

    def finished(self, key: int, prompt_tokens: int, output_tokens: int) -> None:
        """Request ``key`` ended after ``output_tokens``: the predictor learns, the error adds."""
        expected = self._expected.pop(key, None)
        if expected is None:
            return
        self._predictor.observe(None, prompt_tokens, output_tokens)
        if self.lessons is not None:
            self.lessons.append((self._routed, key, prompt_tokens, output_tokens))
        error = expected - output_tokens
        self._count += 1
        self._error += error
        self._abs_error += abs(error)
        self._pct_error += abs(error) / max(1, output_tokens)

    def report(self) -> dict[str, Any]:
        n = max(1, self._count)
        return {
            "mode": self._mode,
            "predicted_requests": self._count,
            "mean_abs_error_tokens": self._abs_error / n,
            "mean_error_tokens": self._error / n,
            "mean_abs_pct_error": self._pct_error / n,
        }
