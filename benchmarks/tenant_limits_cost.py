"""What a tenant's cluster-wide limits cost a request at ordinary load.

One `laneway up --workers 2 --ingresses 2` (keys on) serves three tenants taking turns, round
after round, with the same streamed load, their limits far above what the load reaches, so none
is ever refused (services.ingress.shared_limits): ``open`` has no limits; ``capped`` a
concurrency limit and a token quota, which far below the limit it takes from its replica's
reserve; ``rated`` a request rate, which claims each admission in etcd. The figures are medians
over the rounds, and each limited tenant's as a ratio to the open one's.

``python -m benchmarks.tenant_limits_cost`` prints each round as JSON, then the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys

import orjson

from benchmarks.live_cluster import RunningUp, laneway_up
from infra.bench.load_client import LoadSpec, run_load

MODEL = "laneway-sim"
TENANTS = {
    "open": (),
    "capped": ("--max-concurrency", "1000", "--tokens-per-minute", "1000000000"),
    "rated": ("--rate", "10000"),
}
FIGURES = ("ttft_ms_p50", "ttft_ms_p95", "lat_ms_p50", "rps")


def _key(up: RunningUp, tenant: str, *limits: str) -> str:
    command = [sys.executable, "-m", "infra.cli", "keys", "create", "--tenant", tenant]
    made = subprocess.run(
        [*command, *limits, "--state-dir", str(up.state_dir)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return made.stdout.splitlines()[-1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.tenant_limits_cost", description=__doc__
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=200, help="per tenant and round")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--speedup", type=float, default=1.0, help="of the sim's modelled time")
    args = parser.parse_args(argv)
    results: dict[str, list[dict[str, object]]] = {tenant: [] for tenant in TENANTS}
    with laneway_up(workers=2, speedup=args.speedup, extra_args=("--ingresses", "2")) as up:
        keys = {tenant: _key(up, tenant, *limits) for tenant, limits in TENANTS.items()}
        for round_ in range(args.rounds):
            for tenant, key in keys.items():
                spec = LoadSpec(
                    base_url=up.base_url,
                    model=MODEL,
                    api_key=key,
                    concurrency=args.concurrency,
                    requests=args.requests,
                    warmup=5,
                    max_tokens=args.max_tokens,
                    # A connection each: the kernel spreads them over both replicas.
                    new_connection=True,
                    seed=round_,
                    label=tenant,
                )
                result = asyncio.run(run_load(spec))
                print(orjson.dumps(result).decode(), flush=True)
                results[tenant].append(result)
    errors = sum(int(str(r["errors"])) for runs in results.values() for r in runs)
    medians = {
        tenant: {f: statistics.median(float(str(r[f])) for r in runs) for f in FIGURES}
        for tenant, runs in results.items()
    }
    print(orjson.dumps({"medians": medians, "errors": errors}).decode())
    for tenant in ("capped", "rated"):
        for figure in FIGURES:
            ratio = medians[tenant][figure] / medians["open"][figure]
            print(f"{tenant}/open {figure}: {ratio:.3f}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
