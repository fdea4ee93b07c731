"""Reference caches for the replay: an exact LRU at page granularity and an infinite cache.

Both see the prompts as lists of page ids (`workload.page_ids`), never hicache's keys, and take
hits the way hicache does: the longest run of leading pages held, capped so that at least
`min_recompute_tokens` of the prompt are computed. They share nothing with hicache's code, so
agreeing with them is evidence, not tautology.

`LruSim` follows the rules of hicache's host slots (`hicache.slots.SlotPool` driven by
`HiCache.store`), stated here independently:

- a prompt's pages that are held are pinned while its new pages are placed: they are never
  evicted to make room for the same prompt;
- new pages take free slots first, then evict the least recently used pages; when even that is
  not enough (the prompt is longer than the capacity), the leading new pages are kept and the
  rest dropped;
- afterwards the prompt's pages become the most recent: first its new pages, from last to
  first, then its held pages, from last to first. So a prompt's first page is the most recent of
  all and its tail goes before its head.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class SimResult:
    """What a reference cache served over a trace."""

    prompt_tokens: int = 0
    hit_tokens: int = 0
    limited_tokens: int = 0
    """Tokens held but not usable because of the min_recompute_tokens cap."""
    evicted_pages: int = 0
    dropped_pages: int = 0

    @property
    def share(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def capped_pages(found: int, prompt_tokens: int, page_tokens: int, min_recompute: int) -> int:
    """Pages of a hit of `found` leading pages once `min_recompute` tokens must stay to compute."""
    return min(found, max(0, prompt_tokens - min_recompute) // page_tokens)


class LruSim:
    """An LRU cache of `capacity` pages with hicache's placement rules (see the module doc)."""

    def __init__(self, capacity: int, page_tokens: int, min_recompute_tokens: int = 1) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0 pages, got {capacity}")
        if page_tokens <= 0 or min_recompute_tokens <= 0:
            raise ValueError("page_tokens and min_recompute_tokens must be positive")
        self.capacity = capacity
        self.page_tokens = page_tokens
        self.min_recompute = min_recompute_tokens
        self.held: OrderedDict[int, None] = OrderedDict()  # least recent first
        self.result = SimResult()

    def request(self, pages: Sequence[int], prompt_tokens: int) -> int:
        """Serve one prompt (its full pages' ids and its length); returns the hit in tokens."""
        held = self.held
        found = 0
        for p in pages:
            if p not in held:
                break
            found += 1
        hit = capped_pages(found, prompt_tokens, self.page_tokens, self.min_recompute)
        res = self.result
        res.prompt_tokens += prompt_tokens
        res.hit_tokens += hit * self.page_tokens
        res.limited_tokens += (found - hit) * self.page_tokens
        present = [p for p in pages if p in held]
        missing = [p for p in pages if p not in held]
        for p in present:  # pinned for the store: out of the eviction order
            del held[p]
        room = self.capacity - len(held) - len(present)
        evict = min(max(0, len(missing) - room), len(held))
        for _ in range(evict):
            held.popitem(last=False)
        res.evicted_pages += evict
        placed = min(len(missing), room + evict)
        res.dropped_pages += len(missing) - placed
        for p in reversed(missing[:placed]):
            held[p] = None
        for p in reversed(present):
            held[p] = None
        return hit * self.page_tokens


class OracleSim:
    """An infinite cache: every page ever seen is held. The ceiling of any cache."""

    def __init__(self, page_tokens: int, min_recompute_tokens: int = 1) -> None:
        self.page_tokens = page_tokens
        self.min_recompute = min_recompute_tokens
        self.held: set[int] = set()
        self.result = SimResult()

    def request(self, pages: Sequence[int], prompt_tokens: int) -> int:
        found = 0
        for p in pages:
            if p not in self.held:
                break
            found += 1
        hit = capped_pages(found, prompt_tokens, self.page_tokens, self.min_recompute)
        self.result.prompt_tokens += prompt_tokens
        self.result.hit_tokens += hit * self.page_tokens
        self.result.limited_tokens += (found - hit) * self.page_tokens
        self.held.update(pages)
        return hit * self.page_tokens


def block_ceiling(requests: Sequence, block_tokens: int = 512) -> float:
    """The trace's own ceiling: share of prompt tokens in leading blocks seen before.

    Counted per hash id (block), a partial last block with its actual length, no cap: the
    figure the Mooncake trace release quotes (65.1 % for the synthetic trace).
    """
    seen: set[int] = set()
    total = hit = 0
    for req in requests:
        n = req.input_length
        total += n
        for i, h in enumerate(req.hash_ids):
            if h not in seen:
                break
            hit += min(block_tokens, n - i * block_tokens)
        seen.update(req.hash_ids)
    return hit / total if total else 0.0
