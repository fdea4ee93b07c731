"""Counters of what the cache did. One object per cache; the engine thread updates it."""

from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hicache.core.request import Match


LATENCY_BUCKETS = (
    50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 20e-3, 50e-3, 0.1, 0.2, 0.5, 1.0, 2.0,
    5.0,
)  # fmt: skip
"""Upper bounds (seconds) of the latency histograms."""


class Histogram:
    """Counts of observations per fixed bucket, and their sum. One thread updates it."""

    __slots__ = ("counts", "help", "sum")

    def __init__(self, help_: str) -> None:
        self.help = help_
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.sum += seconds

    def snapshot(self) -> dict[str, Any]:
        """Cumulative (upper bound, count) pairs ending at +inf, the sum and the help line."""
        total, buckets = 0, []
        for bound, count in zip((*LATENCY_BUCKETS, float("inf")), self.counts):
            total += count
            buckets.append((bound, total))
        return {"buckets": buckets, "sum": self.sum, "help": self.help}


def _histograms() -> dict[str, Histogram]:
    return {
        "hicache_match_seconds": Histogram("Engine-thread time of match, hashing included."),
        "hicache_load_copy_seconds": Histogram(
            "Time of one load's page copy host -> GPU (device time on CUDA)."
        ),
        "hicache_store_copy_seconds": Histogram(
            "Time of one store's page copy GPU -> host (device time on CUDA)."
        ),
    }


def _tier_histograms() -> dict[str, Histogram]:
    return {
        "hicache_tier_exists_seconds": Histogram("Time of one batched exists (worker thread)."),
        "hicache_tier_get_seconds": Histogram("Time of one batched get (worker thread)."),
        "hicache_tier_put_seconds": Histogram("Time of one batched put (worker thread)."),
        "hicache_tier_fetch_seconds": Histogram(
            "From the match that started a fetch from the tier until its pages were in the host "
            "tier."
        ),
    }


@dataclass
class TierStats:
    """Monotonic counters of one store tier below the host; `stats()` names each
    ``<counter>_<tier name>`` (``hit_tokens_disk``, ``fetches_mooncake``)."""

    hit_tokens: int = 0
    """Tokens loaded that came from this tier, promoted through the host tier (counted at load)."""
    fetches: int = 0
    """Fetches started (a batched exists, or a get straight into the fetch reserve)."""
    pages_fetched: int = 0
    get_bytes: int = 0
    get_failed: int = 0
    """Page groups whose get failed (missing since the probe, transfer error): never a hit."""
    corrupt: int = 0
    """Objects read whose bytes did not verify (checksum, header or length: changed at rest,
    written by an older version, of another layout): misses, never hits."""
    key_misses: int = 0
    """Objects read that did not open under their tenant's key (another key, a tag that does
    not verify, stored plain for a tenant with a key, or encrypted where no key is here):
    misses, never hits."""
    objects_put: int = 0
    put_bytes: int = 0
    put_failed: int = 0
    """Objects the tier refused (too large, no space) or lost to an error."""
    puts_dropped: int = 0
    """Objects not queued because the write queue was full, or because the host tier no
    longer held a page of theirs (dropped at `store` with every slot pinned, most often by puts
    still out: counted in `pages_dropped` too; or evicted before the put)."""
    puts_skipped: int = 0
    """Page groups not offered because the tier was unavailable (not connected yet, or its
    breaker open)."""
    call_errors: int = 0
    """Calls that failed as a whole (unreachable, breaker open): the request went on without."""
    skipped_down: int = 0
    """Fetches not started because the tier was unavailable: the walk went on below it."""
    skipped_busy: int = 0
    """Fetches not started because `fetch_queue_depth` fetch calls were queued or running
    already (a tier that has stopped answering holds them)."""
    skipped_slow: int = 0
    """Fetches not started because recomputing is cheaper than reading from this tier (one in
    `EXPLORE_EVERY` is started anyway, to measure the tier again)."""
    skipped_unheld: int = 0
    """Fetches not asked of a private tier (neither shared nor persistent) because it was
    never given the first group: its books are the chain's own."""
    timeouts: int = 0
    """Fetches that outlived policy.fetch_max_wait_ms: the request went on with its host hit."""
    no_space: int = 0
    """Fetches dropped because every host slot was pinned."""
    evict_lost: int = 0
    """write: on_evict: page groups the host evicted before they could be written here."""
    latency: dict[str, Histogram] = field(default_factory=_tier_histograms, repr=False)

    def as_dict(self, name: str) -> dict[str, int]:
        return {f"{k}_{name}": v for k, v in asdict(self).items() if k != "latency"}


@dataclass
class Stats:
    """Monotonic counters; `as_dict` adds the gauges the cache passes in. The cache adds to a
    counter of one event where it happens; `matched` and `loaded` count an answer's several."""

    lookups: int = 0
    """Answers of match that were not pending."""
    pending_answers: int = 0
    """Answers of match that said pending (a fetch from the tiers below the host was running)."""
    prompt_tokens: int = 0
    """Prompt tokens of the lookups."""
    hit_tokens_host: int = 0
    """Tokens loaded from the host tier that were there at match (counted at load)."""
    limited_tokens: int = 0
    """Tokens found but not usable: the cap left min_recompute_tokens, or no state to snap to."""
    pages_loaded: int = 0
    pages_stored: int = 0
    pages_dropped: int = 0
    """Pages store could not place because every host slot was pinned."""
    states_stored: int = 0
    hook_errors: int = 0
    prefill_tokens_per_s: int = 0
    """The engine's prefill speed the cost model uses now (reported, or the config's)."""
    latency: dict[str, Histogram] = field(default_factory=_histograms, repr=False)
    """Latency histograms by Prometheus family name (not part of `as_dict`)."""
    tiers: dict[str, TierStats] = field(default_factory=dict, repr=False)
    """The counters of each store tier, by name (flattened into `as_dict`)."""

    def matched(self, m: Match, prompt_tokens: int) -> None:
        if m.pending:
            self.pending_answers += 1
            return
        self.lookups += 1
        self.prompt_tokens += prompt_tokens
        self.limited_tokens += m.limited_tokens

    def loaded(self, m: Match) -> None:
        self.pages_loaded += m.load_pages
        fetched = 0
        for name, tokens in m.tier_tokens:
            self.tiers[name].hit_tokens += tokens
            fetched += tokens
        self.hit_tokens_host += m.cached_tokens - fetched

    def as_dict(self, **gauges: int) -> dict[str, int]:
        counters = {k: v for k, v in asdict(self).items() if k not in ("latency", "tiers")}
        for name, tier in self.tiers.items():
            counters.update(tier.as_dict(name))
        return {**counters, **gauges}

    def histograms(self) -> dict[str, dict[str, Any]]:
        """Snapshots by key: the family name, or ``<family>:<tier>`` for a tier's own (its
        snapshot names its ``family`` and ``labels``)."""
        out = {name: h.snapshot() for name, h in self.latency.items()}
        for tier, counters in self.tiers.items():
            for name, h in counters.latency.items():
                out[f"{name}:{tier}"] = {**h.snapshot(), "family": name, "labels": {"tier": tier}}
        return out
