"""What hicache remembers about one request, and the `Match` it answers with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hicache.core.keys import KeyChain
from hicache.core.slots import Lease

if TYPE_CHECKING:
    from hicache.tiers.link import Fetch


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


@dataclass
class Request:
    """hicache's state of one request between `match` and `release`."""

    chain: KeyChain
    match: Match | None = None
    asked: int = 0
    """The prompt length of the last `match`."""
    pages: Lease | None = None
    """Host page slots pinned by `match` for `load`."""
    state: Lease | None = None
    """The host state slot pinned by `match` for `load`."""
    fetch: Fetch | None = None
    """The first part of the request's walk down the store tiers, if one was started."""
    head_pages: int = 0
    """The walk is a partial fetch from this page on (`Match.head_tokens`); 0: none."""

    def drop_pins(self) -> None:
        """Release what `match` pinned and forget the match (it can no longer be loaded)."""
        for lease in (self.pages, self.state):
            if lease is not None:
                lease.release()
        self.pages = self.state = None
        self.match = None
