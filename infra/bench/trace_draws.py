"""Who asks for a trace's requests, drawn for a replay (`laneway bench --tenants`, `--loras`,
`--pool`): tenants whose keys salt their cache, the LoRA adapters and the models conversations
ask for. Each is drawn per conversation (:func:`infra.bench.traces.conversation`) and the same
every run."""

from __future__ import annotations

import bisect
import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import replace

from infra.bench.traces import TraceRequest, conversation
from schemas.cache_salt import adapter_salt, group_salt, request_salt


def with_tenants(trace: Sequence[TraceRequest], tenants: int) -> list[TraceRequest]:
    """``trace`` served to ``tenants`` tenants, each with a key of its own: its conversations
    dealt out in turn as they first arrive, each request salted as the ingress salts a tenant's
    (``ApiKeyRecord.cache_salt``'s functions: ``schemas.cache_salt``); conversations as
    ``conversation`` names them."""
    if tenants < 1:
        raise ValueError("tenants must be at least 1")
    groups = [group_salt(tenant_secret(t), f"tenant-{t}") for t in range(tenants)]
    salts = [request_salt(group, None) for group in groups]
    conversations: dict[tuple[int, ...], int] = {}
    salted = []
    for r in trace:
        tenant = conversations.setdefault(conversation(r), len(conversations)) % tenants
        salted.append(replace(r, cache_salt=adapter_salt(salts[tenant], r.lora)))
    return salted


def with_loras(trace: Sequence[TraceRequest], loras: int, zipf_s: float) -> list[TraceRequest]:
    """``trace`` asking for ``loras`` LoRA adapters (``lora-0`` the most asked for): each
    conversation (``conversation``) draws one, the k-th with weight 1/k**``zipf_s``, from a
    seed of its own, so a conversation keeps its adapter and every run draws the same. Each is
    salted with its adapter as the ingress salts it (``schemas.cache_salt.adapter_salt``)."""
    if loras < 1 or zipf_s < 0:
        raise ValueError("loras must be at least 1 and the Zipf exponent at least 0")
    weights = [1 / k**zipf_s for k in range(1, loras + 1)]
    total = sum(weights)
    bounds = list(itertools.accumulate(w / total for w in weights))
    drawn = []
    for r in trace:
        rank = min(bisect.bisect_right(bounds, _uniform(b"", conversation(r))), loras - 1)
        lora = f"lora-{rank}"
        drawn.append(replace(r, lora=lora, cache_salt=adapter_salt(r.cache_salt, lora)))
    return drawn


def with_models(trace: Sequence[TraceRequest], pools: dict[str, int]) -> list[TraceRequest]:
    """``trace`` served by model pools (name: workers): a request naming a model keeps it (one
    no pool serves is refused, ValueError), the others' conversations each draw one, a pool with
    more workers as much more often."""
    names = list(pools)
    bounds = list(itertools.accumulate(pools[n] / sum(pools.values()) for n in names))
    drawn = []
    for r in trace:
        if r.model is None:
            u = _uniform(b"model", conversation(r))
            r = replace(r, model=names[min(bisect.bisect_right(bounds, u), len(names) - 1)])
        elif r.model not in pools:
            raise ValueError(f"the trace asks for model {r.model!r}, which no --pool serves")
        drawn.append(r)
    return drawn


def _uniform(what: bytes, key: tuple[int, ...]) -> float:
    """A number in [0, 1) fixed by ``what`` and a conversation."""
    digest = hashlib.sha256(what + repr(key).encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64


def tenant_secret(tenant: int) -> bytes:
    """The cache group secret of the bench's tenant ``tenant`` (``tenant-<n>``): made up, the
    same every run (a live key's is random)."""
    return hashlib.sha256(b"laneway bench tenant %d" % tenant).digest()[:16]
