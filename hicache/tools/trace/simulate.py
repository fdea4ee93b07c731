"""Reference caches for the replay: one per eviction policy, the offline reference, and an
infinite cache.

They see the prompts as lists of page ids (`workload.page_ids`), never hicache's keys, and take
hits the way hicache does: the longest run of leading pages held, capped so that at least
`min_recompute_tokens` of the prompt are computed. The LRU here shares nothing with the host
tier's compiled books, so agreeing with them is evidence, not tautology.

`PolicySim` runs any policy of `hicache.core.eviction` (or `FarthestNextUse`, the offline reference)
under the placement rules of hicache's host slots (`hicache.core.slots.SlotPool` driven by
`HiCache.store`), stated here independently:

- a prompt's pages that are held are pinned while its new pages are placed: they are never
  evicted to make room for the same prompt;
- new pages take free slots first, then evict the policy's victims; when even that is not
  enough (the prompt is longer than the capacity), the leading new pages are kept and the rest
  dropped;
- the pages of the hit are loaded, and touched (from last to first) when the load finishes,
  before the store;
- afterwards the policy sees the prompt's new pages inserted, from last to first, then its held
  pages touched, from last to first. Under LRU a prompt's first page is then the most recent of
  all and its tail goes before its head.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from hicache.core.eviction import DEFAULT_POLICY, EvictionPolicy, make_policy


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


class PolicySim:
    """A cache of `capacity` pages that evicts by `policy` (a name of `hicache.core.eviction`, or a
    policy object), with hicache's placement rules (see the module doc)."""

    def __init__(
        self,
        capacity: int,
        page_tokens: int,
        min_recompute_tokens: int = 1,
        policy: str | EvictionPolicy = DEFAULT_POLICY,
    ) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0 pages, got {capacity}")
        if page_tokens <= 0 or min_recompute_tokens <= 0:
            raise ValueError("page_tokens and min_recompute_tokens must be positive")
        self.capacity = capacity
        self.page_tokens = page_tokens
        self.min_recompute = min_recompute_tokens
        self.policy = make_policy(policy, capacity) if isinstance(policy, str) else policy
        self.result = SimResult()
        self.evictions: list[int] = []
        """Every page evicted, in order (tests read it)."""

    def request(self, pages: Sequence[int], prompt_tokens: int) -> int:
        """Serve one prompt (its full pages' ids and its length); returns the hit in tokens."""
        held = self.policy
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
        for p in reversed(pages[:hit]):  # loaded: touched when the load's pins are released
            held.touch(p)
        present = [p for p in pages if p in held]
        missing = [p for p in pages if p not in held]
        pinned = set(present)  # pinned for the store: never evicted for the same prompt
        room = self.capacity - len(held)
        evicted = 0
        while evicted < len(missing) - room:
            victim = held.victim(pinned.__contains__)
            if victim is None:
                break
            held.remove(victim)
            self.evictions.append(victim)  # type: ignore[arg-type]
            evicted += 1
        res.evicted_pages += evicted
        placed = min(len(missing), room + evicted)
        res.dropped_pages += len(missing) - placed
        for p in reversed(missing[:placed]):
            held.insert(p)
        for p in reversed(present):
            held.touch(p)
        return hit * self.page_tokens


def LruSim(capacity: int, page_tokens: int, min_recompute_tokens: int = 1) -> PolicySim:
    """The exact LRU simulation that hicache's host tier must equal."""
    return PolicySim(capacity, page_tokens, min_recompute_tokens, "lru")


class FarthestNextUse(EvictionPolicy):
    """Offline reference (Belady): evicts the page whose next use is farthest away, deeper pages
    first among equals (a page is never used without its parent). Needs the future: the
    simulation tells it, before each request, when each of the request's pages is used next
    (`upcoming`). Not registered: no tier can run it."""

    NEVER = 1 << 62

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.upcoming: dict[int, tuple[int, int]] = {}
        """page -> (index of the next request that uses it, depth in this prompt)."""
        self._due: dict[int, tuple[int, int]] = {}
        self._heap: list[tuple[int, int, int]] = []  # (-next use, -depth, page)

    def _plan(self, key: int) -> None:
        due = self.upcoming[key]
        self._due[key] = due
        heapq.heappush(self._heap, (-due[0], -due[1], key))

    def insert(self, key: int, weight: float = 1.0) -> None:  # type: ignore[override]
        self._plan(key)

    def touch(self, key: int) -> None:  # type: ignore[override]
        self._plan(key)

    def remove(self, key: int) -> None:  # type: ignore[override]
        del self._due[key]

    def victim(self, busy=lambda _k: False):  # type: ignore[no-untyped-def]
        heap, skipped, found = self._heap, [], None
        while heap:
            neg_next, neg_depth, key = heap[0]
            if self._due.get(key) != (-neg_next, -neg_depth):
                heapq.heappop(heap)  # stale: removed, or planned again since
            elif busy(key):
                skipped.append(heapq.heappop(heap))
            else:
                found = key
                break
        for entry in skipped:
            heapq.heappush(heap, entry)
        return found

    def __contains__(self, key: object) -> bool:
        return key in self._due

    def __len__(self) -> int:
        return len(self._due)

    def order(self) -> list[int]:  # type: ignore[override]
        return sorted(self._due, key=lambda k: (-self._due[k][0], -self._due[k][1]))


def next_uses(prompts: Sequence[Sequence[int]]) -> list[dict[int, tuple[int, int]]]:
    """For each prompt, page -> (index of the next prompt holding that page, its depth here);
    FarthestNextUse.NEVER where no later prompt holds it."""
    out: list[dict[int, tuple[int, int]]] = [{}] * len(prompts)
    last: dict[int, int] = {}
    never = FarthestNextUse.NEVER
    for i in range(len(prompts) - 1, -1, -1):
        pages = prompts[i]
        out[i] = {p: (last.get(p, never), d) for d, p in enumerate(pages)}
        for p in pages:
            last[p] = i
    return out


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
