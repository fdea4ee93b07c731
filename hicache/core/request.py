"""The `Match` that `HiCache.match` answers with (what hicache remembers of a request between
its calls is `hicache.match.Request`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Match:
    """The answer of `HiCache.match`: how much of the prompt the engine may skip.

    `hit_tokens` is the number of leading prompt tokens the engine need not compute: what it
    said it had (`computed_tokens`) plus what hicache will load. `load_pages` pages, starting at
    page `first_page`, come from hicache's tiers; with a state layout, the state at `hit_tokens`
    comes too. While `pending` is true, a fetch from the store tiers is still running: ask again
    later (the hit may grow), or take this answer.
    """

    request_id: str
    hit_tokens: int
    computed_tokens: int
    first_page: int
    load_pages: int
    tier_tokens: tuple[tuple[str, int], ...] = ()
    """Of the cached tokens, those whose pages came from the store tiers (promoted to the host
    tier), as (tier name, tokens) in walk order; the rest were in the host tier."""
    needs_state: bool = False
    pending: bool = False
    limited_tokens: int = 0
    """Tokens found in the tiers that the cap (min_recompute_tokens) or the snap to a stored state
    kept the hit from using."""
    head_tokens: int = 0
    """A partial fetch (``match(..., partial=True)``): the engine computes [computed_tokens,
    head_tokens) itself while the store tiers send the pages from head_tokens on, then loads
    them with ``load(..., from_token=head_tokens)``; hit_tokens >= head_tokens. 0: no plan."""

    @property
    def fetched_tokens(self) -> int:
        """Of the cached tokens, those that came from the store tiers below the host."""
        return sum(tokens for _, tokens in self.tier_tokens)

    @property
    def cached_tokens(self) -> int:
        """Tokens hicache supplies (hit_tokens less what the engine had)."""
        return self.hit_tokens - self.computed_tokens if self.load_pages else 0
