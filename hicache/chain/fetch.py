"""A store link's fetches: the look-ahead of one request from one store tier, on the engine
thread (`Fetcher`, a part of `hicache.chain.link.StoreLink`).

A fetch is for one request whose prompt runs past the host tier's hit: the pages after the host
hit are hashed, by the engine thread for the first `ENGINE_PREP_PAGES` pages and by the worker
(from the key before them and their tokens) for the rest; the worker names their groups. If the
fetch fits the reserve of free host slots (`Fetcher.refill`), it is one batched
`get_into` those slots, and the leading run that arrives is the hit. Otherwise one batched
`exists` for the groups (and, for state layouts, the states at the group ends), then — on the
engine thread — a choice (the leading run of groups, snapped to a state), fresh host slots
reserved for it, and one batched `get_into`. Pages become visible in the host index only after
their get succeeded, under the keys of the job: a failed transfer is never a hit. The slots stay
pinned by the fetch until the worker has returned, even if the request went away meanwhile, so
no transfer writes into a reused slot.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from queue import SimpleQueue

from hicache.backends.base import StoreTier
from hicache.backends.host import HostTier
from hicache.chain.jobs import Job
from hicache.config import Layout, Policy
from hicache.core.cost import Rate, Verdict
from hicache.core.keys import KeyChain
from hicache.core.marks import mark
from hicache.core.slots import Lease
from hicache.core.span import Span
from hicache.observability.events import EventSink, emit
from hicache.observability.stats import TierStats

ENGINE_PREP_PAGES = 128
"""A fetch's first pages that the engine thread hashes itself, in `match` (~25 µs for 128 pages
on a warm thread): a worker that has just woken runs slowly for its first few hundred µs (4-7
times slower than warm on the machines measured), and the fill waits for the keys. The worker
hashes the pages past these (GIL dropped), so the engine thread's share stays bounded however
long the look-ahead."""


@dataclass
class Fetch:
    """One request's look-ahead from one tier. Engine thread only.

    The chain links the fetches of one request's walk: where a tier's fetch fell short, the
    next tier's fetch (`next`) asks for the pages after it."""

    span: Span
    """The objects the fetch may bring: page groups from group `span.first` on, and a tail."""
    host_pages: int
    """The host hit when the fetch began: the fetch's pages before it (its first group may start
    below it) were host hits already."""
    deadline: float
    started: float
    source: Fetcher
    """The fetches of the tier it reads from (its `name`, its `stats`)."""
    chain: KeyChain
    """The request's keys (the next tier's fetch starts from them)."""
    max_pages: int
    """The cap of the hit: a state layout's fetch ends at a state no deeper than this."""
    phase: str = "probe"  # probe -> get -> done
    abandoned: bool = False
    lease: Lease | None = None
    """Fetched page slots (and reserved ones while the get runs); released when consumed."""
    state_lease: Lease | None = None
    pages: tuple[int, int] = (0, 0)
    """[first, end) pages that arrived: in the host tier now, under this fetch's slots or (a
    page the host tier held already) another slot."""
    fresh: list[int] = field(default_factory=list)
    """The slots this fetch published, in page order (a page the host tier held already is
    not among them)."""
    keys: list[bytes] = field(default_factory=list)
    """Keys of the pages from the first group's first page on (those the worker hashed come
    with its first result)."""
    next: Fetch | None = None
    """The next tier's fetch of the same walk, once this one has finished short."""

    @property
    def first_page(self) -> int:
        """The first page of its first group."""
        return self.span.first_page

    def key_before(self, pages: int) -> bytes:
        """The key of page ``pages - 1`` (a group end inside the fetch)."""
        return self.keys[pages - 1 - self.first_page]

    @property
    def busy(self) -> bool:
        """Some part of the walk (this fetch, or one after it) is not done."""
        fetch: Fetch | None = self
        while fetch is not None:
            if fetch.phase != "done":
                return True
            fetch = fetch.next
        return False

    def parts(self) -> list[Fetch]:
        """This fetch and the ones after it, in walk order."""
        out: list[Fetch] = []
        fetch: Fetch | None = self
        while fetch is not None:
            out.append(fetch)
            fetch = fetch.next
        return out

    def release(self) -> None:
        """Release this fetch's own slots."""
        for lease in (self.lease, self.state_lease):
            if lease is not None:
                lease.release()
        self.lease = self.state_lease = None


class Fetcher:
    """A store link's fetches (engine thread): start a fetch, choose and reserve its run after
    the probe, publish what the get brought, and keep the reserve of free host slots that a
    fetch can get into at once.

    It reads the store tier's capabilities (`shared`, `persistent`, `missing_code`), never
    calls it: its jobs go to the fetch workers' queues `jobs` (one per worker, each job to the
    least busy), and their results come back through `on_probe` / `on_get`, which the link
    calls from its `apply`. `on_done` is called when a fetch's part here is over, and marks
    it done (`phase`; the chain then walks on)."""

    def __init__(
        self,
        name: str,
        store: StoreTier,
        host: HostTier,
        layout: Layout,
        policy: Policy,
        group_pages: int,
        *,
        stats: TierStats,
        events: EventSink | None,
        clock: Callable[[], float],
        read: Rate,
        prefill: Rate,
        held: Held,
        states_held: Held,
        jobs: Sequence[SimpleQueue[Job | None]],
        depth: int,
        reserve_pages: int,
        usable: Callable[[], bool],
        on_done: Callable[[Fetch], None],
    ) -> None:
        """`read`: the tier's read throughput, which the gets teach; `prefill`: the engine's
        prefill speed (both for the cost model). `held`, `states_held`: the groups and states
        the link knows the tier holds (the writes add theirs; a fetch that finds one missing
        forgets it, so that a later store puts it again). `depth`: fetch jobs queued or
        running at most. `reserve_pages`: the reserve's size, at most an eighth of the host
        tier. `usable`: whether the tier can be used now (the link's)."""
        self.name = name
        self.store = store
        self.host = host
        self.layout = layout
        self.policy = policy
        self.G = group_pages
        self.stats = stats
        self.events = events
        self.clock = clock
        self.read = read
        self._verdict = Verdict(read, prefill, layout.page_size, layout.page_tokens)
        self._trusted_books = not (store.shared or store.persistent)
        """Nobody else writes this tier and it starts empty: a group the link never put there
        is a miss without asking."""
        self._held = held
        self._states_held = states_held
        self._jobs = jobs
        self.load = [0] * len(jobs)
        """Per fetch worker: jobs queued or running (together at most `depth`)."""
        self._depth = depth
        self.usable = usable
        self.on_done = on_done
        self.reserve: Lease = host.page_slots.lease([])
        """Free host slots (reserved, pinned) that a fetch can get into at once, skipping the
        probe; topped up by `refill`."""
        self._reserve_size = min(reserve_pages, host.page_slots.capacity // 8)
        """The slots the reserve holds when no get is out: `reserve_pages`, at most an eighth of
        the host tier."""
        self._lent = 0  # reserve slots that unprobed gets are reading into now

    def start(
        self,
        chain: KeyChain,
        host_pages: int,
        max_pages: int,
        deadline: float | None = None,
        planned: bool = False,
    ) -> Fetch | None:
        """Begin a fetch of the objects after `host_pages` of `chain`, up to `max_pages` pages
        (`hicache.core.span.Span`: whole groups, then the chain's tail).

        `chain` has hashed at least `host_pages` pages; the worker hashes the rest it needs.
        `deadline`: when a waiting request gives up (default: `policy.fetch_max_wait_ms` from
        now). Returns None when no object lies in that range, the tier is not available or
        busy, or fetching is slower than recomputing (see `hicache.core.cost`; not asked for a
        `planned` partial fetch, whose plan weighed the tier's speed already).
        """
        G = self.G
        span = Span.of(host_pages, max_pages, chain.pages, G, tails=not self.layout.state_bytes)
        if not span.objects:
            return None
        if not self.usable():
            self.stats.skipped_down += 1
            return None
        if sum(self.load) >= self._depth:
            self.stats.skipped_busy += 1
            return None
        if not planned and not self._verdict.worth():
            self.stats.skipped_slow += 1
            return None
        if self._trusted_books:
            end = span.first_page + span.pages_of(1)
            chain.hash_to(end)
            if chain.hashed[end - 1] not in self._held:
                self.stats.skipped_unheld += 1
                return None
        now = self.clock()
        deadline = now + self.policy.fetch_max_wait_ms / 1e3 if deadline is None else deadline
        fetch = Fetch(span, host_pages, deadline, now, self, chain, max_pages)
        self.stats.fetches += 1
        pages = span.pages_of(span.objects)
        job = Job("probe", fetch=fetch, started=now, tail=span.tail, seed=chain.seed)
        if (
            not self.layout.state_bytes  # a state's boundary decides the run: probe first
            and self.store.missing_code is not None  # a miss told from a failure
            and len(self.reserve.slots) >= pages
        ):
            # One call: get every group into reserved slots; the leading run that arrives is the
            # hit (a missing object reads as a miss). No exists, no second trip to this thread.
            fetch.lease, fetch.phase = self.reserve.split(pages), "get"
            fetch.lease.slots.sort()  # runs of slots in order: a group in a run is one piece
            self._lent += pages
            job.kind, job.groups, job.unprobed = "get", span.objects, True
            job.page_slots = fetch.lease.slots
        # The first ENGINE_PREP_PAGES pages are hashed here; the worker hashes the rest.
        begin = span.first_page
        end = begin + pages
        own = min(end, begin + ENGINE_PREP_PAGES)
        chain.hash_to(own)
        job.page_keys = fetch.keys = chain.hashed[begin:own]
        if own < end:
            # a view, no copy: the chain's tokens are its own and never changed in place
            P = chain.page_tokens
            job.hash_from = (job.page_keys[-1], chain.tokens[own * P : end * P])
        self._submit_fetch(job)
        return fetch

    def on_probe(self, job: Job, present: list[bool] | None) -> None:
        """A probe returned: `present` one per object (groups, then states), or None for a
        failed call. Reserve host slots for the leading run the tier holds and queue its get."""
        self.load[job.worker] -= 1
        fetch = job.fetch
        span = fetch.span
        n_groups = span.objects
        if present is not None:  # what the tier lacks, the link no longer takes as held
            self._forget_missing(job.ends, present[:n_groups], job.state_ends, present[n_groups:])
        if present is None or fetch.abandoned:
            self.on_done(fetch)
            return
        run = 0
        while run < n_groups and present[run]:
            run += 1
        state_here = False  # the run ends where this tier holds a state (the host tier has none)
        if self.layout.state_bytes:
            # snap to the deepest group end with a state somewhere, no deeper than the cap: a
            # state past it (at the prompt's end) could not be used, one a group earlier can
            G = self.G
            run = min(run, (fetch.max_pages - fetch.first_page) // G)
            states = self.host.state_slots
            while run > 0:
                key = fetch.key_before(fetch.first_page + run * G)
                if key in states:
                    break
                if present[n_groups + run - 1]:
                    state_here = True
                    break
                run -= 1
        if run <= 0 or not self.host.ready:
            self.on_done(fetch)
            return
        lease = self.host.page_slots.reserve(span.pages_of(run))
        if len(lease.slots) < span.pages_of(run):  # the whole groups that fit (others are pinned)
            run = min(len(lease.slots) // self.G, span.groups)
            lease.split(len(lease.slots) - run * self.G).release()
        lease.slots.sort()  # runs of slots in order: a group in a run is one piece
        state_lease = None
        if state_here and run:
            state_lease = self.host.state_slots.reserve(1)
            if not state_lease.slots:
                run = 0
        if run == 0:
            lease.release()
            if state_lease is not None:
                state_lease.release()
            self.stats.no_space += 1
            self.on_done(fetch)
            return
        tail = span.tail if run > span.groups else 0
        get = Job(
            "get", job.ends[:run], page_slots=lease.slots, fetch=fetch, groups=run, tail=tail,
            seed=job.seed,
        )  # fmt: skip
        if state_lease is not None:
            get.state_ends = [fetch.key_before(fetch.first_page + run * self.G)]
            get.state_slots = state_lease.slots
        get.started = self.clock()
        fetch.lease, fetch.state_lease, fetch.phase = lease, state_lease, "get"
        self._submit_fetch(get)

    def on_get(self, job: Job, codes: list[int] | None) -> None:
        """A get returned: `codes` one per object (the worker checked), or None for a failed
        call (a miss; the fetch's slots are released)."""
        self.load[job.worker] -= 1
        fetch = job.fetch
        span = fetch.span
        run = job.groups
        if job.unprobed:  # its slots are the fetch's now (or free again): the reserve may refill
            self._lent -= len(job.page_slots)
        # a read counts only where it returned the object's exact size: a tier that answers 0
        # (or a short count) for an object it did not fill must not make a hit
        page_size = self.layout.page_size
        group_bytes, groups = self.G * page_size, span.groups
        ok = 0
        state_ok = (
            fetch.state_lease is not None
            and codes is not None
            and codes[-1] == self.layout.state_bytes
        )
        if codes is not None:
            whole = [
                code == (group_bytes if i < groups else span.tail * page_size)
                for i, code in enumerate(codes[:run])
            ]
            while ok < run and whole[ok]:
                ok += 1
            if ok < run and not (job.unprobed and codes[ok] == self.store.missing_code):
                self.stats.get_failed += run - ok
            states = [state_ok] if fetch.state_lease is not None else []
            self._forget_missing(job.ends[:run], whole, job.state_ends, states)
            mark("store.get.keys-back", sum(whole) + state_ok)
        mark("store.get.keys", len(job.ends) + len(job.state_ends))
        if 0 < ok < run:
            mark("store.get.partial")
        if state_ok and ok < run:
            mark("fetch.middle-lost-state-present")
        if fetch.state_lease is not None and not (state_ok and ok == run):
            # the state is the whole run's end: without it, or with a group before it missing,
            # the run can't be resumed from (and the state is no other boundary's)
            ok = 0
        pages = span.pages_of(ok)
        if job.unprobed:  # the slots nothing was read into go back where they came from
            self._take_back(fetch.lease, pages)  # type: ignore[arg-type]
        first_page = fetch.first_page
        if ok:
            got = fetch.keys[:pages]
            fresh = fetch.fresh = self.host.page_slots.publish_as(
                fetch.lease.slots[:pages], got, fetch.chain.seed
            )
            if self.events is not None:
                emit(self.events, "stored", "host", self.host.page_slots.keys_of(fresh))
            self._held.add_all(job.ends[:ok], self.clock())
            if fetch.state_lease is not None:
                boundary_key = got[-1]
                self.host.state_slots.publish(fetch.state_lease.slots, [boundary_key])
            fetch.pages = (first_page, first_page + pages)
            nbytes = pages * page_size
            self.stats.pages_fetched += pages
            self.stats.get_bytes += nbytes
            self.read.observe(nbytes, job.finished - job.started)
        self.stats.latency["hicache_tier_fetch_seconds"].observe(self.clock() - fetch.started)
        if fetch.abandoned or not ok:
            fetch.release()
        self.on_done(fetch)

    def _forget_missing(
        self,
        ends: Sequence[bytes],
        found: Sequence[bool],
        state_ends: Sequence[bytes],
        states_found: Sequence[bool],
    ) -> None:
        """A call found the groups `ends` (and the states `state_ends`) where `found` (and
        `states_found`) is true: the others the tier lacks (or does not give whole), so they
        are no longer taken as held, and a later store puts them again."""
        for held, keys, flags in (
            (self._held, ends, found),
            (self._states_held, state_ends, states_found),
        ):
            for key, here in zip(keys, flags):
                if not here and key in held:
                    mark("store.forgot-missing")
                    held.discard(key)

    def _submit_fetch(self, job: Job) -> None:
        """Queue a fetch job for the least busy fetch worker (the first of equals)."""
        load = self.load
        job.worker = load.index(min(load))
        load[job.worker] += 1
        self._jobs[job.worker].put(job)

    def refill(self, after_fetch: bool = False) -> None:
        """Top the reserve up to its size, less the slots lent to running gets (evicting if
        needed). `after_fetch`: a poll that has just finished a fetch refills only while the
        reserve holds less than half its size: the request that fetch answers is matched right
        after this poll, and should not wait for slots that a later fetch needs."""
        have = len(self.reserve.slots)
        if (after_fetch and 2 * have >= self._reserve_size) or not self.host.ready:
            return
        short = self._reserve_size - self._lent - have
        if short > 0:
            self.reserve.absorb(self.host.page_slots.reserve(short))

    def _take_back(self, lease: Lease, keep: int) -> None:
        """A get into slots lent by the reserve has read `keep` pages: the lease's other slots
        (reserved, never published) return to the reserve, as far as it has room, and the rest
        to the free list. A fetch of objects the store does not hold leaves nothing to refill,
        so misses cost the engine thread no evictions and no refill."""
        spare = lease.split(len(lease.slots) - keep)
        room = max(0, self._reserve_size - self._lent - len(self.reserve.slots))
        if len(spare.slots) > room:
            spare.split(len(spare.slots) - room).release()
        self.reserve.absorb(spare)


HELD_TRUST_S = 30.0
"""How long a store link takes its own word that a tier holds an object it put or fetched
there. A tier may drop an object at any time (its own LRU, Mooncake's eviction, a remove)
without telling the link: past this, the next store that has the object's pages offers it
again (a tier that still holds it answers that put cheaply, without writing), and a fetch that
finds it missing forgets it at once. A tier that is neither shared nor persistent is taken at
the link's word for ever (only this link writes it)."""


class Held(OrderedDict[bytes, float]):
    """The object keys a store tier holds or is receiving, as far as its link knows, each with
    the time the link last learned it (put it, or read it whole): the most recent `cap` (an LRU
    set; `in` is the dict's own test, without a Python call). `expire` forgets those learned
    more than `trust_s` ago. Engine thread only."""

    def __init__(self, cap: int, trust_s: float = math.inf) -> None:
        super().__init__()
        self.cap = cap
        self.trust_s = trust_s

    def add_all(self, keys: Sequence[bytes], now: float) -> None:
        """Add `keys`, learned at `now` (the last one most recent)."""
        for key in keys:
            self[key] = now
            self.move_to_end(key)
        while len(self) > self.cap:
            self.popitem(last=False)

    def expire(self, now: float) -> None:
        """Forget what was learned more than `trust_s` before `now`: the oldest entries, at the
        front (one look where none is that old)."""
        cutoff = now - self.trust_s
        while self:
            key, learned = next(iter(self.items()))
            if learned >= cutoff:
                return
            del self[key]

    def discard(self, key: bytes) -> None:
        self.pop(key, None)
