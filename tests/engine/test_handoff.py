"""The decode side of a hand-off: how long it waits for the KV, and what must arrive."""

from __future__ import annotations

import time

import pytest

from schemas.events import (
    KvPayload,
    PrefillCompleted,
    PrefillPlacement,
    RequestSpec,
    SamplingParams,
    utc_now,
)
from services.common.kv_transfer import KvTransferModel
from services.worker.handoff import KvReceiver

SPEC = RequestSpec(
    model="m",
    prompt_token_ids=(1, 2, 3, 4, 5),
    block_size=4,
    block_hashes=(7,),
    sampling=SamplingParams(max_tokens=6, temperature=0),
    reply_to="i",
    deadline=utc_now(),
)


def completed(**fields: object) -> PrefillCompleted:
    defaults: dict[str, object] = {
        "source": "p",
        "request_id": "r",
        "worker_id": "p1",
        "decode_worker_id": "d1",
        "prefilled_tokens": 4,
        "first_token_id": 9,
        "block_hashes": (7,),
    }
    return PrefillCompleted(**{**defaults, **fields})  # type: ignore[arg-type]


def test_the_wait_scales_with_the_prediction_and_never_goes_below_the_floor() -> None:
    receiver = KvReceiver(4, KvTransferModel(), speedup=2.0, timeout_s=1.0, timeout_factor=3.0)
    quick = PrefillPlacement(prefill_worker_id="p", local_ms=100, remote_ms=50, reason="x")
    slow = quick.model_copy(update={"remote_ms": 10_000})
    assert receiver.deadline_s(quick) == 1.0
    assert receiver.deadline_s(slow) == pytest.approx(15.0)  # 3 × 10 s at speed-up 2


async def test_modelled_kv_takes_the_links_time_and_real_kv_must_arrive() -> None:
    link = KvTransferModel(kv_bytes_per_token=1_000_000, bandwidth_gb_s=1.0, latency_ms=0.0)
    receiver = KvReceiver(4, link, speedup=0.2, timeout_s=0.1, timeout_factor=1.0)
    started = time.monotonic()
    # A 10-token prompt, one block of it cached here: 6 tokens cross, the partial block's too.
    assert await receiver.receive(completed(block_hashes=(7, 8)), 1, 10) == b""
    assert time.monotonic() - started >= 0.029  # 6 tokens × 1 ms, at a fifth of the speed
    missing = KvPayload(chunks=2, size=10, sha256="0" * 64)
    with pytest.raises(ValueError, match="0 of 2"):
        await receiver.receive(completed(payload=missing), 0, 10)
