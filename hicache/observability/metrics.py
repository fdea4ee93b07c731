"""Prometheus metrics of a `HiCache`, read from `cache.stats()` at scrape time.

There is one set of books: the cache's own counters. `HiCacheCollector` turns a stats dict into
``hicache_*`` metric families whenever the registry is collected, so a scrape costs one
`stats()` call and nothing is counted twice. The mapping is the table `METRICS`: one line per
stats key, naming the family and its labels, and `TIER_METRICS` for the keys of each store
tier, ``<counter>_<tier name>``, exported with the label ``tier=<tier name>``; `FAMILIES` gives
each family's type and help. A new stats key is one new line (`unmapped` lists keys without
one; they are not exported).

Latency histograms come from `cache.histograms()` when the cache provides it: a dict whose
values are `HistogramSnapshot`-like mappings (see `HistogramSnapshot`), keyed by family name
(``hicache_match_seconds``) or naming their ``family`` and ``labels`` themselves (a tier's
``hicache_tier_get_seconds{tier="disk"}``). Without it no histogram is exported.

Usage::

    registry = CollectorRegistry()
    register(cache, registry)                      # never the global registry unless asked
    server = serve(registry, port=9400)            # optional; off unless called
    ...
    server.close()
"""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, NotRequired, Protocol, TypedDict

from prometheus_client import REGISTRY, CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

Kind = Literal["counter", "gauge"]


@dataclass(frozen=True)
class Family:
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()


FAMILIES: dict[str, Family] = {
    # counters (exported with the _total suffix)
    "hicache_lookups": Family("counter", "Answers of match that were not pending."),
    "hicache_pending_answers": Family(
        "counter", "Answers of match that said pending (a fetch from the store tiers ran)."
    ),
    "hicache_prompt_tokens": Family("counter", "Prompt tokens of the lookups."),
    "hicache_hit_tokens": Family("counter", "Prompt tokens served from cache.", ("tier",)),
    "hicache_limited_tokens": Family(
        "counter", "Tokens held but not usable (min_recompute_tokens cap, no state to snap to)."
    ),
    "hicache_pages_loaded": Family("counter", "Pages loaded from a tier.", ("tier",)),
    "hicache_pages_stored": Family("counter", "Pages written to a tier.", ("tier",)),
    "hicache_pages_evicted": Family("counter", "Pages evicted from a tier.", ("tier",)),
    "hicache_pages_dropped": Family(
        "counter", "Pages not stored because every slot was pinned.", ("tier",)
    ),
    "hicache_states_stored": Family("counter", "States written to the host tier."),
    "hicache_tier_fetches": Family("counter", "Fetches started from a store tier.", ("tier",)),
    "hicache_tier_objects_put": Family(
        "counter", "Objects (page groups, states) put to a store tier.", ("tier",)
    ),
    "hicache_tier_bytes": Family("counter", "Bytes moved to or from a store tier.", ("tier", "op")),
    "hicache_errors": Family(
        "counter", "Failures; none of them ever counts as a hit.", ("tier", "kind")
    ),
    "hicache_fallbacks": Family(
        "counter",
        "Times a store tier was passed over and the walk went on without it.",
        ("tier", "reason"),
    ),
    # gauges
    "hicache_pool_slots": Family("gauge", "Slots of a pool.", ("tier", "pool")),
    "hicache_tenant_pages": Family(
        "gauge",
        "Pages a tenant holds in a tier (tenants with shares or quotas).",
        ("tier", "tenant"),
    ),
    "hicache_tenant_pages_evicted": Family(
        "counter",
        "A tenant's pages evicted from a tier (for others' space or its quota).",
        ("tier", "tenant"),
    ),
    "hicache_tenant_bytes": Family(
        "gauge",
        "Bytes a tenant holds in a store tier (tiers that keep tenants' shares and quotas).",
        ("tier", "tenant"),
    ),
    "hicache_tenant_bytes_evicted": Family(
        "counter",
        "Bytes of a tenant's objects evicted from a store tier (for others' room or its quota).",
        ("tier", "tenant"),
    ),
    "hicache_pool_used_slots": Family("gauge", "Slots that hold a key.", ("tier", "pool")),
    "hicache_pool_pinned_slots": Family("gauge", "Slots somebody pins.", ("tier", "pool")),
    "hicache_requests": Family("gauge", "Requests hicache holds state for."),
    "hicache_copies_in_flight": Family("gauge", "Copies enqueued and not yet retired."),
    "hicache_prefill_tokens_per_second": Family(
        "gauge", "The engine's prefill speed the cost model uses (reported, or configured)."
    ),
    "hicache_tier_available": Family(
        "gauge",
        "1 while a store tier answers (connected, breaker closed), 0 while skipped.",
        ("tier",),
    ),
    "hicache_tier_queue_depth": Family("gauge", "Puts queued or running.", ("tier",)),
    "hicache_tier_jobs_in_flight": Family(
        "gauge", "Jobs whose results are not applied yet.", ("tier",)
    ),
    "hicache_tier_fetch_reserve_slots": Family(
        "gauge",
        "Free host page slots held for fetches (pinned, so in pinned slots too).",
        ("tier",),
    ),
    "hicache_tier_write_back_pending": Family(
        "gauge", "write: on_evict: page groups waiting for their write-back.", ("tier",)
    ),
    "hicache_tier_read_bytes_per_second": Family(
        "gauge", "A store tier's read throughput the cost model uses (learned).", ("tier",)
    ),
}

METRICS: dict[str, tuple[str, dict[str, str]]] = {
    # stats key               family                        labels
    "lookups": ("hicache_lookups", {}),
    "pending_answers": ("hicache_pending_answers", {}),
    "prompt_tokens": ("hicache_prompt_tokens", {}),
    "hit_tokens_host": ("hicache_hit_tokens", {"tier": "host"}),
    "limited_tokens": ("hicache_limited_tokens", {}),
    "pages_loaded": ("hicache_pages_loaded", {"tier": "host"}),
    "pages_stored": ("hicache_pages_stored", {"tier": "host"}),
    "pages_evicted": ("hicache_pages_evicted", {"tier": "host"}),
    "pages_dropped": ("hicache_pages_dropped", {"tier": "host"}),
    "states_stored": ("hicache_states_stored", {}),
    "hook_errors": ("hicache_errors", {"tier": "host", "kind": "state_hook"}),
    "host_slots": ("hicache_pool_slots", {"tier": "host", "pool": "page"}),
    "host_used": ("hicache_pool_used_slots", {"tier": "host", "pool": "page"}),
    "host_pinned": ("hicache_pool_pinned_slots", {"tier": "host", "pool": "page"}),
    "state_slots": ("hicache_pool_slots", {"tier": "host", "pool": "state"}),
    "state_used": ("hicache_pool_used_slots", {"tier": "host", "pool": "state"}),
    "requests": ("hicache_requests", {}),
    "copies_in_flight": ("hicache_copies_in_flight", {}),
    "prefill_tokens_per_s": ("hicache_prefill_tokens_per_second", {}),
}
"""Stats key -> (family, labels). Keys absent from a cache's stats are simply not exported."""

TIER_METRICS: dict[str, tuple[str, dict[str, str]]] = {
    # counter of a store tier   family                      labels besides tier=<name>
    "hit_tokens": ("hicache_hit_tokens", {}),
    "fetches": ("hicache_tier_fetches", {}),
    "pages_fetched": ("hicache_pages_loaded", {}),
    "get_bytes": ("hicache_tier_bytes", {"op": "get"}),
    "get_failed": ("hicache_errors", {"kind": "get"}),
    "corrupt": ("hicache_errors", {"kind": "corrupt"}),
    "key_misses": ("hicache_errors", {"kind": "key_miss"}),
    "objects_put": ("hicache_tier_objects_put", {}),
    "put_bytes": ("hicache_tier_bytes", {"op": "put"}),
    "put_failed": ("hicache_errors", {"kind": "put"}),
    "puts_dropped": ("hicache_fallbacks", {"reason": "put_queue_full"}),
    "puts_skipped": ("hicache_fallbacks", {"reason": "put_tier_unavailable"}),
    "call_errors": ("hicache_errors", {"kind": "call"}),
    "skipped_down": ("hicache_fallbacks", {"reason": "tier_unavailable"}),
    "skipped_busy": ("hicache_fallbacks", {"reason": "fetch_queue_full"}),
    "skipped_slow": ("hicache_fallbacks", {"reason": "slower_than_recompute"}),
    "skipped_unheld": ("hicache_fallbacks", {"reason": "not_held"}),
    "timeouts": ("hicache_fallbacks", {"reason": "timeout"}),
    "no_space": ("hicache_fallbacks", {"reason": "no_host_space"}),
    "evict_lost": ("hicache_errors", {"kind": "evicted_before_write_back"}),
    "available": ("hicache_tier_available", {}),
    "queue_depth": ("hicache_tier_queue_depth", {}),
    "jobs_in_flight": ("hicache_tier_jobs_in_flight", {}),
    "fetch_reserve": ("hicache_tier_fetch_reserve_slots", {}),
    "write_back_pending": ("hicache_tier_write_back_pending", {}),
    "read_mbps": ("hicache_tier_read_bytes_per_second", {}),
}
"""A store tier's stats key ``<counter>_<tier name>`` -> (family, labels): exported with
``tier=<tier name>`` added."""

TENANT_METRICS: dict[str, tuple[str, dict[str, str]]] = {
    # a tenant's stats key    family                        labels besides tenant=<name>
    "tenant_host_pages": ("hicache_tenant_pages", {"tier": "host"}),
    "tenant_host_evicted": ("hicache_tenant_pages_evicted", {"tier": "host"}),
}
"""A tenant's stats key ``<counter>_<tenant name>`` -> (family, labels): exported with
``tenant=<tenant name>`` added ("none": the requests of no tenant)."""

STORE_TENANT_METRICS: dict[str, str] = {
    "tenant_store_bytes": "hicache_tenant_bytes",
    "tenant_store_evicted": "hicache_tenant_bytes_evicted",
}
"""A store tier's tenant stats key ``<counter>_<tier name>.<tenant name>`` -> family:
exported with ``tier=`` and ``tenant=`` (tier names hold no dot)."""

_SCALE = {"read_mbps": 1e6}
"""Tier stats kept in other units than their family's."""

_BY_LENGTH = sorted(TIER_METRICS, key=len, reverse=True)


def metric_of(key: str) -> tuple[str, dict[str, str], float] | None:
    """The family, labels and scale of a stats key, or None if it has no metric."""
    entry = METRICS.get(key)
    if entry is not None:
        return entry[0], entry[1], 1.0
    for counter, family in STORE_TENANT_METRICS.items():
        tier, dot, tenant = key.removeprefix(counter + "_").partition(".")
        if key.startswith(counter + "_") and dot and tier and tenant:
            return family, {"tier": tier, "tenant": tenant}, 1.0
    for counter, (family, labels) in TENANT_METRICS.items():
        if key.startswith(counter + "_") and len(key) > len(counter) + 1:
            return family, {"tenant": key[len(counter) + 1 :], **labels}, 1.0
    for counter in _BY_LENGTH:  # the longest counter name that begins the key
        if key.startswith(counter + "_") and len(key) > len(counter) + 1:
            family, labels = TIER_METRICS[counter]
            tier = key[len(counter) + 1 :]
            return family, {"tier": tier, **labels}, _SCALE.get(counter, 1.0)
    return None


class HistogramSnapshot(TypedDict):
    """One latency histogram as the cache reports it.

    `buckets`: (upper bound in seconds, observations <= bound), cumulative, ascending, the last
    bound ``float("inf")``; `sum`: total seconds observed; `help`: one line for the scrape.
    """

    buckets: list[tuple[float, int]]
    sum: float
    help: str
    family: NotRequired[str]
    """The family, where the dict key is not it (one family per label set)."""
    labels: NotRequired[dict[str, str]]
    """The labels of this histogram in its family (every one of a family has the same keys)."""


class StatsSource(Protocol):
    def stats(self) -> Mapping[str, int]: ...


def unmapped(stats: Mapping[str, Any]) -> list[str]:
    """Stats keys that `METRICS` has no line for (they are not exported)."""
    return sorted(k for k in stats if metric_of(k) is None)


def families(
    stats: Mapping[str, int | float],
    histograms: Mapping[str, HistogramSnapshot] | None = None,
) -> list[Metric]:
    """The metric families for one stats dict (and optional histogram snapshots)."""
    built: dict[str, Metric] = {}
    for key, value in stats.items():
        entry = metric_of(key)
        if entry is None:
            continue
        name, labels, scale = entry
        fam = FAMILIES[name]
        metric = built.get(name)
        if metric is None:
            cls = CounterMetricFamily if fam.kind == "counter" else GaugeMetricFamily
            metric = built[name] = cls(name, fam.help, labels=list(fam.labels))
        metric.add_metric([labels.get(label, "") for label in fam.labels], float(value) * scale)
    out: list[Metric] = list(built.values())
    hists: dict[str, HistogramMetricFamily] = {}
    for key, snap in (histograms or {}).items():
        name = snap.get("family", key)
        labels = snap.get("labels", {})
        h = hists.get(name)
        if h is None:
            h = hists[name] = HistogramMetricFamily(
                name, snap.get("help", name), labels=list(labels)
            )
        buckets = [(_bound(b), float(c)) for b, c in snap["buckets"]]
        h.add_metric(list(labels.values()), buckets, float(snap["sum"]))
    return out + list(hists.values())


def _bound(b: float) -> str:
    return "+Inf" if b == float("inf") else repr(float(b))


class HiCacheCollector(Collector):
    """Collects `source.stats()` (and `source.histograms()` if it exists) at every scrape.

    `source` is a HiCache or anything with a `stats()` method; or give `stats` as a callable.
    """

    def __init__(
        self,
        source: StatsSource | None = None,
        *,
        stats: Callable[[], Mapping[str, int]] | None = None,
        histograms: Callable[[], Mapping[str, HistogramSnapshot]] | None = None,
    ) -> None:
        if (source is None) == (stats is None):
            raise TypeError("give either a source with stats() or stats=, not both or neither")
        self._stats = stats if stats is not None else source.stats  # type: ignore[union-attr]
        self._histograms = histograms or getattr(source, "histograms", None)
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def collect(self) -> Iterator[Metric]:
        with self._lock:  # one scrape at a time reads the cache
            stats = self._stats()
            hists = self._histograms() if self._histograms is not None else None
        missing = set(unmapped(stats)) - self._warned
        if missing:
            self._warned |= missing
            log.warning("hicache metrics: stats keys without a metric: %s", sorted(missing))
        yield from families(stats, hists)

    def describe(self) -> Iterator[Metric]:
        return iter(())  # families depend on the stats present; describe nothing up front


def register(
    source: StatsSource,
    registry: CollectorRegistry | None = None,
    *,
    use_global: bool = False,
) -> tuple[CollectorRegistry, HiCacheCollector]:
    """Register a collector for `source` on `registry` (default: a fresh one).

    The process-wide `prometheus_client.REGISTRY` is used only with ``use_global=True``.
    Returns the registry and the collector (unregister it with ``registry.unregister``).
    """
    if registry is not None and use_global:
        raise ValueError("give a registry or use_global=True, not both")
    reg = REGISTRY if use_global else (registry or CollectorRegistry(auto_describe=False))
    collector = HiCacheCollector(source)
    reg.register(collector)
    return reg, collector


class MetricsServer:
    """An HTTP endpoint serving one registry in the Prometheus text format."""

    def __init__(self, registry: CollectorRegistry, port: int, addr: str) -> None:
        try:
            self._server, self._thread = start_http_server(port, addr=addr, registry=registry)
        except OSError as err:
            if err.errno != errno.EADDRINUSE:
                raise
            raise OSError(
                f"metrics port {port} on {addr} is in use by another process: give "
                "metrics.port another port, or 0 for any free one"
            ) from None

    @property
    def port(self) -> int:
        return int(self._server.server_port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def serve(registry: CollectorRegistry, port: int, addr: str = "127.0.0.1") -> MetricsServer:
    """Serve `registry` at http://addr:port/metrics (port 0: any free port; see `.port`).

    Off unless called. Binds to loopback by default; pass ``addr="0.0.0.0"`` to expose it.
    """
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be in [0, 65535], got {port}")
    return MetricsServer(registry, port, addr)
