"""LoRA adapters loaded at run time through vLLM's API, on sim workers holding two each
(`laneway up --max-loras 2`): loaded adapters are listed with their base model and answer as
models, each request runs on a worker with its adapter, the workers report what they hold, and
only an admin key loads or unloads."""

from __future__ import annotations

import asyncio

import httpx

from bus.topology import Subjects
from schemas.events import RequestFinished, RouteDecided, WorkerLoadReported
from tests.helpers import eventually
from tests.live import ClusterFactory, observe, registrations
from tests.security.keys_cli import create

BASE = "laneway-sim"
ADAPTERS = [f"ad-{i}" for i in range(4)]


async def test_adapters_load_serve_and_unload(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(
        workers=2, env={"LANEWAY_MAX_LORAS": "2", "LANEWAY_SIM_LORA_LOAD_MS": "20"}
    )
    workers = await registrations(cluster.etcd_endpoints)
    assert {reg.max_loras for reg in workers.values()} == {2}
    bus, seen = await observe(cluster.nats_url)
    held: dict[str, tuple[str, ...]] = {}

    async def on_load(report: WorkerLoadReported) -> None:
        held[report.worker_id] = report.loras

    await bus.subscribe(Subjects.all_load, on_load)
    try:
        async with httpx.AsyncClient(
            base_url=cluster.config.base_url, headers=cluster.api_headers, timeout=30
        ) as http:
            for name in ADAPTERS:
                body = {"lora_name": name, "lora_path": f"/adapters/{name}"}
                loaded = await http.post("/load_lora_adapter", json=body)
                assert loaded.status_code == 200, loaded.text
                assert loaded.text == f"Success: LoRA adapter '{name}' added successfully."
            again = await http.post(
                "/load_lora_adapter", json={"lora_name": "ad-0", "lora_path": "/elsewhere"}
            )
            assert again.status_code == 400
            assert "already been loaded" in again.json()["error"]["message"]
            clash = await http.post(
                "/load_lora_adapter", json={"lora_name": BASE, "lora_path": "/x"}
            )
            assert clash.status_code == 400 and clash.json()["error"]["param"] == "lora_name"

            listed = {m["id"]: m for m in (await http.get("/models")).json()["data"]}
            assert set(listed) == {BASE, *ADAPTERS}
            assert {listed[name]["parent"] for name in ADAPTERS} == {BASE}
            assert "root" not in listed["ad-1"]  # a path is the operator's, not every tenant's
            assert (await http.get("/models/ad-2")).json()["parent"] == BASE

            async def one(i: int) -> str:
                model = ADAPTERS[i % len(ADAPTERS)]
                body = {"model": model, "prompt": f"adapter request {i}", "max_tokens": 4}
                reply = await http.post("/completions", json=body)
                assert reply.status_code == 200, reply.text
                assert reply.json()["model"] == model
                return str(reply.json()["id"]).removeprefix("cmpl-")

            sent = await asyncio.gather(*(one(i) for i in range(16)))

            def routed() -> list[RouteDecided] | None:
                found = [seen.of(RouteDecided, rid) for rid in sent]
                done = all(seen.of(RequestFinished, rid) for rid in sent)
                return [r[0] for r in found] if all(found) and done else None  # type: ignore[misc]

            for i, route in enumerate(await eventually(routed, timeout=10)):
                spec = route.spec
                assert spec.model == BASE and spec.lora == ADAPTERS[i % len(ADAPTERS)]
                assert spec.lora_path == f"/adapters/{spec.lora}"
            # Each worker holds at most two, and the adapters run are held somewhere.
            await eventually(lambda: (len(held) == 2 and any(held.values())) or None, timeout=5)
            assert all(len(loras) <= 2 for loras in held.values()), held
            assert set().union(*held.values()) <= set(ADAPTERS)

            unloaded = await http.post("/unload_lora_adapter", json={"lora_name": "ad-3"})
            assert unloaded.status_code == 200
            assert unloaded.text == "Success: LoRA adapter 'ad-3' removed successfully."
            gone = await http.post(
                "/completions", json={"model": "ad-3", "prompt": "hi", "max_tokens": 2}
            )
            assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
            missing = await http.post("/unload_lora_adapter", json={"lora_name": "ad-3"})
            assert missing.status_code == 404

            # A key with the inference scope alone serves adapters but loads none.
            tenant = {"Authorization": f"Bearer {create(cluster, '--tenant', 'acme')}"}
            refused = await http.post(
                "/load_lora_adapter",
                json={"lora_name": "ad-9", "lora_path": "/p"},
                headers=tenant,
            )
            assert refused.status_code == 403
            assert refused.json()["error"]["code"] == "insufficient_scope"
            served = await http.post(
                "/completions",
                json={"model": "ad-1", "prompt": "hi", "max_tokens": 2},
                headers=tenant,
            )
            assert served.status_code == 200, served.text
    finally:
        await bus.close()
