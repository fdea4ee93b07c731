"""Counters of what the cache did. One object per cache; the engine thread updates it."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hicache.request import Match


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
    pages_evicted: int = 0
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
    l3_errors: int = 0
    """Store calls that failed as a whole (unreachable, breaker open): the request fell back."""
    l3_skipped: int = 0
    """Fetches not started because the breaker was open."""
    l3_skipped_slow: int = 0
    """L3 hits not taken because recomputing is cheaper than fetching."""
    l3_timeouts: int = 0
    """Fetches that outlived policy.l3_max_wait_ms: the request went on with its host hit."""
    l3_no_space: int = 0
    """Fetches dropped because every host slot was pinned."""

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

    def evicted(self, keys: list[bytes]) -> None:
        self.pages_evicted += len(keys)

    def stored_states(self, count: int) -> None:
        self.states_stored += count

    def hook_failed(self) -> None:
        self.hook_errors += 1

    def as_dict(self, **gauges: int) -> dict[str, int]:
        return {**asdict(self), **gauges}
