"""Which LoRA adapters a worker will hold when a request routed there now runs, as the planner
predicts it: live from the worker's last report and the adapters routed there since, offline
from the simulated engine and its queue, by this one rule.

A worker holds ``max_loras`` adapters and drops the least recently used for one it loads
(vLLM's LRU, the sim's): the adapters of the requests ahead of this one are used, and loaded
where not held, in their order, before it runs. Each load stalls the worker's step that makes
it (``KvSettings.lora_load_ms``), so the loads ahead delay this request as a queue does.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def adapters_ahead(
    held: Sequence[str], coming: Iterable[str], max_loras: int
) -> tuple[frozenset[str], int]:
    """``held``: resident now, least recently used first; ``coming``: the adapters of the
    requests ahead, in order. The adapters resident once those ran, and the loads they make."""
    order = list(held)
    loads = 0
    for lora in coming:
        if lora in order:
            order.remove(lora)
        else:
            loads += 1
        order.append(lora)
        if len(order) > max_loras:
            del order[0]
    return frozenset(order), loads
