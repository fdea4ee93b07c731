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
    """Calls of match."""
    prompt_tokens: int = 0
    """Prompt tokens seen by match (each call counts: a re-asked pending match counts twice)."""
    hit_tokens_host: int = 0
    """Tokens hits took from the host tier."""
    hit_tokens_l3: int = 0
    """Tokens hits took from L3 (after promotion to the host tier)."""
    limited_tokens: int = 0
    """Tokens found but not usable: the cap left min_recompute_tokens, or no state to snap to."""
    pages_loaded: int = 0
    pages_stored: int = 0
    pages_dropped: int = 0
    """Pages store could not place because every host slot was pinned."""
    pages_evicted: int = 0
    states_stored: int = 0
    hook_errors: int = 0

    def matched(self, m: Match, prompt_tokens: int) -> None:
        self.lookups += 1
        self.prompt_tokens += prompt_tokens
        self.hit_tokens_host += m.cached_tokens
        self.limited_tokens += m.limited_tokens

    def loaded(self, pages: int) -> None:
        self.pages_loaded += pages

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
