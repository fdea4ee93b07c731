"""The tier chain: the store tiers below the host, walked in the order of `tiers:`.

`match` takes the host tier's prefix, then asks the first store tier (one batched call, on that
tier's worker thread) for the page groups after it. When that tier's part of the walk is done
(its `StoreLink`'s `on_done`, on the engine thread) and it fell short of the request's cap, the next
tier is asked for the pages after what has arrived, and so on down the chain: each tier only for
the pages the tiers above it lack. Every tier's pages are published in the host tier as they
arrive (promoted), so the answer is the host walk over them: the longest prefix of page groups
(and, for state layouts, the deepest usable state). Pages a lower tier brought are also put
behind to the store tiers above it whose `write:` is `behind`.

A tier that cannot be asked (not connected, breaker open, busy, slower than recompute, or its
books say it lacks the first group) is passed over: the walk goes on below it, from the same
page. A tier whose call fails ends its part with nothing, and the walk goes on below it too.
The whole walk shares one deadline (`policy.fetch_max_wait_ms`).

Writes go down the chain per tier (`StoreTierConfig.write`): `behind` (every group `store`
copies to the host is put soon after), `on_evict` (put when the host is about to evict it) or
`off`. Engine thread only, except where a method says otherwise.

A tier may be attached and detached while requests run (`attach`, `detach`). A detached tier
is asked nothing more; its jobs in flight finish on its workers and their results are applied
as they come (a fetch's pages that arrived are the request's, a put's slots are released), and
once it holds none it is closed: its workers end, its store closes, its reserve of host slots
is freed. A fetch of a detached tier ends the walk where it ended.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from hicache import threads
from hicache.backends import codec as codecs
from hicache.backends.base import StoreTier
from hicache.backends.crypt import Keyring
from hicache.backends.host import HostTier
from hicache.chain.fetch import Fetch
from hicache.chain.link import LinkSettings, StoreLink
from hicache.config import Layout, Policy, StoreTierConfig, TenantConfig, tier_name
from hicache.core.cost import Rate
from hicache.core.keys import KeyChain
from hicache.core.marks import mark
from hicache.core.plan import PrefillSpeed, plan_fetch
from hicache.core.shares import owners, store_terms
from hicache.errors import TierStartError
from hicache.kernels.completions import Completion
from hicache.observability.events import EventSink
from hicache.observability.stats import Stats
from hicache.registry import tier_class


class TierChain:
    """The `StoreLink`s of the store tiers below the host, in walk order."""

    def __init__(
        self,
        configs: list[StoreTierConfig],
        host: HostTier,
        layout: Layout,
        fingerprint: bytes,
        policy: Policy,
        stats: Stats,
        events: EventSink | None = None,
        wake: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        *,
        fence: Callable[[], Completion],
        keyring: Keyring | None = None,
        tenants: Sequence[TenantConfig] = (),
    ) -> None:
        """`configs`: the configuration's tiers after the host tier (``tiers.1`` on), each
        started here; a TierStartError names its tier after the tiers started before it are
        closed. `fence`: a completion of every copy enqueued so far on the engine's stream
        (`hicache.kernels.completions.Transfers.fence`); every put waits for one made when it
        was queued. `keyring`: the encrypted tenants' keys, for every store tier. `tenants`:
        whose objects are named under their tenant's name, and the terms each store tier keeps
        for them."""
        self.policy = policy
        self.layout = layout
        self.clock = clock
        self.prefill = Rate(policy.prefill_tokens_per_s)
        """The engine's prefill speed (tokens/s), shared by every tier's cost model."""
        self._stats = stats
        self.links: list[StoreLink] = []
        self._close_timeouts: list[float] = []
        self._detached: list[StoreLink] = []
        """Detached links whose jobs have not all returned (closed once they have)."""
        self._make = (host, layout, fingerprint, policy, events, wake, clock, fence, keyring)
        self._tenants = tuple(tenants)
        self._owners = owners(tenants, fingerprint)
        for i, cfg in enumerate(configs):
            try:
                link = self._link(cfg)
            except TierStartError as err:
                err.tier = i + 1  # configs are the configuration's tiers after the host
                self.close()  # the tiers started before it
                raise
            self.links.append(link)
            self._close_timeouts.append(cfg.close_timeout_s)
            stats.tiers[link.name] = link.stats
        self._relink()

    def _link(self, cfg: StoreTierConfig) -> StoreLink:
        """Start the store tier of `cfg` and its link (TierStartError where it cannot)."""
        host, layout, fingerprint, policy, events, wake, clock, fence, keyring = self._make
        store: StoreTier = tier_class(cfg.type)(cfg)
        terms = store_terms(self._tenants, tier_name(cfg))
        if terms:  # the configuration allows them only on a tier that keeps them
            store.set_terms(terms)
        cpus = frozenset(cfg.worker_cpus)
        settings = LinkSettings(
            name=tier_name(cfg),
            group_pages=cfg.group_pages,
            key_prefix=store.object_prefix(cfg.key_prefix, cfg.codec),
            queue_depth=cfg.write_queue_depth,
            fetch_depth=cfg.fetch_queue_depth,
            fetch_workers=cfg.fetch_workers or threads.fetch_workers(cpus),
            reserve_pages=cfg.fetch_reserve // layout.page_size,
            worker_cpus=cpus,
            write=cfg.write,
            read_gbps=cfg.read_gbps or store.read_gbps,
            breaker_failures=cfg.breaker_failures,
            breaker_reprobe_s=cfg.breaker_reprobe_s,
            codec=codecs.for_dtype(layout.kv_dtype) if cfg.codec == "lossless" else None,
            codec_threads=cfg.codec_threads,
            keyring=keyring,
            owners=self._owners,
        )
        return StoreLink(
            store, settings, host, layout, fingerprint, policy, self.prefill,
            clock=clock, events=events, wake=wake, on_done=self._walk_on, fence=fence,
        )  # fmt: skip

    def _relink(self) -> None:
        """The books kept over `links`, made again after the links changed."""
        self._index = {id(link.fetcher): i for i, link in enumerate(self.links)}
        self._write_back = [link for link in self.links if link.settings.write == "on_evict"]
        self._behind = [link for link in self.links if link.settings.write == "behind"]
        self._off = any(link.settings.write == "off" for link in self.links)
        self.group_pages = sorted({link.G for link in self.links})
        """The group sizes of the tiers (a state at a group end of each can be fetched)."""

    # -- attach and detach ------------------------------------------------------------------------

    def attach(self, cfg: StoreTierConfig, at: int | None = None) -> StoreLink:
        """Start the store tier of `cfg` and put it in the walk at position `at` (None: last),
        between two engine steps. ValueError where a tier of its name is attached (or still
        detaching); TierStartError where it cannot start (nothing changes)."""
        name = tier_name(cfg)
        if any(link.name == name for link in (*self.links, *self._detached)):
            raise ValueError(f"attach: a tier named {name!r} is attached already")
        if at is not None and not 0 <= at <= len(self.links):
            raise ValueError(f"attach: position {at} is not one of 0..{len(self.links)}")
        link = self._link(cfg)
        at = len(self.links) if at is None else at
        self.links.insert(at, link)
        self._close_timeouts.insert(at, cfg.close_timeout_s)
        self._stats.tiers[name] = link.stats
        self._relink()
        mark("tier.attached")
        return link

    def detach(self, name: str) -> StoreLink:
        """Take the tier `name` out of the walk and the writes, between two engine steps: it is
        asked nothing more, its jobs in flight finish (their results applied by `poll` and
        `apply`), and it is closed once none is left (`retire`). ValueError where no tier of
        that name is attached."""
        at = next((i for i, link in enumerate(self.links) if link.name == name), None)
        if at is None:
            names = [link.name for link in self.links]
            raise ValueError(f"detach: no tier named {name!r} is attached (attached: {names})")
        link = self.links.pop(at)
        self._close_timeouts.pop(at)
        self._relink()
        if link.writer.dirty:  # write: on_evict groups it was never given: lost to it
            link.stats.evict_lost += len(link.writer.dirty)
            link.writer.dirty.clear()
        self._detached.append(link)
        mark("tier.detached")
        self.retire()
        return link

    def retire(self) -> bool:
        """Apply what the detached tiers' workers posted, and close each that has no job left
        (its workers end, its store closes, its reserve of host slots is freed). True where
        none is left to close."""
        for link in list(self._detached):
            link.apply()
            if link.idle:
                link.close()
                self._detached.remove(link)
        return not self._detached

    # -- fetch ------------------------------------------------------------------------------------

    def start(
        self,
        chain: KeyChain,
        host_pages: int,
        max_pages: int,
        after: int = 0,
        deadline: float | None = None,
        planned: bool = False,
    ) -> Fetch | None:
        """Begin the walk at tier `after`: the first tier from there that takes the fetch of
        the groups after `host_pages` (up to `max_pages`). None when none does. `planned`: a
        partial fetch (see `plan`), asked of a tier however its speed compares to recompute."""
        for link in self.links[after:]:
            fetch = link.fetcher.start(chain, host_pages, max_pages, deadline, planned)
            if fetch is not None:
                return fetch
        return None

    def plan(self, first: int, host_pages: int, max_pages: int) -> tuple[int, float]:
        """A partial fetch of a hit capped at `max_pages` pages, of which the engine holds
        `first` and the host tier the pages up to `host_pages`: the page k (a group start of
        the first tier) from which the tiers are asked, so that the engine's prefill of
        [first, k) and the first tier's read of [k, max_pages) end together (`plan_fetch`, with
        the learned read rate and prefill speed), and the seconds the read is expected to take.
        (0, 0.0) where k would not pass the host hit (the host part is fast: fetch as usual) or
        would leave nothing to fetch."""
        if not self.links:
            return 0, 0.0
        link, P = self.links[0], self.layout.page_tokens
        plan = plan_fetch(
            max_pages * P,
            page_tokens=P,
            page_bytes=self.layout.page_size,
            read_bytes_per_s=link.read.per_s,
            prefill=PrefillSpeed(self.prefill.per_s),
            computed_tokens=first * P,
        )
        k = plan.head_tokens // P // link.G * link.G
        if not host_pages < k < max_pages:
            return 0, 0.0
        return k, (max_pages - k) * self.layout.page_size / link.read.per_s

    def _walk_on(self, fetch: Fetch) -> None:
        """A tier's part of a walk is over (its phase becomes done here): put what it brought
        behind to the tiers above it, and ask the tiers below it for what is still missing."""
        fetch.phase = "done"
        i = self._index.get(id(fetch.source))
        if fetch.abandoned or i is None:  # gone, or of a detached tier: the walk ends here
            return
        lo, hi = fetch.pages
        if hi > lo:
            adopt_keys(fetch.chain, fetch)
            self._promote(fetch.chain.hashed[:hi], i, fetch.chain.seed)
        reached = max(fetch.host_pages, hi)
        if i + 1 < len(self.links) and reached < fetch.max_pages and self.clock() < fetch.deadline:
            adopt_keys(fetch.chain, fetch)
            fetch.next = self.start(fetch.chain, reached, fetch.max_pages, i + 1, fetch.deadline)

    def _promote(self, keys: list[bytes], below: int, seed: bytes) -> None:
        """Put the groups of `keys` (in the host tier now; of a request whose chain seed is
        `seed`) to the write-behind tiers above tier `below`."""
        for link in self._behind:
            if self._index[id(link.fetcher)] < below:
                n = len(keys)
                states = range(link.G, n + 1, link.G)
                link.writer.write_behind(keys, n, states, tail=True, seed=seed)

    def waiting(self, fetch: Fetch) -> bool:
        """True while the request should wait for its walk (policy 'wait', before the walk's
        deadline). Past it the walk is abandoned (its results still arrive and free their
        slots) and the tier whose part was running counts a timeout."""
        if self.policy.fetch_pending != "wait" or not fetch.busy:
            return False
        if self.clock() <= fetch.deadline:
            return True
        mark("fetch.deadline-missed")
        for part in fetch.parts():
            if part.phase != "done" and not part.abandoned:
                part.source.stats.timeouts += 1
            part.abandoned = True
        return False

    def forget(self, fetch: Fetch) -> None:
        """The request is gone: drop its walk. A part that is done releases its slots now; a
        running one still finishes into its slots, which its result then releases."""
        for part in fetch.parts():
            part.abandoned = True
            if part.phase == "done":
                part.release()
            elif part.phase == "get":
                mark("fetch.forgotten-while-getting")

    def apply(self) -> bool:
        """Apply what every tier's workers have posted; True if a fetch finished."""
        fetched = False
        for link in (*self.links, *self._detached):
            fetched = link.apply() or fetched
        return fetched

    # -- writes -----------------------------------------------------------------------------------

    def stored(
        self,
        keys: list[bytes],
        ready: Completion,
        slots: list[int] | None = None,
        tail: bool = True,
        seed: bytes = b"",
    ) -> None:
        """`store` copied `keys` (a sequence from its first page) to the host tier: hand them
        to every tier as its `write:` says (with `tail`, the pages past the last whole group
        too, to the `write: behind` tiers). `ready`: a fence made after the host copy (what
        `Transfers.then` returned for it). `seed`: the request's chain seed (its tenant's)."""
        n = len(keys)
        if self._off:
            mark("write.off")
        for link in self._behind:
            states = range(link.G, n + 1, link.G)
            link.writer.write_behind(keys, n, states, ready, slots, tail, seed)
        for link in self._write_back:
            link.writer.note_dirty(keys, n, seed)

    def evicted(self, keys: list[bytes]) -> None:
        """The host tier evicted `keys` (its eviction hook)."""
        for link in self._write_back:
            link.writer.evicted(keys)

    # -- housekeeping -----------------------------------------------------------------------------

    def poll(self) -> None:
        for link in self.links:
            link.poll()
        if self._detached:
            self.retire()

    def report_prefill(self, tokens: int, seconds: float) -> None:
        """The engine computed `tokens` in `seconds`: fold it into the prefill speed."""
        self.prefill.observe(tokens, seconds)
        self._stats.prefill_tokens_per_s = int(self.prefill.per_s)

    def usable(self) -> bool:
        """Every tier answers (for `wait_ready`)."""
        return all(link.usable() for link in self.links)

    @property
    def idle(self) -> bool:
        """No job is queued or running in any tier, and no detached tier is left to close."""
        return all(link.idle for link in self.links) and not self._detached

    def gauges(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for link in self.links:
            out.update(link.gauges())
        return out

    def close(self) -> None:
        """Drain the writes of the persistent tiers (each for at most its `close_timeout_s`),
        then stop every tier's workers and close its store. Blocks."""
        for link, timeout in zip(self.links, self._close_timeouts):
            if link.store.persistent and link.usable():
                link.drain(timeout)
        for link in (*self.links, *self._detached):
            link.close()
        self._detached.clear()


def adopt_keys(chain: KeyChain, fetch: Fetch) -> None:
    """Take the keys a fetch's worker hashed into the request's chain, so that the walk over
    the fetched pages looks them up instead of hashing them again. They chain from the key
    before the fetch's first page, which the chain had hashed when the fetch began."""
    have, first = len(chain.hashed), fetch.first_page
    if first <= have < first + len(fetch.keys):
        chain.append(fetch.keys[have - first :])
