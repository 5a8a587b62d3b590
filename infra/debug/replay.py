"""`laneway replay`: every recorded routing decision made again by the current code, from its
event and its planner replica's recorded settings alone; with ``--policy``, the what-if."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from infra.bench.report import format_table, write_json
from infra.debug import whatif
from infra.debug.log import LogIndex, add_source_arguments, load
from infra.recording import RecordingError
from services.planner.disagg import DisaggSettings
from services.planner.policy import Policy
from services.planner.replay import differences, redecide, settings_of


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    replay = sub.add_parser(
        "replay",
        help="make every recorded routing decision again and say which differ; with --policy, "
        "what another policy would have done with the recorded arrivals",
        description="Exit status: 0 all identical (or the what-if ran), 1 some decision "
        "differs, 2 the log cannot be read.",
    )
    add_source_arguments(replay)
    replay.add_argument("--json", type=Path, metavar="OUT", help="write the report here as JSON")
    whatif.add_arguments(replay)
    replay.set_defaults(func=main)


# What-if flags that only a --policy run reads: given without one, they would change nothing.
_WHAT_IF = ("workers", "prefill_workers", "disagg", "seed", "num_gpu_blocks", "plot")


def main(args: argparse.Namespace) -> int:
    given = [f"--{name.replace('_', '-')}" for name in _WHAT_IF if getattr(args, name) is not None]
    if args.policy is None and given:
        print(f"laneway replay: {', '.join(given)} ask what if: give --policy too", file=sys.stderr)
        return 2
    for output in (args.json, args.plot):
        if output is not None:
            output.parent.mkdir(parents=True, exist_ok=True)
    try:
        if args.policy is not None:
            return _what_if(load(args, *whatif.EVENTS), args)
        # Decisions carry their inputs: nothing else of the log needs decoding.
        report = replay_all(load(args, '"RouteDecided"'))
    except RecordingError as err:
        print(f"laneway replay: {err}", file=sys.stderr)
        return 2
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(render(report))
    return 1 if report["differing"] else 0


def replay_all(log: LogIndex) -> dict[str, Any]:
    """``decisions``, ``identical``, and for each decision that differs its request id, the
    terms that moved (``moved``) and how (``changes``: ``term: recorded -> now``)."""
    settings: dict[str, tuple[Policy, DisaggSettings]] = {}
    planners: dict[str, str] = {}
    differing = []
    routed = log.routed()
    if not routed:  # "0 identical" would read as a pass
        raise RecordingError("no routing decision in this log: nothing to replay")
    for request in routed:
        route = request.route
        assert route is not None
        config = log.config_of(route)
        if config is None:
            raise RecordingError(
                f"no PlannerConfigured for {route.source} (it decided request "
                f"{request.request_id}): its settings are not in this log"
            )
        planners[route.source] = config.version
        if config.event_id not in settings:
            settings[config.event_id] = settings_of(config)
        policy, disagg = settings[config.event_id]
        changes = differences(route, redecide(route, policy, disagg))
        if changes:
            differing.append(
                {
                    "request_id": request.request_id,
                    "planner": route.source,
                    "moved": sorted({change.split(":", 1)[0] for change in changes}),
                    "changes": changes,
                }
            )
    return {
        "decisions": len(routed),
        "identical": len(routed) - len(differing),
        "differing": differing,
        "planners": planners,
    }


def render(report: dict[str, Any]) -> str:
    planners = ", ".join(f"{p} ({v})" for p, v in sorted(report["planners"].items()))
    lines = [
        f"{report['decisions']} decisions replayed (recorded by {planners or 'no planner'}): "
        f"{report['identical']} identical, {len(report['differing'])} differ"
    ]
    for diff in report["differing"]:
        lines.append(f"  {diff['request_id']} ({diff['planner']}): {', '.join(diff['moved'])}")
        lines += [f"      {change}" for change in diff["changes"]]
    return "\n".join(lines)


def _what_if(log: LogIndex, args: argparse.Namespace) -> int:
    result = whatif.what_if(log, args)
    settings = result.report["settings"]
    recorded = f"recorded {settings['recorded_policy']}"
    simulated = f"what-if {args.policy}"
    print(
        f"{result.report['recorded']['requests']} recorded arrivals through the simulator: "
        f"{settings['workers']} decode and {settings['prefill_workers']} prefill workers, "
        f"disagg {settings['disagg']}, perf model {settings['perf_model']}"
    )
    reports = {recorded: result.report["recorded"], simulated: result.report["what_if"]}
    if args.json is not None:
        write_json(args.json, result.report)
    print(format_table(reports))
    if args.plot is not None:
        # matplotlib takes a second to import: only when a plot is asked for.
        from infra.bench.plot import plot_reports

        samples = {recorded: result.recorded_ttft_ms, simulated: result.simulated.ttft_ms()}
        plot_reports(args.plot, reports, samples, f"recorded run vs. {args.policy}")
    return 0
