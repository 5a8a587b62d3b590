"""Planner process: settings, connections, subscriptions."""

from __future__ import annotations

import asyncio
import contextlib

from pydantic import Field

from bus.client import Bus
from bus.registry import connect_etcd, watch_workers
from bus.runtime import run_service
from bus.settings import ServiceSettings
from bus.topology import PLANNER_INTAKE, Subjects
from observability.tracing import setup_tracing
from schemas.events import new_id
from services.planner.handlers import Planner
from services.planner.policy import make_policy


class PlannerSettings(ServiceSettings):
    instance_id: str = Field(default_factory=new_id)
    # round_robin | random | least_loaded
    policy: str = "least_loaded"
    seed: int = 0
    overlap_timeout_s: float = 0.05


def main() -> None:
    settings = PlannerSettings()

    async def serve(stop: asyncio.Event) -> None:
        setup_tracing("laneway-planner", settings.instance_id, settings.trace_exporter)
        bus = await Bus.connect(settings.nats_url, f"planner-{settings.instance_id}")
        await bus.ensure_streams()
        etcd = connect_etcd(settings.etcd_endpoints)
        planner = Planner(
            bus,
            make_policy(settings.policy, settings.seed),
            settings.instance_id,
            settings.overlap_timeout_s,
        )
        watcher = asyncio.create_task(watch_workers(etcd, planner.on_workers))
        await bus.subscribe(Subjects.all_request_terminals, planner.on_terminal)
        await bus.subscribe(Subjects.all_load, planner.on_load)
        await bus.consume(PLANNER_INTAKE, planner.on_request)
        await stop.wait()
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        await bus.close()
        await etcd.close()

    run_service(serve, settings.log_level)


if __name__ == "__main__":
    main()
