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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol

import numpy as np
import torch

from hicache import threads
from hicache.backends import crypt
from hicache.backends.base import StoreTier
from hicache.backends.gpu import GpuTier
from hicache.backends.host import HostTier, HostTierConfig
from hicache.chain.walk import TierChain
from hicache.config import (
    HiCacheConfig,
    Layout,
    StoreTierConfig,
    TierConfig,
    tier_name,
    tier_section,
)
from hicache.core import native
from hicache.core.keys import PrefixMemo, fingerprint
from hicache.core.request import Match
from hicache.core.shares import host_shares
from hicache.errors import ConfigError, TierStartError
from hicache.kernels import PagedBuffer, PoolRoutes, prepare
from hicache.kernels.completions import DONE, Completion, Transfers
from hicache.match import Matcher, Request
from hicache.observability.events import EventSink, emit
from hicache.observability.stats import Stats
from hicache.store import WriteThrough, call_hook


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
    engine's state hooks, required when the layout has state_bytes; `stream` is the CUDA stream of
    the engine's model kernels (default: the current stream at each call); `events` receives a
    `KVEvent` whenever a tier stores or removes pages (see `hicache.observability.events`); `wake`
    is called from a store tier's worker thread whenever it has posted a result for `poll` or
    `match` to apply (an engine whose loop sleeps while requests wait on a fetch sets an event or
    writes an eventfd there; it must be thread-safe and return at once). `layers` is the number of
    KV layers a page holds, for loads layer by layer (`load(..., by_layer=True)`; 0: none): the
    pool's segments split into that many equal runs, or a page-first pool's rows into that many
    equal column ranges.

    On CUDA the constructor builds (the first time on a machine, about 20 s, then cached) and
    loads the page-copy extension, so that no copy on the engine thread pays for it.

    The parts that answer the engine's calls take what they use in their constructors: a
    `Matcher` (`hicache.match`) answers `match` and `release` and keeps the requests, a
    `WriteThrough` (`hicache.store`) answers `store`; `HiCache` offers their methods as its own
    (bound at construction: no call in between) and answers `load` and `poll` itself.
    """

    match: Callable[..., Match]
    """`hicache.match.Matcher.match`: how many leading tokens of a prompt the engine may skip."""
    store: Callable[..., int]
    """`hicache.store.WriteThrough.store`: write a request's pages through to the host tier."""
    release: Callable[[str], None]
    """`hicache.match.Matcher.release`: forget a request and drop what its match pinned."""

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
        try:  # the tenants' keys, loaded before any thread or pool is made
            keyring = crypt.keyring(config.tenants, fingerprint(layout))
        except ConfigError as err:
            raise _in_file(config, err) from None
        self.config = config
        self.layout = layout
        self.policy = config.policy
        self.fingerprint = fingerprint(layout)
        self.gpu = GpuTier(gpu, layout)
        self.layers = layers
        if layers:
            gpu.by_layer(layers)  # ValueError now, on the caller's thread, if they do not fit
        host_config = config.tiers[0]  # HiCacheConfig guarantees the first tier is the host tier
        if not isinstance(host_config, HostTierConfig):
            raise TypeError(f"tiers[0] must be a HostTierConfig, got {type(host_config).__name__}")
        self._stats = Stats(prefill_tokens_per_s=int(self.policy.prefill_tokens_per_s))
        self._events = events
        prepare(self.gpu.device)  # on CUDA: build/load the copy extension now, not at a copy
        native.available()  # load the compiled helpers now, not in the first store
        self._routes = PoolRoutes()  # filled by the host tier's allocating thread
        # the pool counts evictions anyway; the hook runs for an event sink or a write-back tier
        writes_back = any(c.write == "on_evict" for c in store_configs)
        evicted = self._evicted if events is not None or writes_back else None
        try:
            slots = host_config.size // layout.page_size
            shares = host_shares(config.tenants, self.fingerprint, layout.page_size, slots)
            self.host = HostTier(host_config, layout, evicted, self._prepare_copies, shares)
        except TierStartError as err:
            err.tier = 0
            raise _in_file(config, err) from None
        self._hooks = states if layout.state_bytes else None
        self._transfers = Transfers(self.gpu.device, stream)
        memo = self.policy.prefix_memo
        self._memo = PrefixMemo(layout.page_tokens, memo) if memo else None
        self._chain: TierChain | None = None
        self._evict_hook = evicted is not None
        self._new_chain = lambda configs: TierChain(
            configs, self.host, layout, self.fingerprint, self.policy,
            self._stats, events, wake, fence=self._transfers.fence, keyring=keyring,
            tenants=config.tenants,
        )  # fmt: skip
        if store_configs:
            try:
                self._chain = self._new_chain(store_configs)
            except TierStartError as err:
                self.host.close()
                raise _in_file(config, err) from None
        self._matcher = Matcher(
            layout, self.policy, self.host, self._chain, self._hooks, self._stats,
            self.fingerprint, self._memo,
        )  # fmt: skip
        self._requests: dict[str, Request] = self._matcher.requests
        self.match = self._matcher.match
        self.release = self._matcher.release
        self._writer = WriteThrough(
            self.policy, layout, self.gpu, self.host, self._chain, self._hooks, events,
            self._stats, self._transfers, self._routes, self._matcher,
        )  # fmt: skip
        self.store = self._writer.store
        self.metrics_server = None
        if config.metrics.port is not None:
            from hicache.observability.metrics import register, serve

            registry, _ = register(self)
            try:
                self.metrics_server = serve(registry, config.metrics.port, config.metrics.addr)
            except OSError as err:
                self.close()
                at = f"{config.metrics.addr}:{config.metrics.port}"
                why = f"cannot serve at {at}: {err.strerror}" if err.strerror else str(err)
                start = ConfigError(f"metrics.port: {why}")
                raise _in_file(config, start) from None

    def _prepare_copies(self, host: HostTier) -> None:
        """The copy routes between the GPU pool and the host slots (cut into the pool's
        segments), checked once. Run by the host tier's allocating thread, before it is ready:
        the engine thread never builds them."""
        self._routes.build(self.gpu.pages, host.pages, self.layers)

    def _evicted(self, keys: list[bytes]) -> None:
        emit(self._events, "removed", "host", keys)
        if self._chain is not None:
            self._chain.evicted(keys)

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
        skip = 0 if from_token is None else self._skipped_pages(match, from_token, what)
        P = self.layout.page_tokens
        head = (match.head_tokens - match.computed_tokens) // P if match.head_tokens else 0
        if skip < head:  # the pages before the head were never fetched
            raise ValueError(
                f"{what}: a partial fetch, give from_token >= head_tokens={match.head_tokens}"
            )
        if match.load_pages == 0:
            req.drop_pins()
            return DONE
        pages, state = req.pages, req.state  # pages: a hit of load_pages > 0 has them
        req.pages = req.state = req.match = None
        unpin = pages.release if state is None else lambda: (pages.release(), state.release())
        try:
            if state is not None:
                at, slot = match.hit_tokens, state.slots[0]
                call_hook(self._hooks, self._stats, self.host, "load_state", state_slot, at, slot)
            latency = self._stats.latency["hicache_load_copy_seconds"]
            # the host slots as int32 through one C loop, as block_ids
            slots = np.frombuffer(array("i", pages.slots[skip - head :]), dtype=np.int32)
            if by_layer:
                done = self._transfers.copy_layers(
                    self._routes.layers, slots, ids[skip:], unpin, latency
                )
            else:
                self._transfers.copy(self._routes.to_gpu, slots, ids[skip:], latency)
        except BaseException:
            unpin()
            raise
        self._stats.loaded(_partial(match, skip, P) if skip else match)
        return done if by_layer else self._transfers.then(unpin)

    def _skipped_pages(self, match: Match, from_token: int, what: str) -> int:
        """Pages of the hit that `load` leaves to the engine (see its `from_token`)."""
        low, P = match.computed_tokens, self.layout.page_tokens
        if not low <= from_token <= match.hit_tokens or from_token % P:
            raise ValueError(
                f"{what}: from_token={from_token} must be a multiple of page_tokens={P} in "
                f"[{low}, {match.hit_tokens}]"
            )
        return (from_token - low) // P

    # -- housekeeping ---------------------------------------------------------------------------

    def poll(self) -> None:
        """Retire finished copies, release what they pinned, apply the store tiers' results.
        Never blocks; call it every engine step."""
        self._transfers.poll()
        if self._chain is not None:
            self._chain.poll()
        self.host.page_slots.settle()  # tenants' quotas (nothing without them)

    def report_prefill(self, tokens: int, seconds: float) -> None:
        """The engine prefilled `tokens` in `seconds` (call it after each prefill, or now and
        then): the cost model's prefill speed follows it (a moving average), so that a page is
        fetched from a tier only where reading it beats recomputing it. Never blocks."""
        if self._chain is not None:
            self._chain.report_prefill(tokens, seconds)

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
            **pages.tenant_stats(),
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

    def attach(self, tier: StoreTierConfig | Mapping[str, Any], position: int | None = None) -> str:
        """Add a store tier while requests run (between two engine steps, on the engine
        thread): `tier` is a tier section as `tiers:` takes it (a mapping or its model), put in
        the walk at `position` among the store tiers (None: last). Requests asked from now on
        walk it and store into it once it answers (`wait_ready`; until then it is passed over,
        as a tier that is down); a persistent tier's objects (a disk directory, a Mooncake
        store) are read as they are. Returns its name. ConfigError (one line, naming the field)
        for a bad section; ValueError for a name attached already, a position out of range or
        `write: on_evict` on a cache started without such a tier (its host tier has no eviction
        hook); TierStartError where the tier cannot start. Nothing changes on an error."""
        cfg = tier if isinstance(tier, TierConfig) else tier_section(tier, "attach")
        if not isinstance(cfg, StoreTierConfig):
            raise ValueError(f"attach: a {cfg.type} tier is not a store tier")
        if cfg.write == "on_evict" and not self._evict_hook:
            raise ValueError(
                "attach: a write: on_evict tier needs the host tier's eviction hook, which a "
                "cache gets only where one such tier is configured from the start"
            )
        try:
            cfg.check_layout(self.layout)
        except ValueError as err:
            raise ValueError(f"attach: {err}") from None
        if self._chain is None:  # the first store tier: the chain the API's parts walk
            chain = self._new_chain([])
            chain.attach(cfg, position)
            self._chain = self._matcher._chain = self._writer._chain = chain
        else:
            self._chain.attach(cfg, position)
        return tier_name(cfg)

    def detach(self, name: str, timeout_s: float | None = 0.0) -> bool:
        """Take the store tier `name` out while requests run (between two engine steps, on the
        engine thread): no request asks it or stores into it from now on; its reads and writes
        in flight finish on its workers (a read that arrives is the request's, one that fails a
        miss; a put's slots are released), and once none is left `poll` closes it: its threads
        end, its store closes (a disk tier's files, a Mooncake client), its host slots are
        freed. Its objects stay where they rest: attached again, a persistent tier reads them.
        Waits for that, polling, for at most `timeout_s` (None: for as long as it takes; 0:
        not at all). True where it is closed. ValueError where no tier of that name is
        attached."""
        if self._chain is None:
            raise ValueError(f"detach: no tier named {name!r} is attached (attached: [])")
        self._chain.detach(name)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._chain.retire():
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.002)
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


def _in_file(config: HiCacheConfig, err: ConfigError) -> ConfigError:
    """`err`, which names a field of `config`, naming the file it was read from too."""
    return ConfigError(f"{config.source}: {err}") if config.source else err


def _store_tiers(config: HiCacheConfig) -> list[StoreTierConfig]:
    """The store tiers below the host tier, in walk order, their CPUs checked."""
    stores = []
    for i, tier in enumerate(config.tiers[1:], start=1):
        if not isinstance(tier, StoreTierConfig):
            raise ValueError(f"tiers.{i}: type {tier.type!r} is not a store tier")
        threads.check_cpus(tier.worker_cpus, f"tiers.{i}.worker_cpus")
        stores.append(tier)
    return stores


def _partial(m: Match, skipped: int, page_tokens: int) -> Match:
    """`m` as the load of its pages after the first `skipped` (what the stats count)."""
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
