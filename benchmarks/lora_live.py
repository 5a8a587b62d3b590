"""LoRA adapters on a live cluster, kv routing against round robin: for each policy a
`laneway up --workers 4 --max-loras 2 --policy P` (sim workers, adapters modelled to load in
LANEWAY_SIM_LORA_LOAD_MS, 150 by default), 12 adapters loaded through `POST
/v1/load_lora_adapter`, then 300 streamed requests at concurrency 16, each asking for an adapter
drawn Zipf(1.1). Prints one JSON line per policy (the load client's summary) and the ratio of
the TTFT means.

    python -m benchmarks.lora_live [--requests 300 --concurrency 16 --adapters 12 --zipf 1.1]
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import httpx
import orjson

from benchmarks.live_cluster import laneway_up
from infra.bench.load_client import LoadSpec, headers, run_load

POLICIES = ("kv", "round_robin")


def _load_adapters(base_url: str, api_key: str | None, names: list[str]) -> None:
    with httpx.Client(base_url=base_url, headers=headers(api_key), timeout=30) as http:
        for name in names:
            loaded = http.post(
                "/load_lora_adapter", json={"lora_name": name, "lora_path": f"/adapters/{name}"}
            )
            loaded.raise_for_status()
        listed = {m["id"] for m in http.get("/models").json()["data"]}
    missing = set(names) - listed
    if missing:
        raise RuntimeError(f"loaded adapters missing from /v1/models: {sorted(missing)}")


def run(policy: str, args: argparse.Namespace) -> dict[str, object]:
    names = [f"adapter-{i}" for i in range(args.adapters)]
    extra = ("--max-loras", str(args.max_loras), "--policy", policy)
    with laneway_up(workers=args.workers, speedup=args.speedup, extra_args=extra) as up:
        _load_adapters(up.base_url, up.api_key, names)
        spec = LoadSpec(
            base_url=up.base_url,
            model=names[0],
            api_key=up.api_key,
            concurrency=args.concurrency,
            requests=args.requests,
            warmup=0,
            max_tokens=args.max_tokens,
            models=tuple(names),
            zipf_s=args.zipf,
            seed=args.seed,
            label=policy,
        )
        return asyncio.run(run_load(spec))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lora_live", description=__doc__)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--max-loras", type=int, default=2)
    parser.add_argument("--adapters", type=int, default=12)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--speedup", type=float, default=1.0, help="of the sim's modelled time")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    results = {policy: run(policy, args) for policy in POLICIES}
    for result in results.values():
        print(orjson.dumps(result).decode(), flush=True)
    kv, rr = (results[p]["ttft_ms_mean"] for p in POLICIES)
    errors = sum(int(str(r["errors"])) for r in results.values())
    if not isinstance(kv, float) or not isinstance(rr, float):
        print("no TTFT measured", file=sys.stderr)
        return 1
    print(f"TTFT mean kv/round_robin: {kv / rr:.3f} ({kv:.1f} / {rr:.1f} ms), errors {errors}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
