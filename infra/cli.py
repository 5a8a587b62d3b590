"""The ``laneway`` command."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Callable
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING

from infra import cluster_args
from infra.arg_types import at_least, pool, port, positive
from infra.engine_env import engine_env as _engine_env
from infra.recording import RecordingError
from services.planner.policy_registry import POLICY_NAMES

if TYPE_CHECKING:  # imported by `laneway up` alone: see _COMMANDS
    from infra.cluster import LocalCluster


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends each option's default to its help, unless there is none to show (no default, or
    a switch that is off unless given)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def _add_up(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    up = sub.add_parser("up", help="start the whole local cluster and serve the OpenAI API")
    up.add_argument("--host", default="127.0.0.1", help="HTTP bind address")
    up.add_argument("--port", type=port, default=8000, help="HTTP port of the OpenAI API")
    cluster_args.add_server_arguments(up, "an embedded one")
    up.add_argument(
        "--ha",
        action="store_true",
        help="embed a 3-node JetStream cluster and a 3-member etcd cluster (streams on 3 "
        "servers) instead of single nodes; services fail over between their members",
    )
    up.add_argument("--nats-port", type=port, help="port of the embedded NATS (default: free)")
    up.add_argument("--etcd-port", type=port, help="port of the embedded etcd (default: free)")
    up.add_argument(
        "--workers",
        type=at_least(1),
        # No default of its own: given with --pool, it is refused.
        help="workers that decode (aggregated without a prefill pool) (default: 2)",
    )
    up.add_argument(
        "--pool",
        type=pool,
        action="append",
        metavar="NAME=N",
        help="N workers serving the model NAME (repeatable, instead of --workers): the sim "
        "engine serves NAME, a real one its --model folder under NAME",
    )
    up.add_argument("--prefill-workers", type=at_least(0), default=0, help="prefill-only workers")
    up.add_argument(
        "--ingresses",
        type=int,
        default=1,
        help="ingress processes sharing the API port (SO_REUSEPORT): one is one core's work",
    )
    up.add_argument(
        "--planners",
        type=at_least(1),
        default=1,
        help="planner replicas: each routes its share of the requests, all fold every event "
        "(docs/performance.md: what one core of each service carries)",
    )
    cluster_args.add_disagg_argument(up)
    up.add_argument(
        "--autoscale", action="store_true", help="capacity loop: move workers between the pools"
    )
    up.add_argument(
        "--policy",
        default="kv",
        choices=POLICY_NAMES,
        help="routing policy of the planner",
    )
    up.add_argument(
        "--engine",
        choices=["sim", "torch", "trtllm", "vllm"],
        default="sim",
        help="worker engine; sim: modelled GPU time, real KV accounting, served as model "
        "'laneway-sim', one token per UTF-8 byte of the prompt (its chat template included)",
    )
    up.add_argument(
        "--model",
        type=Path,
        help="torch, trtllm and vllm engines: a Hugging Face layout model folder, served under its "
        "folder's name with its tokenizer (the sim takes none)",
    )
    up.add_argument(
        "--max-model-len",
        type=int,
        help="most tokens, prompt and completion together, of one request (default: all the "
        "engine holds: the model's max_position_embeddings and the KV pool; the sim's KV pool, "
        "num_gpu_blocks x block_size)",
    )
    up.add_argument(
        "--max-loras",
        type=at_least(0),
        default=0,
        help="LoRA adapters each worker holds at once, loaded on demand (least recently used out "
        "beyond; sim and vllm engines; default 0: none); adapters are loaded with POST "
        "/v1/load_lora_adapter (docs/models.md)",
    )
    cluster_args.add_perf_model_argument(up)
    up.add_argument("--speedup", type=positive, default=1.0, help="sim engine speed-up factor")
    up.add_argument("--state-dir", type=Path, default=Path(".state"), help="data and logs")
    up.add_argument(
        "--no-auth",
        action="store_true",
        help="local experiments: the API takes requests without a key (by default it needs "
        "one; a key for this run is kept in STATE_DIR/api-key, `laneway keys` makes more)",
    )
    up.add_argument(
        "--no-bus-auth",
        action="store_true",
        help="experiments: the embedded NATS and etcd let anyone in (by default each service "
        "has a user of its own there, with only its subjects and keys; see docs/security.md)",
    )
    up.add_argument("--tls-cert", type=Path, help="serve the API over HTTPS: PEM certificate")
    up.add_argument("--tls-key", type=Path, help="with --tls-cert: its PEM private key")
    up.add_argument(
        "--bus-tls-dir",
        type=Path,
        help="NATS and etcd over TLS: a folder with ca.pem, server.pem and server-key.pem (the "
        "embedded servers' certificate), and optionally client.pem and client-key.pem (then the "
        "embedded servers take only clients with a certificate from that CA): see docs/security.md",
    )
    up.add_argument(
        "--trace-exporter",
        default="none",
        help="where spans go: none, console (each service's log in STATE_DIR/logs, batched for "
        "up to 5 s), otlp (OTEL_EXPORTER_OTLP_ENDPOINT) or file:PATH (JSON lines)",
    )
    up.set_defaults(func=_up)


def _context_env(max_model_len: int | None) -> dict[str, str]:
    # Unset, each worker registers what its engine holds and the ingress follows the workers.
    if max_model_len is None:
        return {}
    if max_model_len < 1:
        raise SystemExit("laneway up: --max-model-len must be positive")
    return {"LANEWAY_MAX_MODEL_LEN": str(max_model_len)}


def _add_make_tiny_model(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    tiny = sub.add_parser("make-tiny-model", help="write a small seeded model and tokenizer")
    tiny.add_argument("dir", type=Path, help="folder to write (created if missing)")
    tiny.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    tiny.set_defaults(func=_make_tiny_model)


def _add_make_tiny_lora(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    lora = sub.add_parser(
        "make-tiny-lora", help="write a small seeded LoRA adapter for a make-tiny-model folder"
    )
    lora.add_argument("dir", type=Path, help="folder to write (created if missing)")
    lora.add_argument("--base", type=Path, required=True, help="the make-tiny-model folder")
    lora.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    lora.add_argument("--rank", type=int, default=8, help="the adapter's rank")
    lora.set_defaults(func=_make_tiny_lora)


def _make_tiny_lora(args: argparse.Namespace) -> int:
    from services.engine.torch_engine.tiny_lora import make_tiny_lora

    try:
        make_tiny_lora(args.dir, args.base, seed=args.seed, rank=args.rank)
    except (OSError, KeyError, ValueError) as exc:  # no base folder, not a tiny model's config
        print(f"laneway make-tiny-lora: cannot write {args.dir}: {exc}", file=sys.stderr)
        return 2
    print(f"wrote a rank-{args.rank} LoRA adapter for {args.base} to {args.dir}")
    return 0


def _make_tiny_model(args: argparse.Namespace) -> int:
    from services.engine.torch_engine.tiny import make_tiny_model

    try:
        make_tiny_model(args.dir, seed=args.seed)
    except OSError as exc:  # a file in the way, a folder that cannot be made
        print(
            f"laneway make-tiny-model: cannot write {args.dir}: {exc.strerror or exc}",
            file=sys.stderr,
        )
        return 2
    print(f"wrote a tiny Llama checkpoint and tokenizer to {args.dir}")
    return 0


def _up(args: argparse.Namespace) -> int:
    from infra.cluster import LocalCluster
    from infra.cluster_plan import ClusterConfig
    from infra.startup import StartupError
    from infra.supervisor import GaveUp

    if (args.tls_cert is None) != (args.tls_key is None):
        raise SystemExit("laneway up: --tls-cert and --tls-key go together")
    if args.ingresses < 1:
        raise SystemExit("laneway up: --ingresses must be at least 1")
    pools = _pools(args)
    tls = (args.tls_cert.resolve(), args.tls_key.resolve()) if args.tls_cert else None
    cluster = LocalCluster(
        ClusterConfig(
            state_dir=args.state_dir.resolve(),
            http_host=args.host,
            http_port=args.port,
            nats_url=args.nats_url,
            etcd_endpoints=args.etcd_endpoints,
            nats_port=args.nats_port,
            etcd_port=args.etcd_port,
            ha=args.ha,
            workers=args.workers or 2,
            pools=pools,
            prefill_workers=args.prefill_workers,
            ingresses=args.ingresses,
            planners=args.planners,
            policy=args.policy,
            api_auth=not args.no_auth,
            auth=not args.no_bus_auth,
            bus_credentials=args.bus_credentials.resolve() if args.bus_credentials else None,
            api_tls=tls,
            bus_tls=args.bus_tls_dir.resolve() if args.bus_tls_dir else None,
            env={
                "LANEWAY_PERF_MODEL": args.perf_model,
                "LANEWAY_SPEEDUP": str(args.speedup),
                "LANEWAY_TRACE_EXPORTER": args.trace_exporter,
                "LANEWAY_DISAGG": args.disagg,
                "LANEWAY_AUTOSCALE": str(args.autoscale).lower(),
                "LANEWAY_MAX_LORAS": str(args.max_loras),
                **_engine_env(args.engine, args.model),
                **_context_env(args.max_model_len),
            },
        )
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    # The cluster's notices (leftovers of a killed run stopped) as one line each.
    logging.basicConfig(format="laneway up: %(message)s", level=logging.WARNING)
    print("starting Laneway …", flush=True)
    try:
        cluster.start()
    except StartupError as exc:
        print(f"laneway up: {exc}", file=sys.stderr, flush=True)
        return 1
    try:
        print(f"Laneway is serving the OpenAI API at {cluster.config.base_url}", flush=True)
        _print_where_secrets_are(cluster)
        for name, pid in cluster.pids().items():
            print(f"  {name:<18} pid {pid}", flush=True)
        print(f"logs: {cluster.logs}   (Ctrl-C stops everything)", flush=True)
        cluster.supervise(stop)
    except GaveUp as exc:
        print(f"laneway up: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        print("stopping …", flush=True)
        cluster.stop()
    return 0


def _pools(args: argparse.Namespace) -> dict[str, int]:
    """``--pool``'s model names and their workers; SystemExit where they cannot be run."""
    if not args.pool:
        return {}
    if args.workers is not None:
        raise SystemExit("laneway up: --pool NAME=N or --workers N, not both")
    if args.prefill_workers:
        # Whose prefills they would serve is no one's to guess; --autoscale splits each pool's.
        raise SystemExit("laneway up: --prefill-workers serves one model, not --pool's")
    pools = dict(args.pool)
    if len(pools) < len(args.pool):
        raise SystemExit("laneway up: each --pool NAME once")
    return pools


def _print_where_secrets_are(cluster: LocalCluster) -> None:
    """The servers' addresses and the files of the run's key and of the admin's credentials,
    never what those hold: what `laneway up` prints ends up in terminals' scrollback, CI logs
    and journald, which the secrets would outlive (the files are 0600, in a 0700 state dir)."""
    from bus.credentials import split_credentials
    from infra.cluster_auth import admin_files
    from infra.keys import STARTUP_KEY_FILE

    state = cluster.config.state_dir
    if cluster.api_key:
        print(f"  API key of this run in {state / STARTUP_KEY_FILE}", flush=True)
    admin = admin_files(state)
    for server, addresses in (("NATS", cluster.nats_url), ("etcd", cluster.etcd_endpoints)):
        plain = split_credentials(addresses)[1]
        creds = admin.get(server.lower())
        print(f"  {server} {plain}" + (f"  (admin: {creds})" if creds else ""), flush=True)


# Each command's parser, in `laneway --help`'s order: added by a function here or by the
# ``add_parser`` of a module of its own. Between them those modules import NATS, aiohttp and
# etcd's gRPC client, half a second an offline `laneway bench` would spend on what it never runs,
# so running a command imports its module alone.
_COMMANDS: dict[str, str | Callable[..., None]] = {
    "up": _add_up,
    "serve": "infra.serve",
    "bench-engine": "infra.bench.engine_bench",
    "make-tiny-model": _add_make_tiny_model,
    "make-tiny-lora": _add_make_tiny_lora,
    "bench": "infra.bench.run",
    "record": "infra.record_export",
    "explain": "infra.debug.explain",
    "replay": "infra.debug.replay",
    "status": "infra.status",
    "keys": "infra.keys",
    "usage": "infra.usage",
    "bus": "infra.bus_provision",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Every command's parser; with a known ``command``, that command's alone (what running it
    needs imported)."""
    parser = argparse.ArgumentParser(
        prog="laneway",
        description="Laneway's local cluster and benchmarks; `laneway COMMAND --help` shows a "
        "command's flags with their defaults and choices.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, adder in _COMMANDS.items():
        if command not in _COMMANDS or name == command:
            (import_module(adder).add_parser if isinstance(adder, str) else adder)(sub)
    for leaf in _leaf_parsers(sub):
        leaf.formatter_class = _DefaultsFormatter
    return parser


def _leaf_parsers(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
) -> list[argparse.ArgumentParser]:
    """Every command's parser, and a command's own commands' (`record export`) in its place."""
    leaves = []
    for command in sub.choices.values():
        nested = [a for a in command._actions if isinstance(a, argparse._SubParsersAction)]
        leaves += [p for n in nested for p in _leaf_parsers(n)] or [command]
    return leaves


# What only the benchmarks and plots use (`laneway bench`, `replay --what-if`, `--plot`): the
# `bench` extra, not the product's requirements.
_BENCH_EXTRA = ("numpy", "matplotlib")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = build_parser(argv[0] if argv else None).parse_args(argv)
        return int(args.func(args))
    except RecordingError as err:
        print(f"laneway: {err}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as err:
        if err.name not in _BENCH_EXTRA:
            raise
        print(
            f"laneway: this needs {err.name}, of the bench extra: pip install 'laneway[bench]'",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
