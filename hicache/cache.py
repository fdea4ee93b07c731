"""`HiCache`: the API an engine embeds.

One request, as the engine sees it::

    m = cache.match(rid, prompt)                  # numbers only; nothing is copied yet
    blocks = engine.allocate(...)                 # the engine allocates, hicache never does
    cache.load(m, blocks[m.first_page:], slot)    # host -> GPU on the engine's stream
    engine.prefill(from_token=m.hit_tokens)
    cache.store(rid, prompt, blocks, slot)        # GPU -> host, new pages and trailing states
    ...                                           # decode
    cache.store(rid, prompt + output[:-1], blocks, slot)   # optional: keep the answer too
    cache.release(rid)
    cache.poll()                                  # every engine step

All methods are called from the engine thread; none of them blocks or synchronizes the device.
hicache never calls the engine's scheduler: it returns numbers and takes block ids.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Protocol

import numpy as np
import torch

from hicache.config import HiCacheConfig, Layout, StoreTierConfig
from hicache.core import native, threads
from hicache.core.keys import KeyChain, PrefixMemo, as_tokens, chain_seed, fingerprint
from hicache.core.request import Match, Request
from hicache.core.slots import Lease
from hicache.errors import StateHookError
from hicache.observability.events import EventSink, emit
from hicache.observability.stats import Stats
from hicache.tiers.base import StoreTier
from hicache.tiers.chain import TierChain, adopt_keys
from hicache.tiers.gpu import GpuTier
from hicache.tiers.host import HostTier, HostTierConfig
from hicache.tiers.link import Fetch
from hicache.transfer.completions import DONE, Completion, Transfers
from hicache.transfer.kernels import PagedBuffer, Route, prepare, route


class StateHooks(Protocol):
    """How hicache reads and writes the engine's per-sequence states (hybrid models only).

    A state is opaque bytes: what the engine needs, beyond the KV pages, to resume a sequence at
    a page boundary (for sliding-window layers, the window ending there).
    """

    state_bytes: int
    """Size of one state; equals the layout's state_bytes."""
    history_tokens: int
    """`save_state(slot, b, ...)` works for page boundaries b >= n - history_tokens, where n is
    the number of tokens the slot has processed."""

    def save_state(self, slot: int, boundary: int, out: torch.Tensor) -> None:
        """Write the state of `slot` at `boundary` into `out` (1-D uint8 host tensor, pinned on
        CUDA). Enqueue the copy on the current stream; on the CPU finish before returning."""

    def load_state(self, slot: int, boundary: int, src: torch.Tensor) -> None:
        """Make `slot` resume at `boundary` from the state in `src` (same rules as save)."""


class HiCache:
    """A tiered KV cache behind match / load / store / poll / release.

    `gpu` is the engine's KV pool (`PagedBuffer.page_first(pool)` or `.layer_first(tensors)`);
    `layout` describes its pages (defaults to the config's layout section); `states` are the
    engine's state hooks, required when the layout has state_bytes; `stream` is the CUDA stream
    of the engine's model kernels (default: the current stream at each call); `events` receives
    a `KVEvent` whenever a tier stores or removes pages (see `hicache.observability.events`);
    `wake` is called
    from a store tier's worker thread whenever it has posted a result for `poll` or `match` to
    apply (an engine whose loop sleeps while requests wait on a fetch sets an event or writes an
    eventfd there; it must be thread-safe and return at once). `layers` is the number of KV
    layers a page holds, for loads layer by layer (`load(..., by_layer=True)`; 0: none): the
    pool's segments split into that many equal runs, or a page-first pool's rows into that many
    equal column ranges.

    On CUDA the constructor builds (the first time on a machine, about 20 s, then cached) and
    loads the page-copy extension, so that no copy on the engine thread pays for it.
    """

    def __init__(
        self,
        config: HiCacheConfig,
        gpu: PagedBuffer,
        *,
        layout: Layout | None = None,
        states: StateHooks | None = None,
        stream: torch.cuda.Stream | None = None,
        events: EventSink | None = None,
        wake: Callable[[], None] | None = None,
        layers: int = 0,
    ) -> None:
        layout = layout or config.layout
        if layout is None:
            raise ValueError("no layout: give layout= or a 'layout' section in the config")
        if layout.state_bytes and states is None:
            raise ValueError(f"the layout has state_bytes={layout.state_bytes}: give states=")
        if states is not None and states.state_bytes != layout.state_bytes:
            raise ValueError(
                f"the state hooks' state_bytes={states.state_bytes} disagrees with the "
                f"layout's state_bytes={layout.state_bytes}"
            )
        store_configs = _store_tiers(config)  # checked before any thread or pool is made
        self.config = config
        self.layout = layout
        self.policy = config.policy
        self.fingerprint = fingerprint(layout)
        self.gpu = GpuTier(gpu, layout)
        self.layers = layers
        if layers:
            gpu.by_layer(layers)  # ValueError now, on the caller's thread, if they do not fit
        self._layer_routes: list[Route] = []
        host_config = config.tiers[0]  # HiCacheConfig guarantees the first tier is the host tier
        if not isinstance(host_config, HostTierConfig):
            raise TypeError(f"tiers[0] must be a HostTierConfig, got {type(host_config).__name__}")
        self._stats = Stats(prefill_tokens_per_s=int(self.policy.prefill_tokens_per_s))
        self._events = events
        prepare(self.gpu.device)  # on CUDA: build/load the copy extension now, not at a copy
        native.available()  # load the compiled helpers now, not in the first store
        self._routes: tuple[Route, Route] | None = None
        # the pool counts evictions anyway; the hook runs for an event sink or a write-back tier
        writes_back = any(c.write == "on_evict" for c in store_configs)
        evicted = self._evicted if events is not None or writes_back else None
        self.host = HostTier(host_config, layout, evicted, self._prepare_copies)
        self._hooks = states if layout.state_bytes else None
        self._transfers = Transfers(self.gpu.device, stream)
        self._requests: dict[str, Request] = {}
        self._seeds: dict[bytes | str | None, bytes] = {}
        memo = self.policy.prefix_memo
        self._memo = PrefixMemo(layout.page_tokens, memo) if memo else None
        self._chain: TierChain | None = None
        if store_configs:
            self._chain = TierChain(
                store_configs, self.host, layout, self.fingerprint, self.policy, self._stats,
                events, wake,
            )  # fmt: skip
        self.metrics_server = None
        if config.metrics.port is not None:
            from hicache.observability.metrics import register, serve

            registry, _ = register(self)
            self.metrics_server = serve(registry, config.metrics.port, config.metrics.addr)

    def _prepare_copies(self, host: HostTier) -> None:
        """The copy routes between the GPU pool and the host slots (cut into the pool's
        segments), checked once. Run by the host tier's allocating thread, before it is ready:
        the engine thread never builds them."""
        gpu, slots = self.gpu.pages, host.pages.resegment(self.gpu.pages.seg_bytes)
        self._routes = (route(gpu, slots), route(slots, gpu))
        if self.layers:
            layers = zip(slots.by_layer(self.layers), gpu.by_layer(self.layers), strict=True)
            self._layer_routes = [route(host, pool) for host, pool in layers]

    def _route(self, to_host: bool) -> Route:
        """The route GPU pool -> host slots (`to_host`) or back; only while the host is ready."""
        return self._routes[0 if to_host else 1]  # type: ignore[index]

    def _evicted(self, keys: list[bytes]) -> None:
        emit(self._events, "removed", "host", keys)
        if self._chain is not None:
            self._chain.evicted(keys)

    # -- match ----------------------------------------------------------------------------------

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
        the same pending answer without walking the tiers again. An int32 array is kept as it
        is, not copied: the caller must not change it in place while the request lives. The
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
        started = time.perf_counter()
        tokens = as_tokens(tokens)
        n = tokens.shape[0]
        if n == 0:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        P = self.layout.page_tokens
        if computed_tokens < 0 or computed_tokens >= n or computed_tokens % P:
            raise ValueError(
                f"request {request_id!r}: computed_tokens={computed_tokens} must be a multiple "
                f"of page_tokens={P} below the prompt length {n}"
            )
        req = self._request(request_id, tokens, salt)
        again = _pending_answer(req, n, computed_tokens)  # the same question as last time
        if req.fetch is not None and req.fetch.busy:  # its answer may have come since poll
            self._chain.apply()  # type: ignore[union-attr]
            if again is not None and self._chain.waiting(req.fetch):  # type: ignore[union-attr]
                return self._answer(req, again, n, started)  # the same answer, its pins kept
        first = computed_tokens // P
        cap = max(0, n - self.policy.min_recompute_tokens) // P
        done = req.fetch if req.fetch is not None and not req.fetch.busy else None
        if done is not None:
            for part in done.parts():
                adopt_keys(req.chain, part)
            grown = None
            if again is not None and not req.head_pages:
                grown = self._fetched(req, again, done, cap)
            if grown is not None:
                return self._answer(req, grown, n, started)
        req.drop_pins()
        slots = self._host_prefix(req.chain, first)
        keys = req.chain.hashed
        found = first + len(slots)
        hit = min(found, cap)
        pending = self._look_ahead(req, first, found, cap, partial)
        if req.head_pages:
            m = self._tail(req, request_id, computed_tokens, cap, pending, done)
            return self._answer(req, m, n, started)
        state_slot = None
        if self._hooks is not None and hit > first:
            hit, state_slot = self._snap_to_state(keys, first, hit)
        tier_tokens: tuple[tuple[str, int], ...] = ()
        if hit > first:
            req.pages = self.host.page_slots.lease(slots[: hit - first])
            if state_slot is not None:
                req.state = self.host.state_slots.lease([state_slot])
            hit_tokens = hit * P
            if done is not None:
                tier_tokens = _tier_tokens(done, first, hit, P)
        else:
            hit, hit_tokens = first, computed_tokens
        if done is not None:
            for part in done.parts():
                part.release()  # its pages are pinned by this match now, or not needed
        m = Match(
            request_id=request_id,
            hit_tokens=hit_tokens,
            computed_tokens=computed_tokens,
            first_page=first,
            load_pages=hit - first,
            tier_tokens=tier_tokens,
            needs_state=state_slot is not None,
            pending=pending,
            limited_tokens=(found - hit) * P,
        )
        return self._answer(req, m, n, started)

    def _answer(self, req: Request, m: Match, n: int, started: float) -> Match:
        """Make `m` the request's current answer to a prompt of `n` tokens, and count it."""
        req.match, req.asked = m, n
        self._stats.matched(m, n)
        self._stats.latency["hicache_match_seconds"].observe(time.perf_counter() - started)
        return m

    def _host_prefix(self, chain: KeyChain, first: int) -> list[int]:
        """Host slots of the pages from `first` on, up to the first miss, hashing the prompt only
        that far: the compiled walk hashes and looks up pair by pair; without it, steps that
        double from 16 pages."""
        pool = self.host.page_slots
        chain.upto(first)  # the pages the engine computed are hashed, not looked up
        known = chain.hashed
        slots = pool.prefix(known[first:]) if len(known) > first else []
        begin = len(known)
        if first + len(slots) < len(known) or begin >= chain.pages:
            return slots
        prev = known[-1] if known else chain.seed
        walked = pool.walk(prev, chain.rows(begin))
        if walked is not None:
            keys, found = walked
            chain.append(keys)
            return slots + found
        step = 16
        while begin < chain.pages:
            end = min(chain.pages, begin + step)
            found = pool.prefix(chain.upto(end)[begin:])
            slots += found
            if len(found) < end - begin:
                break
            begin, step = end, 2 * step
        return slots

    def _look_ahead(self, req: Request, first: int, found: int, cap: int, partial: bool) -> bool:
        """Start the walk down the store tiers for the pages after the host hit (the first
        tier's `start_fetch` hashes the first of them, its worker the rest), or, for a
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

    def _tail(
        self,
        req: Request,
        request_id: str,
        computed_tokens: int,
        cap: int,
        pending: bool,
        walk: Fetch | None,
    ) -> Match:
        """The answer of a partial fetch from page k = `req.head_pages`: while `pending`, the
        head alone (nothing pinned); then the pages from k on that the host tier holds now (up
        to the cap, snapped to a state), pinned for `load`, whatever the walk brought."""
        P, k = self.layout.page_tokens, req.head_pages
        first = computed_tokens // P
        hit, state_slot, tier_tokens = k, None, ()
        if not pending:
            keys = req.chain.hashed
            slots = self.host.page_slots.prefix(keys[k:cap]) if len(keys) > k else []
            hit = k + len(slots)
            if self._hooks is not None and hit > k:
                hit, state_slot = self._snap_to_state(keys, k, hit)
            if hit > k:
                req.pages = self.host.page_slots.lease(slots[: hit - k])
                if state_slot is not None:
                    req.state = self.host.state_slots.lease([state_slot])
                if walk is not None:
                    tier_tokens = _tier_tokens(walk, k, hit, P)
            if walk is not None:
                for part in walk.parts():
                    part.release()  # its pages are pinned by this match now, or not needed
        return Match(
            request_id=request_id,
            hit_tokens=hit * P,
            computed_tokens=computed_tokens,
            first_page=first,
            load_pages=hit - first if hit > k else 0,
            tier_tokens=tier_tokens,
            needs_state=state_slot is not None,
            pending=pending,
            head_tokens=k * P,
        )

    def _fetched(self, req: Request, pending: Match, walk: Fetch, cap: int) -> Match | None:
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
        taken = fetch.lease.split(len(fetch.lease) - (found - lo))  # pages found..
        taken.split(len(taken) - (cap - found)).release()  # pages past the cap: not needed
        for part in walk.parts():
            part.release()  # its slots before the host hit: reserved, never published
        if req.pages is None:
            req.pages = taken
        else:
            req.pages.absorb(taken)
        P = self.layout.page_tokens
        return Match(
            request_id=pending.request_id,
            hit_tokens=cap * P,
            computed_tokens=pending.computed_tokens,
            first_page=pending.first_page,
            load_pages=cap - pending.first_page,
            tier_tokens=((fetch.link.name, (cap - found) * P),),
            limited_tokens=(hi - cap) * P,
        )

    def _snap_to_state(self, keys: list[bytes], first: int, hit: int) -> tuple[int, int | None]:
        """The deepest page count in (first, hit] whose boundary has a stored state."""
        slots = self.host.state_slots.lookup(keys[first:hit])
        for pages in range(hit, first, -1):
            slot = slots[pages - first - 1]
            if slot is not None:
                return pages, slot
        return first, None

    def _request(self, request_id: str, tokens: np.ndarray, salt: str | bytes | None) -> Request:
        req = self._requests.get(request_id)
        seed = self._seed(salt)
        if req is not None and req.chain.seed == seed:
            if req.chain.try_extend(tokens):
                return req
            req.drop_pins()
        req = Request(KeyChain(seed, self.layout.page_tokens, tokens, self._memo))
        self._requests[request_id] = req
        return req

    def _seed(self, salt: str | bytes | None) -> bytes:
        seed = self._seeds.get(salt)
        if seed is None:
            seed = self._seeds[salt] = chain_seed(self.fingerprint, salt)
        return seed

    # -- load -----------------------------------------------------------------------------------

    def load(
        self,
        match: Match,
        block_ids: Sequence[int],
        state_slot: int | None = None,
        *,
        by_layer: bool = False,
        from_token: int | None = None,
    ) -> Completion:
        """Copy the hit's pages into `block_ids` (and its state into `state_slot`).

        `block_ids[k]` receives page ``match.first_page + k``; at least `match.load_pages` ids
        are needed. The copies are enqueued on the engine's stream: kernels the engine enqueues
        afterwards see the pages. The returned completion tells when the copies have finished
        (the engine need not wait for it). On a bad argument (ValueError) nothing is copied and
        the match stays loadable; if the state hook raises (StateHookError) the match is dropped
        and the engine recomputes from `match.computed_tokens`.

        `by_layer=True` (with `layers` given at construction) copies layer after layer on a copy
        stream of hicache's own, after the work already on the engine's stream, and returns a
        `LayerLoad`: the engine calls ``wait_layer(i)`` before its stream computes layer i (or
        reads layer i's pages), so the prefill of layer i overlaps the copies of the layers after
        it. Every returned completion has ``wait_layer``; on the engine's stream it is a no-op.
        `from_token` (a page boundary in [computed_tokens, hit_tokens]) copies only the pages
        from there on: the engine computes the tokens before it itself (a partial fetch, see
        `hicache.core.plan`), and must have enqueued that computation before this call when the hit
        has a state (the state at `hit_tokens` then overwrites what it left). A match with
        `head_tokens` needs from_token >= head_tokens. The pins of the hit are released, all at
        once, when its last copy has completed.
        """
        req = self._requests.get(match.request_id)
        if req is None or req.match is not match:
            raise ValueError(
                f"request {match.request_id!r}: this match is not the request's current one "
                "(released, loaded already, or superseded by a newer match)"
            )
        if match.pending:
            raise ValueError(f"request {match.request_id!r}: the match is pending; match again")
        what = f"load of request {match.request_id!r}"
        ids = self.gpu.block_ids(block_ids, match.load_pages, what)
        if match.needs_state and state_slot is None:
            raise ValueError(f"{what}: the hit includes a state, give state_slot")
        if by_layer and not self.layers:
            raise ValueError(f"{what}: by_layer needs layers= at construction")
        skip = self._skipped_pages(match, from_token, what)
        P = self.layout.page_tokens
        head = (match.head_tokens - match.computed_tokens) // P if match.head_tokens else 0
        if skip < head:  # the pages before the head were never fetched
            raise ValueError(
                f"{what}: a partial fetch, give from_token >= head_tokens={match.head_tokens}"
            )
        if match.load_pages == 0:
            req.drop_pins()
            return DONE
        pages, state = req.pages, req.state
        req.pages = req.state = None
        req.match = None
        leases = [lease for lease in (pages, state) if lease is not None]
        try:
            if state is not None:
                self._call_hook("load_state", state_slot, match.hit_tokens, state.slots[0])
            latency = self._stats.latency["hicache_load_copy_seconds"]
            slots, ids = _int32(pages.slots[skip - head :]), ids[skip:]
            if by_layer:
                done = self._transfers.copy_layers(
                    self._layer_routes, slots, ids, lambda: _release(leases), latency
                )
            else:
                self._transfers.copy(self._route(to_host=False), slots, ids, latency)
        except BaseException:
            _release(leases)
            raise
        self._stats.loaded(_partial(match, skip, self.layout.page_tokens))
        return done if by_layer else self._transfers.then(lambda: _release(leases))

    def _skipped_pages(self, match: Match, from_token: int | None, what: str) -> int:
        """Pages of the hit that `load` leaves to the engine (see its `from_token`)."""
        if from_token is None:
            return 0
        low, P = match.computed_tokens, self.layout.page_tokens
        if not low <= from_token <= match.hit_tokens or from_token % P:
            raise ValueError(
                f"{what}: from_token={from_token} must be a multiple of page_tokens={P} in "
                f"[{low}, {match.hit_tokens}]"
            )
        return (from_token - low) // P

    # -- store ----------------------------------------------------------------------------------

    def store(
        self,
        request_id: str,
        tokens: Any,
        block_ids: Sequence[int],
        state_slot: int | None = None,
        *,
        salt: str | bytes | None = None,
    ) -> int:
        """Write through: copy the full pages of `tokens` that the host tier lacks, GPU -> host.

        `tokens` are the tokens whose KV the engine holds in `block_ids` (page i in
        ``block_ids[i]``): the prompt after its prefill, or prompt + output[:-1] at the end of a
        request. They must extend what the request matched. With a state layout, the states at
        the last `policy.state_boundaries` page boundaries that the engine can still produce are
        saved from `state_slot` too. Returns the number of pages copied. When the host tier is
        full of pinned pages, the leading pages that fit are stored and the rest are counted as
        dropped. `salt` is used only for a request that was never matched.
        """
        if self.policy.write_policy == "read_only":
            return 0
        tokens = as_tokens(tokens)
        if not self.host.ready:  # the pools are still being allocated: nothing to store into
            self._stats.dropped(tokens.shape[0] // self.layout.page_tokens)
            return 0
        req = self._requests.get(request_id)
        if req is None:
            req = self._request(request_id, tokens, salt)
        else:
            req.chain.extend(tokens)
        P = self.layout.page_tokens
        n_pages = tokens.shape[0] // P
        what = f"store of request {request_id!r}"
        ids = self.gpu.block_ids(block_ids, n_pages, what)
        if self._hooks is not None and state_slot is None and n_pages:
            raise ValueError(f"{what}: the layout has states, give state_slot")
        keys = req.chain.upto(n_pages)
        pool = self.host.page_slots
        present, missing = pool.split(keys)
        keep = pool.lease(present)  # the sequence's own pages must not be evicted for its tail
        try:
            pages = self._store_pages(keys, ids, missing)
        except BaseException:
            keep.release()
            raise
        states = None
        try:
            if self._hooks is not None and n_pages:
                states = self._store_states(keys, tokens.shape[0], state_slot)
        finally:
            # New pages are unpinned before the held ones, once the copies are done: the
            # sequence's head ends up most recent, so its tail is evicted first.
            slots = (
                None if self._chain is None else _slots_in_order(keep, pages, missing, len(keys))
            )
            self._after_store(keys, slots, pages, keep, states)
        return len(pages) if pages is not None else 0

    def _store_pages(self, keys: list[bytes], ids: np.ndarray, missing: list[int]) -> Lease | None:
        """Copy the `missing` pages into fresh host slots; the returned lease pins them."""
        if not missing:
            return None
        pool = self.host.page_slots
        lease = pool.reserve(len(missing))
        if len(lease) < len(missing):
            self._stats.dropped(len(missing) - len(lease))
            missing = missing[: len(lease)]
        if not missing:
            lease.release()
            return None
        try:
            latency = self._stats.latency["hicache_store_copy_seconds"]
            src_ids = ids if len(missing) == len(ids) else native.gather_int32(ids, missing)
            slots = native.align_slots(src_ids, lease.slots)  # runs of blocks: one row
            lease.slots = slots.tolist()
            dst_ids = np.frombuffer(slots, dtype=np.int32)
            self._transfers.copy(self._route(to_host=True), src_ids, dst_ids, latency)
        except BaseException:
            lease.release()
            raise
        new_keys = keys if len(missing) == len(keys) else [keys[i] for i in missing]
        fresh = pool.publish(lease.slots, new_keys)
        if self._events is not None:
            emit(self._events, "stored", "host", pool.keys_of(fresh))
        self._stats.stored(len(missing))
        return lease

    def _store_states(
        self, keys: list[bytes], n_tokens: int, state_slot: int | None
    ) -> Lease | None:
        """Save the states at the trailing boundaries (and, with store tiers, the last group end
        of each tier's group size)."""
        hooks, P = self._hooks, self.layout.page_tokens
        if hooks is None:
            return None
        oldest = n_tokens - hooks.history_tokens
        boundaries = list(range(len(keys), 0, -1)[: self.policy.state_boundaries])
        if self._chain is not None:  # stores keep whole groups: a state at a group end is fetched
            boundaries += [len(keys) // G * G for G in self._chain.group_pages]
        boundaries = sorted({b for b in boundaries if b and b * P >= oldest}, reverse=True)
        held = self.host.state_slots.lookup([keys[b - 1] for b in boundaries])
        wanted = [b for b, slot in zip(boundaries, held) if slot is None]
        if not wanted:
            return None
        lease = self.host.state_slots.reserve(len(wanted))
        wanted = wanted[: len(lease)]
        try:
            for pages, slot in zip(wanted, lease.slots):
                self._call_hook("save_state", state_slot, pages * P, slot)
        except BaseException:
            lease.release()
            raise
        self.host.state_slots.publish(lease.slots, [keys[p - 1] for p in wanted])
        self._stats.stored_states(len(wanted))
        return lease

    def _after_store(
        self, keys: list[bytes], slots: list[int] | None, *leases: Lease | None
    ) -> None:
        """Unpin once the store's copies have completed; hand the new groups to write-behind now
        (its worker waits for the copies before it reads the host slots). `slots`: the host
        slot of every page of `keys`, where the store knows them (see `_slots_in_order`)."""
        held = [lease for lease in leases if lease is not None]
        if not held and self._chain is None:
            return
        copied = self._transfers.then(lambda: _release(held))
        if self._chain is not None:
            self._chain.stored(keys, copied, slots)

    def _call_hook(self, name: str, state_slot: int | None, boundary: int, host_slot: int) -> None:
        try:
            getattr(self._hooks, name)(state_slot, boundary, self.host.state(host_slot))
        except Exception as err:
            self._stats.hook_failed()
            raise StateHookError(
                f"state hook {name}(slot={state_slot}, boundary={boundary}) raised "
                f"{type(err).__name__}: {err}"
            ) from err

    # -- housekeeping ---------------------------------------------------------------------------

    def poll(self) -> None:
        """Retire finished copies, release what they pinned, apply the store tiers' results.
        Never blocks; call it every engine step."""
        self._transfers.poll()
        if self._chain is not None:
            self._chain.poll()

    def report_prefill(self, tokens: int, seconds: float) -> None:
        """The engine prefilled `tokens` in `seconds` (call it after each prefill, or now and
        then): the cost model's prefill speed follows it (a moving average), so that a page is
        fetched from a tier only where reading it beats recomputing it. Never blocks."""
        if self._chain is not None:
            self._chain.report_prefill(tokens, seconds)

    def release(self, request_id: str) -> None:
        """Forget a request (finished or aborted) and drop what its match pinned. Idempotent."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        req.drop_pins()
        if self._memo is not None:
            self._memo.remember(req.chain)
        if req.fetch is not None and self._chain is not None:
            self._chain.forget(req.fetch)

    def histograms(self) -> dict[str, dict[str, Any]]:
        """Latency histograms by Prometheus family name (see `hicache.observability.metrics`)."""
        return self._stats.histograms()

    def stats(self) -> dict[str, int]:
        """Counters and gauges as a plain dict (see `hicache.observability.stats.Stats` for their
        meaning)."""
        pages, states = self.host.page_slots, self.host.state_slots
        tiers = {} if self._chain is None else self._chain.gauges()
        return self._stats.as_dict(
            **tiers,
            pages_evicted=pages.evicted,  # host pages evicted so far
            host_slots=pages.capacity,
            host_used=pages.used,
            host_pinned=pages.pinned,
            state_slots=states.capacity,
            state_used=states.used,
            requests=len(self._requests),
            copies_in_flight=self._transfers.in_flight,
        )

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        """Block until the host pools are allocated and every store tier answers. True if both
        happened within `timeout_s`.

        For tools and tests; engines need not call it: until then `store` skips its pages
        (counted as dropped) and `match` does not ask a tier that does not answer."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if not self.host.wait_ready(timeout_s):
            return False
        while self._chain is not None and not self._chain.usable():
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    @property
    def store_tiers(self) -> dict[str, StoreTier]:
        """The store tiers below the host tier by name, in walk order (empty without any): what
        an integration reads their capabilities from (`shared`, `persistent`)."""
        return {} if self._chain is None else {link.name: link.store for link in self._chain.links}

    @property
    def tiers_idle(self) -> bool:
        """No store tier has work queued or running (always true without one). For tools and
        tests that wait for the writes to drain, calling `poll` meanwhile."""
        return self._chain is None or self._chain.idle

    def close(self) -> None:
        """Drop every request, drain the writes of persistent store tiers (bounded by each
        tier's `close_timeout_s`), close the tiers and free the host pools. Pending copies must
        have completed. Blocks."""
        for rid in list(self._requests):
            self.release(rid)
        if self._chain is not None:
            self._chain.close()
        if self.metrics_server is not None:
            self.metrics_server.close()
        self.host.close()


def _store_tiers(config: HiCacheConfig) -> list[StoreTierConfig]:
    """The store tiers below the host tier, in walk order, their CPUs checked."""
    stores = []
    for i, tier in enumerate(config.tiers[1:], start=1):
        if not isinstance(tier, StoreTierConfig):
            raise ValueError(f"tiers.{i}: type {tier.type!r} is not a store tier")
        threads.check_cpus(tier.worker_cpus, f"tiers.{i}.worker_cpus")
        stores.append(tier)
    return stores


def _pending_answer(req: Request, n: int, computed_tokens: int) -> Match | None:
    """The request's pending answer, if it is asked the same question again (a prompt of `n`
    tokens, `computed_tokens`): while its fetch runs that answer stands, and once the fetch is
    in it can grow by what the fetch brought."""
    m = req.match
    if m is not None and m.pending and req.asked == n and m.computed_tokens == computed_tokens:
        return m
    return None


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
            out.append((part.link.name, (end - begin) * page_tokens))
            done = end
    return tuple(out)


def _partial(m: Match, skipped: int, page_tokens: int) -> Match:
    """`m` as the load of its pages after the first `skipped` (what the stats count)."""
    if not skipped:
        return m
    start = m.computed_tokens + skipped * page_tokens
    return replace(
        m,
        computed_tokens=start,
        first_page=m.first_page + skipped,
        load_pages=m.load_pages - skipped,
        tier_tokens=_drop_head(m, skipped * page_tokens),
    )


def _drop_head(m: Match, tokens: int) -> tuple[tuple[str, int], ...]:
    """`m.tier_tokens` less the first `tokens` cached tokens: a hit runs the host's pages first,
    then each store tier's in walk order, so a head is taken from the host's part first."""
    drop = max(0, tokens - (m.cached_tokens - m.fetched_tokens))
    kept = []
    for name, n in m.tier_tokens:
        taken = min(n, drop)
        drop -= taken
        if n > taken:
            kept.append((name, n - taken))
    return tuple(kept)


def _int32(values: list[int]) -> np.ndarray:
    return np.frombuffer(array("i", values), dtype=np.int32)  # one C loop, as block_ids


def _slots_in_order(
    present: Lease, stored: Lease | None, missing: list[int], n_pages: int
) -> list[int] | None:
    """The host slot of each of a store's `n_pages` pages, in page order, where that is cheap to
    know: the pages the host tier held (`present`, in order) come first and the ones the store
    copied (`stored`, in the order of `missing`) after them, all of them stored. That is a store
    after a prefix hit, or of a sequence wholly new or wholly held. None otherwise (pages
    dropped for want of room, or held pages after new ones): write-behind looks them up."""
    n_present = len(present.slots)
    n_stored = len(stored.slots) if stored is not None else 0
    if n_present + n_stored != n_pages or (missing and missing[0] != n_present):
        return None
    return present.slots + stored.slots if stored is not None else list(present.slots)


def _release(leases: list[Lease]) -> None:
    for lease in leases:
        lease.release()
