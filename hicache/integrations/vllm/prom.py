"""hicache's counters on vLLM's own ``/metrics`` endpoint (`HiCacheConnector.build_prom_metrics`).

The workers report what hicache's counters gained with vLLM's connector stats (`HiCacheStats`:
hit tokens by tier, pages loaded, stored, dropped and evicted); vLLM's front end hands them to
`HiCacheProm.observe`, which adds them to counters of the families hicache's own endpoint has,
named ``vllm:`` + the family (``vllm:hicache_hit_tokens_total{tier="disk"}``) with vLLM's
``engine`` and ``model_name`` labels, summed over the TP ranks. So each vLLM instance serves its
hicache figures where its own are, on its own port: two instances on one machine need no
metrics port each.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    PromMetric,
)

from hicache.integrations.vllm.meta import REPORTED
from hicache.observability.metrics import FAMILIES, metric_of

PREFIX = "vllm:"
"""vLLM's prefix: vLLM drops these collectors with its own when it sets its metrics up again."""


class HiCacheProm(KVConnectorPromMetrics):
    """Counters for the reported stats keys. Each engine's counters of the keys named at start
    (the host tier's and every store tier's hit tokens) exist from the start, at 0; a key
    without a family (`hicache.observability.metrics.metric_of`) is not exported."""

    def __init__(self, *args: Any, store_tiers: Iterable[str] = ()) -> None:
        super().__init__(*args)
        self._families: dict[str, PromMetric] = {}
        self._children: dict[tuple[int, str], Any] = {}
        keys = [*REPORTED, *(f"hit_tokens_{tier}" for tier in store_tiers)]
        for engine in self.per_engine_labelvalues:
            for key in keys:
                self._child(engine, key)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, gained in transfer_stats_data.items():
            child = self._child(engine_idx, key)
            if child is not None and gained > 0:
                child.inc(gained)

    def _child(self, engine: int, key: str) -> Any:
        """The counter of one engine and stats key (made at its first use), or None."""
        if (engine, key) in self._children:
            return self._children[engine, key]
        entry = metric_of(key)
        child = None
        if entry is not None and FAMILIES[entry[0]].kind == "counter":
            name, labels, _ = entry
            family = FAMILIES[name]
            counter = self._families.get(name)
            if counter is None:
                counter = self._families[name] = self._counter_cls(
                    name=PREFIX + name, documentation=family.help,
                    labelnames=[*self._labelnames, *family.labels],
                )  # fmt: skip
            values = [*self.per_engine_labelvalues[engine], *(labels[x] for x in family.labels)]
            child = counter.labels(*values)
        self._children[engine, key] = child
        return child
