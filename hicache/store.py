"""`HiCache.store`: write the engine's new pages through to the host tier, and hand them to the
store tiers' write-behind (`WriteThrough`, whose `store` `hicache.cache.HiCache` offers as its
own; engine thread).

1. the request's keys are extended to the stored tokens (`hicache.core.keys.KeyChain`);
2. the host slot books split them into pages held and pages missing; the held ones are pinned
   so that the sequence's own head is not evicted for its tail (`hicache.core.slots`);
3. the missing pages get fresh host slots and one copy GPU -> host on the engine's stream
   (`_store_pages`; `hicache.kernels`), published in the books at once;
4. with a state layout, the states at the trailing boundaries are saved through the engine's
   hooks (`_store_states`);
5. once the copies complete the pins go, and the chain queues the new groups for the store
   tiers' write-behind with the copy's completion, which the worker waits for
   (`hicache.chain.walk.TierChain.stored` -> `hicache.chain.writes`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hicache.backends.gpu import GpuTier
from hicache.backends.host import HostTier
from hicache.chain.walk import TierChain
from hicache.config import Layout, Policy
from hicache.core import native
from hicache.core.keys import as_tokens
from hicache.core.slots import Lease
from hicache.errors import StateHookError
from hicache.kernels import PoolRoutes
from hicache.kernels.completions import Transfers
from hicache.match import Matcher
from hicache.observability.events import EventSink, emit
from hicache.observability.stats import Stats


class WriteThrough:
    """Answers `store`: copies a request's new pages GPU -> host and hands them to the store
    tiers' write-behind.

    Takes what it uses: the policy and page layout, the engine's GPU pool and the host tier, the
    walk down the store tiers (None without store tiers), the engine's state hooks (None without
    a state layout), the event sink (None: none), the stats, the copies on the engine's stream
    and the routes they take, and the `Matcher` whose request table `store` extends (a request
    never matched is opened there)."""

    def __init__(
        self,
        policy: Policy,
        layout: Layout,
        gpu: GpuTier,
        host: HostTier,
        chain: TierChain | None,
        hooks: Any,
        events: EventSink | None,
        stats: Stats,
        transfers: Transfers,
        routes: PoolRoutes,
        matcher: Matcher,
    ) -> None:
        self.policy = policy
        self.layout = layout
        self.gpu = gpu
        self.host = host
        self._chain = chain
        self._hooks = hooks
        self._events = events
        self._stats = stats
        self._transfers = transfers
        self._routes = routes
        self._requests = matcher.requests
        self._open = matcher.request

    def store(
        self,
        request_id: str,
        tokens: Any,
        block_ids: Sequence[int],
        state_slot: int | None = None,
        *,
        salt: str | bytes | None = None,
        tail: bool = True,
    ) -> int:
        """Write through: copy the full pages of `tokens` that the host tier lacks, GPU -> host.

        `tokens` are the tokens whose KV the engine holds in `block_ids` (page i in
        ``block_ids[i]``): the prompt after its prefill, or prompt + output[:-1] at the end of a
        request. They must extend what the request matched. With a state layout, the states at
        the last `policy.state_boundaries` page boundaries that the engine can still produce are
        saved from `state_slot` too. Returns the number of pages copied. When the host tier is
        full of pinned pages, the leading pages that fit are stored and the rest are counted as
        dropped. `salt` is used only for a request that was never matched. `tail`: the pages
        past the last whole page group of each store tier go there too, as one shorter object
        (`hicache.core.span`): right for a store that ends where a later request may end (a
        prompt, a request's answer); pass False for a store that a later one of the same
        request extends (vLLM's store as each page fills), whose tail would be written for
        nothing.
        """
        if self.policy.write_policy == "read_only":
            return 0
        tokens = as_tokens(tokens)
        n_pages = tokens.shape[0] // self.layout.page_tokens
        if not self.host.ready:  # the pools are still being allocated: nothing to store into
            self._stats.pages_dropped += n_pages
            return 0
        req = self._requests.get(request_id)
        if req is None:
            req = self._open(request_id, tokens, salt)
        elif not req.chain.try_extend(tokens):
            raise ValueError(
                "tokens must extend the request's earlier tokens (the prompt given to match)"
            )
        what = f"store of request {request_id!r}"
        ids = self.gpu.block_ids(block_ids, n_pages, what)
        if self._hooks is not None and state_slot is None and n_pages:
            raise ValueError(f"{what}: the layout has states, give state_slot")
        keys = req.chain.hash_to(n_pages)[:n_pages]
        pool = self.host.page_slots
        present, missing = pool.split(keys)
        pins = pool.lease(present)  # the sequence's own pages must not be evicted for its tail
        try:
            copied = self._store_pages(keys, ids, missing, pins, req.chain.seed)
        except BaseException:
            pins.release()
            raise
        states = None
        try:
            if self._hooks is not None and n_pages:
                states = self._store_states(keys, tokens.shape[0], state_slot)
        finally:
            # `pins` holds the held pages, then the new ones: a lease unpins from its last slot
            # to its first, so the sequence's head ends up most recent and its tail goes first.
            unpin = pins.release if states is None else lambda: (pins.release(), states.release())
            done = self._transfers.then(unpin)  # once the copies have completed
            if self._chain is not None:
                # the host slot of each page, where `pins` has them in page order (every page
                # held or copied, the copied ones the tail); else write-behind looks them up
                in_order = not missing or missing[0] == n_pages - len(missing)
                slots = pins.slots if in_order and len(pins.slots) == n_pages else None
                self._chain.stored(keys, done, slots, tail, req.chain.seed)
        return copied

    def _store_pages(
        self, keys: list[bytes], ids: np.ndarray, missing: list[int], pins: Lease, seed: bytes
    ) -> int:
        """Copy the `missing` pages into fresh host slots, which `pins` takes (at its end), for
        the tenant of chain seed `seed`. Returns how many were copied."""
        if not missing:
            return 0
        pool = self.host.page_slots
        lease = pool.reserve_as(len(missing), seed)
        if len(lease.slots) < len(missing):
            self._stats.pages_dropped += len(missing) - len(lease.slots)
            missing = missing[: len(lease.slots)]
        if not missing:
            lease.release()
            return 0
        try:
            latency = self._stats.latency["hicache_store_copy_seconds"]
            src_ids = ids if len(missing) == len(ids) else native.gather_int32(ids, missing)
            slots = native.align_slots(src_ids, lease.slots)  # runs of blocks: one row
            lease.slots = slots.tolist()
            dst_ids = np.frombuffer(slots, dtype=np.int32)
            self._transfers.copy(self._routes.to_host, src_ids, dst_ids, latency)
        except BaseException:
            lease.release()
            raise
        new_keys = keys if len(missing) == len(keys) else [keys[i] for i in missing]
        fresh = pool.publish_as(lease.slots, new_keys, seed)
        if self._events is not None:
            emit(self._events, "stored", "host", pool.keys_of(fresh))
        self._stats.pages_stored += len(missing)
        pins.absorb(lease)
        return len(missing)

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
        wanted = wanted[: len(lease.slots)]
        try:
            for pages, slot in zip(wanted, lease.slots):
                call_hook(hooks, self._stats, self.host, "save_state", state_slot, pages * P, slot)
        except BaseException:
            lease.release()
            raise
        self.host.state_slots.publish(lease.slots, [keys[p - 1] for p in wanted])
        self._stats.states_stored += len(wanted)
        return lease


def call_hook(
    hooks: Any,
    stats: Stats,
    host: HostTier,
    name: str,
    state_slot: int | None,
    boundary: int,
    host_slot: int,
) -> None:
    """Call the engine's state hook `name` (save_state / load_state) on the host state slot
    `host_slot`; an exception it raises is counted and raised as a `StateHookError`."""
    try:
        getattr(hooks, name)(state_slot, boundary, host.state(host_slot))
    except Exception as err:
        stats.hook_errors += 1
        raise StateHookError(
            f"state hook {name}(slot={state_slot}, boundary={boundary}) raised "
            f"{type(err).__name__}: {err}"
        ) from err
