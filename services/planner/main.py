"""Planner process: settings, connections, subscriptions."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from importlib.metadata import version
from typing import Any, ClassVar, Literal

import aetcd
from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from bus.client import Bus
from bus.etcd_space import guard_space
from bus.kv_source import BusKvSource, FoldSettings
from bus.permissions import leader_step_downs
from bus.registry import (
    LeasedKey,
    assign_roles,
    connect_etcd,
    watch_workers,
)
from bus.runtime import run_service
from bus.sessions import SessionStore
from bus.topology import Subjects
from observability.metrics import MetricsServer
from observability.tracing import setup_tracing
from schemas.events import new_id
from services.common.kv_follow import KvFollower
from services.common.kv_transfer import KvTransferModel
from services.planner.capacity import CapacityPlanner, CapacitySettings
from services.planner.capacity_loop import CapacityLoop
from services.planner.disagg import DisaggMode, DisaggSettings
from services.planner.handlers import Planner
from services.planner.intake_turn import IntakeTurn
from services.planner.kv_policy import KvSettings
from services.planner.output_length import OutputLengthPredictor
from services.planner.policy_registry import make_policy
from services.planner.replay import configured

log = logging.getLogger(__name__)

_KV = KvSettings()
_DISAGG = DisaggSettings()
_CAPACITY = CapacitySettings()


# The kv policy's knobs it takes from settings shared with others, and those settings.
SHARED_KNOBS = {
    "itl_target_ms": "LANEWAY_ITL_TARGET_MS",
    "kv_bytes_per_token": "LANEWAY_KV_BYTES_PER_TOKEN",
}


# Knobs a LANEWAY_KV_<NAME> may still name that the policy no longer reads, and what the
# operator is told: perf_model's old name is read by the renamed settings (which warn).
_LEFT_KNOBS = {
    "perf_model": "",
    "short_prompt_tokens": "LANEWAY_KV_SHORT_PROMPT_TOKENS is ignored and goes in the next "
    "release: routing short prompts by load alone lost on every trace measured",
}


class PlannerSettings(FoldSettings):
    # The kv policy's knobs are one nested setting: LANEWAY_KV_DECODE_WEIGHT is kv.decode_weight.
    model_config = SettingsConfigDict(env_nested_delimiter="_", env_nested_max_split=1)
    renamed: ClassVar[dict[str, str]] = {"LANEWAY_KV_PERF_MODEL": "perf_model"}

    instance_id: str = Field(default_factory=new_id)
    # round_robin | random | least_loaded | kv
    policy: str = "kv"
    seed: int = 0
    overlap_timeout_s: float = 0.05
    # Where overlap answers come from: the planner's own fold of the KV stream (the kv-indexer
    # asked while that has not caught up), or the kv-indexer always.
    overlaps: Literal["local", "indexer"] = "local"
    # How often the planner's fold checks that it has caught up with the stream's head.
    overlap_check_interval_s: float = Field(default=0.25, gt=0)
    # Seconds a session stays bound to its worker after the binding was last set (kv policy).
    session_ttl_s: int = 600
    # The perf model of workers that report no measured step costs (the workers' setting too).
    perf_model: str = _KV.perf_model
    # The kv policy's knobs, each read as LANEWAY_KV_<NAME> (kv_policy.KvSettings), the four
    # it derives from the settings below excepted (see kv_settings).
    kv: KvSettings = _KV
    # The output length the cost model assumes: learned from the requests that finished
    # (capped by each one's max_tokens), or the client's max_tokens itself.
    output_length: Literal["predicted", "max-tokens"] = "predicted"
    # With prefill workers: prefill remotely never, always, or when it pays (kv policy only).
    disagg: DisaggMode = _DISAGG.mode
    disagg_min_remote_tokens: int = _DISAGG.min_remote_tokens
    # The link between prefill and decode workers, as the planner models it.
    kv_bytes_per_token: int = _DISAGG.transfer.kv_bytes_per_token
    link_gb_s: float = _DISAGG.transfer.bandwidth_gb_s
    link_latency_ms: float = _DISAGG.transfer.latency_ms
    # The capacity loop (one replica at a time leads it): moves workers between the prefill
    # and decode pools against these targets.
    autoscale: bool = False
    # Sim workers run this many times faster than their perf model (`laneway bench
    # --time-scale`); the cost model predicts model time, so targets it is held to scale back.
    speedup: float = Field(default=1.0, gt=0)
    ttft_target_ms: float = _CAPACITY.ttft_target_ms
    itl_target_ms: float = _CAPACITY.itl_target_ms
    plan_interval_s: float = _CAPACITY.interval_s

    @model_validator(mode="before")
    @classmethod
    def _no_derived_knob(cls, data: Any) -> Any:
        knobs = data.get("kv") if isinstance(data, dict) else None
        if isinstance(knobs, dict):
            for knob, warning in _LEFT_KNOBS.items():
                if knob in knobs:
                    if warning:
                        log.warning(warning)
                    knobs = {k: v for k, v in knobs.items() if k != knob}
                    data = {**data, "kv": knobs}
            for knob, setting in SHARED_KNOBS.items():
                if knob in knobs:
                    raise ValueError(f"LANEWAY_KV_{knob.upper()} is read from {setting}")
        return data

    def kv_settings(self) -> KvSettings:
        """The kv policy's knobs, with those it shares: the perf model the workers run, the
        capacity loop's ITL target and the link model's KV size; targets scaled to model time."""
        return replace(
            self.kv,
            perf_model=self.perf_model,
            itl_target_ms=self.itl_target_ms * self.speedup,
            kv_bytes_per_token=self.kv_bytes_per_token,
            ttft_target_ms=self.kv.ttft_target_ms * self.speedup,
        )

    def capacity(self) -> CapacitySettings:
        return replace(
            _CAPACITY,
            ttft_target_ms=self.ttft_target_ms,
            itl_target_ms=self.itl_target_ms,
            interval_s=self.plan_interval_s,
        )

    def disagg_settings(self) -> DisaggSettings:
        return DisaggSettings(
            mode=self.disagg,
            min_remote_tokens=self.disagg_min_remote_tokens,
            ttft_target_ms=self.ttft_target_ms * self.speedup,
            transfer=KvTransferModel(self.kv_bytes_per_token, self.link_gb_s, self.link_latency_ms),
        )


async def _fold(bus: Bus, etcd: aetcd.Client, settings: PlannerSettings) -> KvFollower | None:
    """The planner's own fold of the KV stream, restored and following; None where it keeps
    none (or cannot start one, say on a bus whose permissions predate it: it asks instead)."""
    if settings.overlaps != "local":
        return None
    source = BusKvSource(bus, etcd)
    follower = KvFollower(source, settings.predicted_ttl_s, settings.purge_interval_s)
    try:
        await follower.start()
    except Exception:
        log.warning("no fold of the KV stream: the kv-indexer answers overlaps", exc_info=True)
        await follower.close()
        return None
    return follower


async def _keep_up(follower: KvFollower, interval_s: float) -> None:
    loop = asyncio.get_running_loop()
    while True:
        try:
            await follower.tick(loop.time())
        except Exception:  # checks must go on: without them the fold cannot tell it is behind
            log.warning("the KV fold's check failed", exc_info=True)
        await asyncio.sleep(interval_s)


def main() -> None:
    settings = PlannerSettings()

    async def serve(stop: asyncio.Event) -> None:
        setup_tracing("laneway-planner", settings.instance_id, settings.trace_exporter)
        bus = await Bus.connect(
            settings.nats_url,
            f"planner-{settings.instance_id}",
            steps_down=leader_step_downs("planner"),
        )
        await bus.provision(settings.stream_replicas, settings.bus_provisioned)
        etcd = connect_etcd(settings.etcd_endpoints)
        policy = make_policy(settings.policy, settings.seed, settings.kv_settings())
        source = f"planner/{settings.instance_id}"
        # Its decisions can be made again only with the settings they were made with.
        await bus.publish(
            Subjects.planner_configured,
            configured(
                source,
                settings.policy,
                settings.seed,
                settings.kv_settings(),
                settings.disagg_settings(),
                version("laneway"),
                settings.speedup,
            ),
        )
        sessions = SessionStore(etcd, settings.session_ttl_s) if settings.policy == "kv" else None
        follower = await _fold(bus, etcd, settings)
        planner = Planner(
            bus,
            policy,
            settings.instance_id,
            settings.overlap_timeout_s,
            sessions,
            disagg=settings.disagg_settings(),
            lengths=OutputLengthPredictor() if settings.output_length == "predicted" else None,
            follower=follower,
        )
        liveness = planner.cluster.liveness
        # A replica that hears every worker late, or its requests late, is behind a slow link
        # itself: every leader answers it late, and the others' step-down asks suffice.
        bus.asks_unless(lambda: liveness.behind() or planner.intake.late())
        tasks = [
            asyncio.create_task(watch_workers(etcd, planner.on_workers)),
            # etcd past its quota refuses the sessions' writes: every replica watches for it.
            asyncio.create_task(guard_space(etcd)),
        ]
        if follower is not None:
            tasks.append(asyncio.create_task(_keep_up(follower, settings.overlap_check_interval_s)))
        if sessions is not None:
            # The owners it routes by while etcd is away.
            tasks.append(asyncio.create_task(sessions.watch()))
            planner.metrics.registry.register(sessions.metrics)
        capacity = None
        leadership = LeasedKey.leader(etcd, settings.instance_id, ttl_s=5)
        if settings.autoscale:
            capacity = CapacityLoop(
                CapacityPlanner(settings.capacity()),
                planner.cluster,
                leadership,
                lambda roles: assign_roles(etcd, roles),
                bus.publish,
                source,
                planner.metrics.capacity_moves,
                planner.metrics.capacity_out_of_reach,
            )
            tasks.append(asyncio.create_task(capacity.run()))

        metrics = MetricsServer(planner.metrics.registry)
        await metrics.start(settings.metrics_host, settings.metrics_port)
        await planner.attach(capacity.on_finished if capacity is not None else None)
        presence = LeasedKey.planner(etcd, settings.instance_id, ttl_s=5)
        await presence.start()
        tasks.append(
            asyncio.create_task(planner.keep_intake(IntakeTurn(etcd, settings.instance_id)))
        )
        metrics.ready_when("bus", lambda: bus.nc.is_connected)
        await stop.wait()
        await presence.stop()
        await metrics.close()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if follower is not None:
            await follower.close()
        await leadership.stop()
        await bus.close()
        await etcd.close()

    run_service(serve, settings.log_level)


if __name__ == "__main__":
    main()
