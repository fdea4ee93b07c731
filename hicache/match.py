"""`HiCache.match`: how much of a prompt the engine may skip (`Matcher`, which
`hicache.cache.HiCache` holds and whose `match` it offers as its own; engine thread).

One question, one answer (every `Match` is made at the end of `match`, from what the steps
found):

1. the prompt is hashed as far as needed (`hicache.core.keys.KeyChain`, the request's own,
   kept between questions in a `Request`);
2. the host tier's slot books give the leading run of pages they hold (`_host_prefix`);
3. where the prompt runs past that run, the walk down the store tiers starts
   (`_look_ahead` -> `hicache.chain.walk.TierChain.start`): the answer is pending while it runs;
4. the hit is capped (the engine recomputes at least `min_recompute_tokens`), snapped to a
   stored state for hybrid models, and its pages pinned until `load` (`_lookup`).

Asked again while the walk runs, the same answer stands; once the walk is done, the hit grows by
what it brought (`_fetched`, without a second lookup where one tier brought it all).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from hicache.backends.host import HostTier
from hicache.chain.fetch import Fetch
from hicache.chain.walk import TierChain, adopt_keys
from hicache.config import Layout, Policy
from hicache.core.keys import KeyChain, PrefixMemo, as_tokens, chain_seed
from hicache.core.marks import mark
from hicache.core.request import Match
from hicache.core.slots import Lease
from hicache.observability.stats import Stats

SEED_MEMO = 1024
"""Salts whose chain seeds `match` keeps (the oldest go first): a seed costs ~5 us to make."""


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


class _Hit(NamedTuple):
    """What a match found, in pages (`match` makes the `Match` of it)."""

    end: int
    """The page the hit ends at."""
    load: int
    """The pages `load` copies."""
    tiers: tuple[tuple[str, int], ...]
    """The tokens each store tier brought."""
    state: bool
    """The hit ends at a stored state."""
    pending: bool
    """The walk down the store tiers still runs: ask again."""
    limited: int
    """Pages found that the cap or the snap to a state kept out."""


class Matcher:
    """Answers `match` and keeps each request's `Request` (the engine thread's request table,
    which `HiCache.load`, `store` and `release` read too).

    Takes what it reads: the page layout and policy, the host tier (its slot books), the walk
    down the store tiers (None without store tiers), the engine's state hooks (None without a
    state layout), the stats it counts answers in, the layout's fingerprint (the keys' seed)
    and the prefix memo (None: off)."""

    def __init__(
        self,
        layout: Layout,
        policy: Policy,
        host: HostTier,
        chain: TierChain | None,
        hooks: Any,
        stats: Stats,
        fingerprint: bytes,
        memo: PrefixMemo | None,
    ) -> None:
        self.layout = layout
        self.policy = policy
        self.host = host
        self._chain = chain
        self._hooks = hooks
        self._stats = stats
        self.fingerprint = fingerprint
        self._memo = memo
        self.requests: dict[str, Request] = {}
        """Every request between its first `match` (or `store`) and `release`, by id."""
        self._seeds: dict[bytes | str | None, bytes] = {}

    def match(
        self,
        request_id: str,
        tokens: Any,
        *,
        salt: str | bytes | None = None,
        computed_tokens: int = 0,
        partial: bool = False,
    ) -> Match:
        """How many leading tokens of `tokens` the engine may skip, and what `load` will copy.

        `computed_tokens`: leading tokens whose KV the engine already holds in its own pool
        (page-aligned; 0 for an engine without a prefix cache). `salt` separates tenants.
        The prompt is hashed once per request; asking again for the same request (for example
        after a pending answer) reuses its keys, and while its fetch is still running returns
        the same pending answer without walking the tiers again. hicache keeps a copy of the
        tokens, never the caller's array: the caller may change or reuse it at once. The
        pages (and state) of the hit are pinned in the host tier until `load` has copied them or
        `release` is called.

        `partial=True` lets hicache plan a partial fetch when the hit would come from the store
        tiers (policy `fetch_pending: wait` only): where the cost model finds that the engine's
        prefill of the hit's head and the first store tier's read of its tail end together
        past the host hit, the answer (pending while the tiers send the tail) has
        `head_tokens` = k, and only the pages from k on are asked of the tiers. The engine
        computes [computed_tokens, k) meanwhile, asks again until the answer is not pending
        and loads with ``from_token=k`` (the final answer keeps k; its hit_tokens >= k). Where
        the host tier holds more than k tokens, nothing is planned: the host part is fast.
        """
        mark("cache.match")
        started = time.perf_counter()
        tokens = as_tokens(tokens)
        n, P = tokens.shape[0], self.layout.page_tokens
        if n == 0:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        if computed_tokens < 0 or computed_tokens >= n or computed_tokens % P:
            raise ValueError(
                f"request {request_id!r}: computed_tokens={computed_tokens} must be a multiple "
                f"of page_tokens={P} below the prompt length {n}"
            )
        req = self.request(request_id, tokens, salt)
        # The same question as last time, answered pending: that answer stands while the walk
        # runs, and once it is done can grow by what the walk brought.
        again = req.match if req.asked == n else None
        if again is not None and (not again.pending or again.computed_tokens != computed_tokens):
            again = None
        m, walk = None, req.fetch
        if walk is not None and walk.busy:  # its answer may have come since poll
            self._chain.apply()  # type: ignore[union-attr]
            if again is not None and self._chain.waiting(walk):  # type: ignore[union-attr]
                m = again  # the same answer, its pins kept
        if m is None:
            first = computed_tokens // P
            cap = max(0, n - self.policy.min_recompute_tokens) // P
            done = walk if walk is not None and not walk.busy else None
            hit = None
            if done is not None:
                for part in done.parts():
                    adopt_keys(req.chain, part)
                if again is not None and not req.head_pages:
                    hit = self._fetched(req, again, done, cap)
            if hit is None:
                hit = self._lookup(req, first, cap, partial, done)
            end, load, tiers, state, pending, limited = hit
            m = Match(
                request_id=request_id,
                hit_tokens=end * P,
                computed_tokens=computed_tokens,
                first_page=first,
                load_pages=load,
                tier_tokens=tiers,
                needs_state=state,
                pending=pending,
                limited_tokens=limited * P,
                head_tokens=req.head_pages * P,
            )
        req.match, req.asked = m, n
        self._stats.matched(m, n)
        self._stats.latency["hicache_match_seconds"].observe(time.perf_counter() - started)
        return m

    def _lookup(
        self, req: Request, first: int, cap: int, partial: bool, done: Fetch | None
    ) -> _Hit:
        """The host tier's hit from page `first` (capped, snapped to a state where the layout has
        them), pinned for `load`, and the look-ahead started past it; for a partial fetch
        (`req.head_pages` = k) the pages from k on instead: while the walk is pending, the head
        alone (nothing pinned), then the pages from k on that the host tier holds now. What a
        finished walk still held is released (its pages are pinned by this match now, or not
        needed)."""
        req.drop_pins()
        slots = self._host_prefix(req.chain, first)
        found = first + len(slots)
        pending = self._look_ahead(req, first, found, cap, partial)
        k = req.head_pages
        if k and pending:
            return _Hit(k, 0, (), False, True, 0)
        if k:
            keys = req.chain.hashed
            slots = self.host.page_slots.prefix(keys[k:cap]) if len(keys) > k else []
            start, end = k, k + len(slots)
        else:
            start, end = first, max(first, min(found, cap))
        state_slot, tiers = None, ()
        if self._hooks is not None and end > start:
            end, state_slot = self._snap_to_state(req.chain.hashed, start, end)
        if end > start:
            req.pages = self.host.page_slots.lease(slots[: end - start])
            if state_slot is not None:
                req.state = self.host.state_slots.lease([state_slot])
            if done is not None:
                tiers = _tier_tokens(done, start, end, self.layout.page_tokens)
        if done is not None:
            for part in done.parts():
                part.release()
        load = end - first if end > start else 0
        return _Hit(end, load, tiers, state_slot is not None, pending, 0 if k else found - end)

    def _host_prefix(self, chain: KeyChain, first: int) -> list[int]:
        """Host slots of the pages from `first` on, up to the first miss, hashing the prompt only
        that far: the compiled walk hashes and looks up pair by pair; without it, steps that
        double from 16 pages."""
        pool, P = self.host.page_slots, chain.page_tokens
        known = chain.hash_to(first)  # the pages the engine computed are hashed, not looked up
        slots = pool.prefix(known[first:]) if len(known) > first else []
        begin = len(known)
        if first + len(slots) < begin or begin >= chain.pages:
            return slots
        prev = known[-1] if known else chain.seed
        walked = pool.walk(prev, chain.tokens[begin * P : chain.pages * P].reshape(-1, P))
        if walked is not None:
            keys, found = walked
            chain.hashed += keys  # hashed from `prev` in the chain's format
            return slots + found
        step = 16
        while begin < chain.pages:
            end = min(chain.pages, begin + step)
            found = pool.prefix(chain.hash_to(end)[begin:end])
            slots += found
            if len(found) < end - begin:
                break
            begin, step = end, 2 * step
        return slots

    def _look_ahead(self, req: Request, first: int, found: int, cap: int, partial: bool) -> bool:
        """Start the walk down the store tiers for the pages after the host hit (the first
        tier's `Fetcher.start` hashes the first of them, its worker the rest), or, for a
        `partial` match that the chain plans, after the head; True while the request waits."""
        chain = self._chain
        if chain is None:
            return False
        if req.fetch is None and found < cap:
            head, fetch_s, deadline = 0, 0.0, None
            if partial and self.policy.fetch_pending == "wait":
                head, fetch_s = chain.plan(first, found, cap)
            if head:  # the walk may take as long as the plan expects, and the usual wait on top
                deadline = chain.clock() + fetch_s + self.policy.fetch_max_wait_ms / 1e3
            req.fetch = chain.start(
                req.chain, max(found, head), cap, deadline=deadline, planned=head > 0
            )
            req.head_pages = head if req.fetch is not None else 0
        return req.fetch is not None and chain.waiting(req.fetch)

    def _fetched(self, req: Request, pending: Match, walk: Fetch, cap: int) -> _Hit | None:
        """The `pending` answer grown by its finished walk, when one tier's fetch reached the
        cap: the host hit (still pinned) followed by the fetched pages up to the cap, whose pins
        move from the fetch to the request. Nothing is looked up or hashed. None when the
        general walk must answer: a state layout (the hit snaps to a state), pages from more
        than one tier, a fetch that fell short of the cap, or a page past the host hit that the
        host tier held under another slot by then (another request stored it meanwhile)."""
        found = pending.first_page + pending.load_pages  # its host hit, pinned
        fetch = walk
        if walk.next is not None:  # the one part that brought pages, if only one did
            brought = [part for part in walk.parts() if part.lease is not None]
            if len(brought) != 1:
                return None
            fetch = brought[0]
        lo, hi = fetch.pages
        # (a fetch started by an earlier question may have begun past this host hit)
        if self._hooks is not None or fetch.lease is None or hi < cap or not lo <= found < cap:
            return None
        mine = fetch.lease.slots[found - lo : hi - lo]  # the slots of pages [found, hi)
        if fetch.fresh[len(fetch.fresh) - len(mine) :] != mine:
            return None  # not every page past the host hit was published by the fetch
        taken = fetch.lease.split(len(fetch.lease.slots) - (found - lo))  # pages found..
        taken.split(len(taken.slots) - (cap - found)).release()  # pages past the cap: not needed
        for part in walk.parts():
            part.release()  # its slots before the host hit: reserved, never published
        if req.pages is None:
            req.pages = taken
        else:
            req.pages.absorb(taken)
        tiers = ((fetch.source.name, (cap - found) * self.layout.page_tokens),)
        return _Hit(cap, cap - pending.first_page, tiers, False, False, hi - cap)

    def release(self, request_id: str) -> None:
        """Forget a request (finished or aborted) and drop what its match pinned. Idempotent."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        req.drop_pins()
        if self._memo is not None:
            self._memo.remember(req.chain)
        if req.fetch is not None and self._chain is not None:
            self._chain.forget(req.fetch)

    def _snap_to_state(self, keys: list[bytes], first: int, hit: int) -> tuple[int, int | None]:
        """The deepest page count in (first, hit] whose boundary has a stored state."""
        slots = self.host.state_slots.lookup(keys[first:hit])
        for pages in range(hit, first, -1):
            slot = slots[pages - first - 1]
            if slot is not None:
                return pages, slot
        return first, None

    def request(self, request_id: str, tokens: np.ndarray, salt: str | bytes | None) -> Request:
        """The request's state, its chain grown to `tokens`; a new one where the request is new,
        its salt differs, or `tokens` do not extend its tokens (the old one's pins are dropped
        and its walk down the tiers forgotten then)."""
        seeds = self._seeds
        seed = seeds.get(salt)
        if seed is None:  # bounded: a salt per tenant or per user must not grow it forever
            if len(seeds) >= SEED_MEMO:
                del seeds[next(iter(seeds))]  # the oldest (a salt asked again costs ~5 us)
            seed = seeds[salt] = chain_seed(self.fingerprint, salt)
        req = self.requests.get(request_id)
        if req is not None:
            if req.chain.seed == seed and req.chain.try_extend(tokens):
                return req
            req.drop_pins()
            if req.fetch is not None:
                self._chain.forget(req.fetch)  # type: ignore[union-attr]
        req = Request(KeyChain(seed, self.layout.page_tokens, tokens, self._memo))
        self.requests[request_id] = req
        return req


def _tier_tokens(
    walk: Fetch, first: int, hit: int, page_tokens: int
) -> tuple[tuple[str, int], ...]:
    """The tokens of a hit of pages [first, hit) that each tier of a finished walk brought:
    the pages a tier's fetch published past the host hit it started from and past what the
    tiers before it brought."""
    out = []
    done = first
    for part in walk.parts():
        lo, hi = part.pages
        begin, end = max(done, part.host_pages, lo), min(hit, hi)
        if end > begin:
            out.append((part.source.name, (end - begin) * page_tokens))
            done = end
    return tuple(out)
