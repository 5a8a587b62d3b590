"""The kv-indexer's Prometheus metrics, in a registry of its own. The index's sizes are read
when scraped, so folding an event costs one counter increment."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from observability.drops import count_drops_in
from services.common.kv_index.index import PrefixIndex

_QUERY_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.01)


class _IndexSize(Collector):
    def __init__(self, index: Callable[[], PrefixIndex]) -> None:
        self._index = index

    def collect(self) -> Iterator[GaugeMetricFamily]:
        index = self._index()
        yield GaugeMetricFamily(
            "laneway_kv_indexer_blocks", "KV blocks indexed, over all workers.", value=index.size
        )
        yield GaugeMetricFamily(
            "laneway_kv_indexer_workers",
            "Workers with blocks in the index.",
            value=len(index.workers()),
        )
        yield GaugeMetricFamily(
            "laneway_kv_indexer_stream_position",
            "The last KV stream position folded into the index.",
            value=index.position,
        )


class IndexerMetrics:
    def __init__(self, index: Callable[[], PrefixIndex]) -> None:
        self.registry = CollectorRegistry()
        count_drops_in(self.registry)
        self.events = Counter(
            "laneway_kv_indexer_events",
            "KV events folded into the index (replayed ones included).",
            registry=self.registry,
        )
        self.query_seconds = Histogram(
            "laneway_kv_indexer_query_seconds",
            "Overlap queries, received to answered.",
            buckets=_QUERY_BUCKETS,
            registry=self.registry,
        )
        self.lag = Gauge(
            "laneway_kv_indexer_lag_events",
            "KV events in the stream not folded yet (checked every second).",
            registry=self.registry,
        )
        self.registry.register(_IndexSize(index))
