"""Counters of what the cache did. One object per cache; the engine thread updates it."""

from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hicache.request import Match


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
        "hicache_l3_exists_seconds": Histogram("Time of one batched L3 exists (worker thread)."),
        "hicache_l3_get_seconds": Histogram("Time of one batched L3 get (worker thread)."),
        "hicache_l3_put_seconds": Histogram("Time of one batched L3 put (worker thread)."),
        "hicache_l3_fetch_seconds": Histogram(
            "From the match that started an L3 fetch until its pages were in the host tier."
        ),
    }


@dataclass
class Stats:
    """Monotonic counters; `as_dict` adds the gauges the cache passes in."""

    lookups: int = 0
    """Answers of match that were not pending."""
    pending_answers: int = 0
    """Answers of match that said pending (an L3 lookup was running)."""
    prompt_tokens: int = 0
    """Prompt tokens of the lookups."""
    hit_tokens_host: int = 0
    """Tokens loaded from the host tier (counted at load)."""
    hit_tokens_l3: int = 0
    """Tokens loaded that came from L3, promoted through the host tier (counted at load)."""
    limited_tokens: int = 0
    """Tokens found but not usable: the cap left min_recompute_tokens, or no state to snap to."""
    pages_loaded: int = 0
    pages_stored: int = 0
    pages_dropped: int = 0
    """Pages store could not place because every host slot was pinned."""
    states_stored: int = 0
    hook_errors: int = 0
    l3_probes: int = 0
    """Fetches started: one batched exists each."""
    l3_pages_fetched: int = 0
    l3_get_bytes: int = 0
    l3_get_failed: int = 0
    """Page groups whose get failed (missing since the probe, transfer error): never a hit."""
    l3_objects_put: int = 0
    l3_put_bytes: int = 0
    l3_put_failed: int = 0
    """Objects the store refused (too large, no space) or lost to an error."""
    l3_puts_dropped: int = 0
    """Objects not queued because the write-behind queue was full."""
    l3_puts_skipped: int = 0
    """Page groups not offered to write-behind because the store was unavailable (not
    connected yet, or its breaker open)."""
    l3_errors: int = 0
    """Store calls that failed as a whole (unreachable, breaker open): the request fell back."""
    l3_skipped: int = 0
    """Fetches not started because the breaker was open."""
    l3_skipped_busy: int = 0
    """Fetches not started because `fetch_queue_depth` fetch calls were queued or running
    already (a store that has stopped answering holds them)."""
    l3_skipped_slow: int = 0
    """L3 hits not taken because recomputing is cheaper than fetching."""
    l3_timeouts: int = 0
    """Fetches that outlived policy.l3_max_wait_ms: the request went on with its host hit."""
    l3_no_space: int = 0
    """Fetches dropped because every host slot was pinned."""
    latency: dict[str, Histogram] = field(default_factory=_histograms, repr=False)
    """Latency histograms by Prometheus family name (not part of `as_dict`)."""

    def matched(self, m: Match, prompt_tokens: int) -> None:
        if m.pending:
            self.pending_answers += 1
            return
        self.lookups += 1
        self.prompt_tokens += prompt_tokens
        self.limited_tokens += m.limited_tokens

    def loaded(self, m: Match) -> None:
        self.pages_loaded += m.load_pages
        self.hit_tokens_l3 += m.l3_tokens
        self.hit_tokens_host += m.cached_tokens - m.l3_tokens

    def stored(self, pages: int) -> None:
        self.pages_stored += pages

    def dropped(self, pages: int) -> None:
        self.pages_dropped += pages

    def stored_states(self, count: int) -> None:
        self.states_stored += count

    def hook_failed(self) -> None:
        self.hook_errors += 1

    def as_dict(self, **gauges: int) -> dict[str, int]:
        counters = {k: v for k, v in asdict(self).items() if k != "latency"}
        return {**counters, **gauges}

    def histograms(self) -> dict[str, dict[str, Any]]:
        return {name: h.snapshot() for name, h in self.latency.items()}
