"""One store tier below the host, seen from the engine: look-ahead fetches and writes, run on
worker threads. `hicache.tiers.chain.TierChain` holds one `StoreLink` per store tier and walks them.

The engine thread never calls the store. It hands jobs to worker threads — one for puts,
`fetch_workers` for fetches, each fetch to the least busy of them — and applies their results in
`poll` (and in `match`, for a request whose fetch is running):

- a *fetch* (for one request whose prompt runs past the host tier's hit): the pages after the
  host hit are hashed, by the engine thread for the first `ENGINE_PREP_PAGES` pages and by the
  worker (from the key before them and their tokens) for the rest; the worker names their
  groups. If the fetch fits the reserve of free host slots, it is one batched `get_into` those
  slots, and the leading run that arrives is the hit. Otherwise one batched `exists` for the
  groups (and, for state layouts, the states at the group ends), then — on the engine thread —
  a choice (the leading run of groups, snapped to a state), fresh host slots reserved for it,
  and one batched `get_into`. Pages become visible in the host index only after their get
  succeeded, under the keys of the job: a failed transfer is never a hit. The slots stay pinned
  by the fetch until the worker has returned, even if the request went away meanwhile, so no
  transfer writes into a reused slot.
- a *put*: with `write: behind`, queued by `store` with the completion of its host copy: the
  worker waits for that copy, then sends the full page groups (and group-aligned states) that
  the tier is not known to hold straight from the pinned host slots, which stay pinned until the
  put returns. With `write: on_evict`, `store` only notes the new groups; once the host tier runs
  short of free slots, `poll` puts the oldest of them (pinned until the put returns, so not
  evicted before). The queue is bounded: when it is full, work is dropped and counted, never
  queued without bound and never waited for.

Both queues are bounded by a count of jobs queued or running (`queue_depth` puts,
`fetch_depth` fetches); beyond it a put is dropped and a fetch not started, both counted. On
the engine thread a job is bookkeeping only (keys, slots, pins), besides a fetch's first
`ENGINE_PREP_PAGES` pages hashed; what a worker does with it (hash the rest, name the objects,
find their bytes, make the call) is `hicache.tiers.worker.Worker`'s. Nothing
here releases the GIL on the engine thread (see the README's engine contract): a worker that
wants it waits for the engine's next release, never cuts into a call.

While the store is not `available` (not connected yet) or its breaker is open (repeated failed
calls: the store's own breaker where it keeps one, else the link's) no fetch starts and no put is
offered: the chain asks the next tier, or the request takes its host hit at once. An open
breaker lets one call through after `breaker_reprobe_s`, so the tier comes back by itself. A
job's slots stay pinned until its call has returned, however long the store takes.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from hicache.config import Layout, Policy
from hicache.core import threads
from hicache.core.cost import Rate, Verdict
from hicache.core.keys import KeyChain
from hicache.core.slots import Lease
from hicache.errors import HiCacheError
from hicache.observability.events import EventSink, emit
from hicache.observability.stats import TierStats
from hicache.tiers.base import StoreTier, StoreUnavailable
from hicache.tiers.breaker import CircuitBreaker
from hicache.tiers.host import HostTier
from hicache.tiers.worker import Job, Worker
from hicache.transfer.completions import DONE, Completion

log = logging.getLogger(__name__)


ENGINE_PREP_PAGES = 128
"""A fetch's first pages that the engine thread hashes itself, in `match` (~25 µs for 128 pages
on a warm thread): a worker that has just woken runs slowly for its first few hundred µs (4-7
times slower than warm on the machines measured), and the fill waits for the keys. The worker
hashes the pages past these (GIL dropped), so the engine thread's share stays bounded however
long the look-ahead."""

WRITE_BACK_GROUPS = 64
"""`write: on_evict`: page groups one write-back put takes at most."""

_LATENCY = {
    "probe": "hicache_tier_exists_seconds",
    "get": "hicache_tier_get_seconds",
    "put": "hicache_tier_put_seconds",
}


@dataclass(frozen=True)
class LinkSettings:
    """What a `StoreLink` needs from its store tier's configuration."""

    name: str
    group_pages: int
    key_prefix: str
    queue_depth: int
    """Put jobs queued or running at most."""
    fetch_depth: int = 64
    """Fetch jobs queued or running at most."""
    fetch_workers: int = 1
    """Fetch worker threads, each with its own queue; a fetch job goes to the least busy."""
    reserve_pages: int = 0
    """Host page slots kept reserved for fetches that skip the exists (`fetch_reserve`)."""
    worker_cpus: frozenset[int] = frozenset()
    """CPUs of the worker threads (`hicache.core.threads`); empty: no restriction."""
    write: str = "behind"
    """behind | on_evict | off (see `StoreTierConfig.write`)."""
    read_gbps: float = 4.0
    """The read throughput the cost model starts from."""
    breaker_failures: int = 3
    breaker_reprobe_s: float = 5.0


@dataclass
class Fetch:
    """One request's look-ahead from one tier. Engine thread only.

    The chain links the fetches of one request's walk: where a tier's fetch fell short, the
    next tier's fetch (`next`) asks for the pages after it."""

    first_group: int
    groups: int
    """How many page groups, from `first_group` on, the fetch may bring."""
    first_page: int
    """The first page of `first_group`."""
    host_pages: int
    """The host hit when the fetch began: the fetch's pages before it (its first group may start
    below it) were host hits already."""
    deadline: float
    started: float
    link: StoreLink
    """The tier it reads from."""
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

    def key_before(self, pages: int) -> bytes:
        """The key of page ``pages - 1`` (a group end inside the fetch)."""
        return self.keys[pages - 1 - self.first_page]

    @property
    def running(self) -> bool:
        """This tier's part is not done."""
        return self.phase != "done"

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


class _Leases:
    """Two leases released together (a put pins page slots and state slots)."""

    def __init__(self, *leases: Lease) -> None:
        self._leases = leases

    def release(self) -> None:
        for lease in self._leases:
            lease.release()


class StoreLink:
    """Fetches and puts between the host tier and one `StoreTier`, off the engine thread."""

    def __init__(
        self,
        store: StoreTier,
        settings: LinkSettings,
        host: HostTier,
        layout: Layout,
        fingerprint: bytes,
        policy: Policy,
        prefill: Rate,
        clock: Callable[[], float] = time.monotonic,
        events: EventSink | None = None,
        wake: Callable[[], None] | None = None,
        on_done: Callable[[Fetch], None] | None = None,
    ) -> None:
        self.store = store
        self.settings = settings
        self.name = settings.name
        self.G = settings.group_pages
        self.host = host
        self.layout = layout
        self.fingerprint = fingerprint
        self.policy = policy
        self.stats = TierStats()
        self.clock = clock
        self.events = events
        self.wake = wake
        """Called by a worker after it posted a result (see `HiCache`'s `wake`)."""
        self.on_done = on_done
        """Called on the engine thread when a fetch's part here is done (the chain walks on)."""
        self.read = Rate(settings.read_gbps * 1e9)
        """This tier's read throughput (bytes/s), learned from its gets."""
        self._verdict = Verdict(self.read, prefill, layout.page_size, layout.page_tokens)
        own = store.breaker
        self._own_breaker = own is None
        self.breaker = own or CircuitBreaker(settings.breaker_failures, settings.breaker_reprobe_s)
        """The store's own breaker, or one the link keeps from the outcomes of its calls."""
        self._trusted_books = not (store.shared or store.persistent)
        """Nobody else writes this tier and it starts empty: a group the link never put there
        is a miss without asking."""
        self._dirty: OrderedDict[bytes, list[bytes]] = OrderedDict()
        """write: on_evict: groups stored in the host and not yet put here, oldest first, by
        their end key: the keys of their pages."""
        self._worker = Worker(
            store,
            host,
            settings.key_prefix,
            fingerprint,
            self.G,
            layout.page_tokens,
            bool(layout.state_bytes),
        )
        # what the tier holds (or receives), by the key naming the object: engine thread only
        self._groups_held = _Seen(1 << 20)
        self._states_held = _Seen(1 << 18)
        self._registered = threading.Event()
        self._results: deque[tuple[Job, object]] = deque()
        self._reserve: Lease | None = None  # free host slots a fetch can get into at once
        self._lent = 0  # reserve slots that unprobed gets are reading into now
        self.jobs_in_flight = 0
        """Jobs handed to the workers whose results `poll` has not applied yet."""
        # SimpleQueue: putting never blocks, nor releases the GIL (queue.Queue's lock may). A
        # queue per fetch worker: a job goes to the least busy, the first of equals, so that
        # one fetch at a time always finds the same thread (and its state in Mooncake's client)
        # and a second thread runs only while the first is busy.
        self._fetch_jobs: list[queue.SimpleQueue[Job | None]] = [
            queue.SimpleQueue() for _ in range(settings.fetch_workers)
        ]
        # per fetch worker: jobs queued or running (together at most settings.fetch_depth)
        self._fetch_load = [0] * settings.fetch_workers
        self._put_jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._puts_out = 0  # put jobs queued or running (at most settings.queue_depth)
        cpus = settings.worker_cpus
        store.start()
        name = settings.name
        self._threads = [
            *(
                threads.start(self._work, f"hicache-{name}-fetch-{i}", cpus, (jobs,))
                for i, jobs in enumerate(self._fetch_jobs)
            ),
            threads.start(self._work, f"hicache-{name}-put", cpus, (self._put_jobs,)),
        ]
        threads.start(self._register, f"hicache-{name}-register", cpus)

    # -- engine thread: fetch ---------------------------------------------------------------------

    def usable(self) -> bool:
        """Whether the tier can be used now: the host pools are registered, the store answers
        and the breaker lets calls through (an open one, one probe per `breaker_reprobe_s`)."""
        if not (self._registered.is_set() and self.store.available):
            return False
        return self.breaker.closed or (self._own_breaker and self.breaker.allow())

    def start_fetch(
        self,
        chain: KeyChain,
        host_pages: int,
        max_pages: int,
        deadline: float | None = None,
        planned: bool = False,
    ) -> Fetch | None:
        """Begin a fetch of the groups after `host_pages` of `chain`, up to `max_pages` pages.

        `chain` has hashed at least `host_pages` pages; the worker hashes the rest it needs.
        `deadline`: when a waiting request gives up (default: `policy.fetch_max_wait_ms` from
        now). Returns None when no whole group lies in that range, the tier is not available or
        busy, or fetching is slower than recomputing (see `hicache.core.cost`; not asked for a
        `planned` partial fetch, whose plan weighed the tier's speed already).
        """
        G, P = self.G, chain.page_tokens
        first = host_pages // G
        # groups [first, last): every whole group that starts below max_pages (the hit is capped
        # at max_pages afterwards, so a group may be fetched for only part of its pages)
        last = min(-(-max_pages // G), chain.pages // G)
        if last <= first:
            return None
        if not self.usable():
            self.stats.skipped_down += 1
            return None
        if sum(self._fetch_load) >= self.settings.fetch_depth:
            self.stats.skipped_busy += 1
            return None
        if not planned and not self._verdict.worth():
            self.stats.skipped_slow += 1
            return None
        if self._trusted_books:
            chain.hash_to((first + 1) * G)
            if chain.hashed[(first + 1) * G - 1] not in self._groups_held:
                self.stats.skipped_unheld += 1
                return None
        now = self.clock()
        if deadline is None:
            deadline = now + self.policy.fetch_max_wait_ms / 1e3
        fetch = Fetch(
            first, last - first, first * G, host_pages, deadline, now, self, chain, max_pages
        )
        self.stats.fetches += 1
        pages = (last - first) * G
        job = Job("probe", fetch=fetch, started=now)
        if self._can_get_at_once(pages):
            # One call: get every group into reserved slots; the leading run that arrives is the
            # hit (a missing object reads as a miss). No exists, no second trip to this thread.
            fetch.lease, fetch.phase = self._reserve.split(pages), "get"  # type: ignore[union-attr]
            fetch.lease.slots.sort()  # runs of slots in order: a group in a run is one piece
            self._lent += pages
            job.kind, job.groups, job.unprobed = "get", last - first, True
            job.page_slots = fetch.lease.slots
        # The first ENGINE_PREP_PAGES pages are hashed here; the worker hashes the rest.
        begin, end = first * G, last * G
        own = min(end, begin + ENGINE_PREP_PAGES)
        chain.hash_to(own)
        job.page_keys = fetch.keys = chain.hashed[begin:own]
        if own < end:
            # bytes, not an array copy: the caller may reuse its tokens, and numpy releases the
            # GIL to copy an array this long (a worker waiting for it would cut into this call)
            job.hash_from = (job.page_keys[-1], chain.tokens[own * P : end * P].tobytes())
        self._submit_fetch(job)
        return fetch

    def _can_get_at_once(self, pages: int) -> bool:
        """Whether a fetch of `pages` pages can skip the exists: no states to find (a state's
        boundary decides the run), a store that tells a miss from a failure, room in the
        reserve."""
        return (
            not self.layout.state_bytes
            and self.store.missing_code is not None
            and self._reserve is not None
            and len(self._reserve) >= pages
        )

    def refill(self) -> None:
        """Top the fetch reserve up to `reserve_pages` free host slots (evicting if needed), at
        most an eighth of the host tier."""
        if not self.host.ready:
            return
        short = self._reserve_short()
        if short > 0:
            self._add_to_reserve(self.host.page_slots.reserve(short))

    def _take_back(self, lease: Lease, keep: int) -> None:
        """A get into slots lent by the reserve has read `keep` pages: the lease's other slots
        (reserved, never published) return to the reserve, as far as it has room, and the rest
        to the free list. A fetch of objects the store does not hold leaves nothing to refill,
        so misses cost the engine thread no evictions and no refill."""
        spare = lease.split(len(lease) - keep)
        room = max(0, self._reserve_short())
        if len(spare) > room:
            spare.split(len(spare) - room).release()
        self._add_to_reserve(spare)

    def _add_to_reserve(self, lease: Lease) -> None:
        """Move `lease`'s reserved slots, with their pins, into the reserve."""
        if self._reserve is None:
            self._reserve = lease
        else:
            self._reserve.absorb(lease)

    def _reserve_short(self) -> int:
        """Slots the reserve lacks: its size, less the slots lent to running gets and those it
        holds (negative when it holds more)."""
        return self._reserve_size() - self._lent - self._reserve_free()

    def _reserve_free(self) -> int:
        """Free slots in the reserve now (none before the first refill)."""
        return len(self._reserve) if self._reserve is not None else 0

    def _reserve_size(self) -> int:
        """Free slots held for fetches when none is out: `reserve_pages`, at most an eighth of
        the host tier."""
        return min(self.settings.reserve_pages, self.host.page_slots.capacity // 8)

    def forget(self, fetch: Fetch) -> None:
        """The request is gone: drop the fetch (a running get still finishes into its slots)."""
        fetch.abandoned = True
        if not fetch.running:
            fetch.release()

    # -- engine thread: write-behind --------------------------------------------------------------

    def stored(
        self,
        keys: list[bytes],
        n_pages: int,
        state_pages: Sequence[int],
        ready: Completion = DONE,
        slots: list[int] | None = None,
    ) -> None:
        """`store` has written `keys[:n_pages]` to the host: put them behind, or note them for
        a write-back, as the tier's `write:` says."""
        write = self.settings.write
        if write == "behind":
            self.write_behind(keys, n_pages, state_pages, ready, slots)
        elif write == "on_evict":
            G, held, dirty = self.G, self._groups_held, self._dirty
            for g in range(n_pages // G):
                end = keys[(g + 1) * G - 1]
                if end not in held and end not in dirty:
                    dirty[end] = keys[g * G : (g + 1) * G]

    def write_behind(
        self,
        keys: list[bytes],
        n_pages: int,
        state_pages: Sequence[int],
        ready: Completion = DONE,
        slots: list[int] | None = None,
    ) -> None:
        """Queue puts of the full groups of `keys[:n_pages]` (and states) the tier does not hold.

        Called by `store` at once, with `ready` marking the host write-through: the worker waits
        for it before reading the slots, which stay pinned until the put has returned. On this
        thread: which groups are new, their slots, their pins; the worker names them and finds
        their bytes. `slots`, where the caller knows them: the host slot of each of `keys`
        (all published), so that they need not be looked up.
        """
        G = self.G
        if not self.usable():  # not connected, or the breaker is open: offer nothing
            self.stats.puts_skipped += n_pages // G
            return
        held = self._groups_held
        groups = [g for g in range(n_pages // G) if keys[(g + 1) * G - 1] not in held]
        if self._puts_out >= self.settings.queue_depth:  # drop at once, build nothing
            self.stats.puts_dropped += len(groups)
            return
        ends: list[bytes] = []
        pins: list[int] = []
        if slots is not None and len(groups) == n_pages // G:  # every group is new: no loop
            ends, pins = keys[G - 1 : len(groups) * G : G], slots[: len(groups) * G]
        elif groups:
            page_slots: Sequence[int | None] = (
                slots
                if slots is not None
                else self.host.page_slots.lookup(keys[: (groups[-1] + 1) * G])
            )
            for g in groups:
                group = page_slots[g * G : (g + 1) * G]
                if None in group:  # a page was evicted meanwhile: this group can't be put
                    continue
                ends.append(keys[(g + 1) * G - 1])
                pins += group  # type: ignore[arg-type]
        state_ends: list[bytes] = []
        state_pins: list[int] = []
        if self.layout.state_bytes:
            wanted = [keys[p - 1] for p in state_pages if p % G == 0]
            wanted = [k for k in wanted if k not in self._states_held]
            for key, slot in zip(wanted, self.host.state_slots.lookup(wanted)):
                if slot is not None:
                    state_ends.append(key)
                    state_pins.append(slot)
        self._put(ends, pins, state_ends, state_pins, ready)

    def _put(
        self,
        ends: list[bytes],
        pins: list[int],
        state_ends: list[bytes],
        state_pins: list[int],
        ready: Completion = DONE,
    ) -> None:
        """Queue one put of the groups named by `ends` (their pages in host slots `pins`, `G`
        a group) and the states in `state_pins`; the slots stay pinned until it has returned."""
        if not ends and not state_ends:
            return
        lease = _Leases(self.host.page_slots.lease(pins), self.host.state_slots.lease(state_pins))
        job = Job("put", ends, state_ends, pins, state_pins, lease=lease, ready=ready)
        job.started = self.clock()
        self._puts_out += 1
        self._submit(self._put_jobs, job)
        self._groups_held.add_all(ends)
        self._states_held.add_all(state_ends)

    def write_back(self, force: bool = False) -> None:
        """`write: on_evict`: once the host tier runs short of free slots (fewer than an eighth
        of them free; `force`: at once), put the oldest groups noted by `stored` that it still
        holds, up to `WRITE_BACK_GROUPS` in one put. A group the host evicted first is counted
        lost (`evict_lost`)."""
        dirty = self._dirty
        if not dirty or self._puts_out >= self.settings.queue_depth or not self.usable():
            return
        pool = self.host.page_slots
        if not force and pool.free >= pool.capacity // 8:
            return
        batch = [dirty.popitem(last=False) for _ in range(min(WRITE_BACK_GROUPS, len(dirty)))]
        flat = [key for _, group in batch for key in group]
        found = pool.lookup(flat)
        G = self.G
        ends: list[bytes] = []
        pins: list[int] = []
        for i, (end, _) in enumerate(batch):
            group = found[i * G : (i + 1) * G]
            if None in group:
                self.stats.evict_lost += 1
                continue
            ends.append(end)
            pins += group  # type: ignore[arg-type]
        state_ends: list[bytes] = []
        state_pins: list[int] = []
        if self.layout.state_bytes and ends:
            for key, slot in zip(ends, self.host.state_slots.lookup(ends)):
                if slot is not None and key not in self._states_held:
                    state_ends.append(key)
                    state_pins.append(slot)
        self._put(ends, pins, state_ends, state_pins)

    def evicted(self, keys: Sequence[bytes]) -> None:
        """The host evicted `keys`: groups noted for write-back whose end was among them are
        lost to this tier (counted)."""
        dirty = self._dirty
        if dirty:
            for key in keys:
                if dirty.pop(key, None) is not None:
                    self.stats.evict_lost += 1

    @property
    def dirty(self) -> int:
        """Groups waiting for their write-back."""
        return len(self._dirty)

    # -- engine thread: results -------------------------------------------------------------------

    def poll(self) -> None:
        """Apply the results the workers have posted, refill the fetch reserve, write back.
        Never blocks. A poll that has just finished a fetch leaves the refill to the next one
        while the reserve holds at least half its size: the request that fetch answers is
        matched right after this poll, and should not wait for slots that a later fetch
        needs."""
        fetched = self.apply()
        have = self._reserve_free()
        if not fetched or 2 * have < self._reserve_size():
            self.refill()
        if self._dirty:
            self.write_back()

    def apply(self) -> bool:
        """Apply the results the workers have posted (engine thread); True if a fetch finished.
        `match` calls it for a request whose fetch is running, so that an answer posted since
        the last `poll` counts."""
        fetched = False
        while self._results:
            job, outcome = self._results.popleft()
            self.jobs_in_flight -= 1
            if job.kind == "put":
                self._puts_out -= 1
            else:
                self._fetch_load[job.worker] -= 1
            family = _LATENCY[job.kind]
            self.stats.latency[family].observe(job.finished - job.started)
            failed = isinstance(outcome, BaseException)
            if failed:
                self.stats.call_errors += 1
            if job.page_keys:  # a fetch's first job: its pages' keys, the worker's part too
                job.fetch.keys = job.page_keys
            if job.kind == "probe":
                self._on_probe(job, None if failed else outcome)  # type: ignore[arg-type]
            elif job.kind == "get":
                self._on_get(job, None if failed else outcome)  # type: ignore[arg-type]
                fetched = True
            else:
                self._on_put(job, None if failed else outcome)  # type: ignore[arg-type]
        return fetched

    def _done(self, fetch: Fetch) -> None:
        """This tier's part of `fetch` is over: the chain may walk on."""
        fetch.phase = "done"
        if self.on_done is not None:
            self.on_done(fetch)

    def _on_probe(self, job: Job, present: list[bool] | None) -> None:
        fetch = job.fetch
        n_groups = fetch.groups
        if present is None or fetch.abandoned:
            self._done(fetch)
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
            self._done(fetch)
            return
        lease = self.host.page_slots.reserve(run * self.G)
        run = len(lease) // self.G  # the whole groups that fit (the others' pages are pinned)
        lease.split(len(lease) - run * self.G).release()
        lease.slots.sort()  # runs of slots in order: a group in a run is one piece
        state_lease = None
        if state_here and run:
            state_lease = self.host.state_slots.reserve(1)
            if not len(state_lease):
                run = 0
        if run == 0:
            lease.release()
            if state_lease is not None:
                state_lease.release()
            self.stats.no_space += 1
            self._done(fetch)
            return
        get = Job("get", job.ends[:run], page_slots=lease.slots, fetch=fetch, groups=run)
        if state_lease is not None:
            get.state_ends = [fetch.key_before(fetch.first_page + run * self.G)]
            get.state_slots = state_lease.slots
        get.started = self.clock()
        fetch.lease, fetch.state_lease, fetch.phase = lease, state_lease, "get"
        self._submit_fetch(get)

    def _on_get(self, job: Job, codes: list[int] | None) -> None:
        fetch = job.fetch
        run = job.groups
        if job.unprobed:  # its slots are the fetch's now (or free again): the reserve may refill
            self._lent -= run * self.G
        # a read counts only where it returned the object's exact size: a tier that answers 0
        # (or a short count) for an object it did not fill must not make a hit
        group_bytes = self.G * self.layout.page_size
        ok = 0
        if codes is not None:
            while ok < run and codes[ok] == group_bytes:
                ok += 1
            if ok < run and not (job.unprobed and codes[ok] == self.store.missing_code):
                self.stats.get_failed += run - ok
        state_ok = (
            fetch.state_lease is not None
            and codes is not None
            and codes[-1] == self.layout.state_bytes
        )
        if fetch.state_lease is not None and not state_ok:
            ok = 0  # without its state the run can't be resumed from
        if job.unprobed:  # the slots nothing was read into go back where they came from
            self._take_back(fetch.lease, ok * self.G)  # type: ignore[arg-type]
        first_page = fetch.first_page
        if ok:
            got = fetch.keys[: ok * self.G]
            fresh = fetch.fresh = self.host.page_slots.publish(
                fetch.lease.slots[: ok * self.G], got
            )
            if self.events is not None:
                emit(self.events, "stored", "host", self.host.page_slots.keys_of(fresh))
            self._groups_held.add_all(job.ends[:ok])
            if fetch.state_lease is not None:
                boundary_key = got[-1]
                self.host.state_slots.publish(fetch.state_lease.slots, [boundary_key])
            fetch.pages = (first_page, first_page + ok * self.G)
            nbytes = ok * self.G * self.layout.page_size
            self.stats.pages_fetched += ok * self.G
            self.stats.get_bytes += nbytes
            self.read.observe(nbytes, job.finished - job.started)
        self.stats.latency["hicache_tier_fetch_seconds"].observe(self.clock() - fetch.started)
        if fetch.abandoned or not ok:
            fetch.release()
        self._done(fetch)

    def _on_put(self, job: Job, codes: list[int] | None) -> None:
        job.release()
        ends = job.ends + job.state_ends
        codes = codes or [-1] * len(ends)
        ok = [code >= 0 for code in codes]
        if all(ok):  # the usual case: counted in one step
            self.stats.objects_put += len(ok)
            self.stats.put_bytes += (
                len(job.page_slots) * self.layout.page_size
                + len(job.state_slots) * self.layout.state_bytes
            )
        else:
            groups = len(job.ends)
            for i, (key, put) in enumerate(zip(ends, ok)):
                if put:
                    self.stats.objects_put += 1
                    self.stats.put_bytes += (
                        self.G * self.layout.page_size if i < groups else self.layout.state_bytes
                    )
                else:
                    (self._groups_held if i < groups else self._states_held).discard(key)
                    self.stats.put_failed += 1
        if self.events is not None:
            emit(self.events, "stored", self.name, [k for k, put in zip(job.ends, ok) if put])

    def gauges(self) -> dict[str, int]:
        """Gauges for `HiCache.stats`, each ``<gauge>_<name>``: availability (1 the store
        answers and the breaker is closed, 0 not), puts queued or running, jobs in flight, the
        free host slots held for fetches (counted in host_pinned too), groups waiting for their
        write-back, and the read throughput the cost model uses now (MB/s)."""
        n = self.name
        return {
            f"available_{n}": int(self.store.available and self.breaker.closed),
            f"queue_depth_{n}": self._puts_out,
            f"jobs_in_flight_{n}": self.jobs_in_flight,
            f"fetch_reserve_{n}": self._reserve_free(),
            f"write_back_pending_{n}": len(self._dirty),
            f"read_mbps_{n}": int(self.read.per_s / 1e6),
        }

    @property
    def idle(self) -> bool:
        """No job is queued or running."""
        return self.jobs_in_flight == 0

    def _submit_fetch(self, job: Job) -> None:
        """Queue a fetch job for the least busy fetch worker (the first of equals)."""
        load = self._fetch_load
        job.worker = load.index(min(load))
        load[job.worker] += 1
        self._submit(self._fetch_jobs[job.worker], job)

    def _submit(self, jobs: queue.SimpleQueue[Job | None], job: Job) -> None:
        jobs.put(job)
        self.jobs_in_flight += 1

    # -- worker threads ---------------------------------------------------------------------------

    def _work(self, jobs: queue.SimpleQueue[Job | None]) -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            try:
                outcome: object = self._worker.run(job)
            except Exception as err:  # reported to the engine thread as a failed job
                if not isinstance(err, StoreUnavailable):
                    log.warning("hicache tier %s: %s failed: %r", self.name, job.kind, err)
                outcome = err
                if self._own_breaker:
                    self.breaker.record_failure()
            else:
                if self._own_breaker:
                    self.breaker.record_success()
            job.finished = self.clock()
            self._results.append((job, outcome))
            if self.wake is not None:
                try:
                    self.wake()
                except Exception as err:  # the engine's callback must not stop the worker
                    log.warning("hicache: the wake callback raised %r", err)

    # -- helpers ----------------------------------------------------------------------------------

    def _register(self) -> None:
        """Register the host pools with the store, off the engine thread (registering tens of
        GiB for RDMA takes seconds). The tier is not used until this is done."""
        try:
            if not self.host.wait_ready():
                return
        except HiCacheError:  # the host tier could not be allocated: its wait_ready says so
            return
        try:
            for tensor in self.host.memory():
                self.store.register(tensor)
        except Exception as err:  # the tier stays unused; the engine goes on without it
            log.error("hicache tier %s: registering the host pools failed: %r", self.name, err)
            return
        self._registered.set()

    def drain(self, timeout_s: float) -> bool:
        """Write back what waits for it and wait until every put has returned, applying the
        results, for at most `timeout_s`. True if nothing is left. Blocks (for `close`)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.apply()
            if self._dirty and self.usable():
                self.write_back(force=True)
            if not self._puts_out and not (self._dirty and self.usable()):
                return not self._dirty
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)

    def close(self) -> None:
        """Stop the workers (after their current job) and close the store. Blocks."""
        for jobs in self._fetch_jobs:
            jobs.put(None)
        self._put_jobs.put(None)
        for t in self._threads:
            t.join(timeout=30)
        self.poll()
        if self._reserve is not None:
            self._reserve.release()
            self._reserve = None
        self.store.close()


class _Seen(OrderedDict[bytes, None]):
    """The most recent `cap` keys added (an LRU set; `in` is the dict's own test, without a
    Python call). Engine thread only."""

    def __init__(self, cap: int) -> None:
        super().__init__()
        self.cap = cap

    def add_all(self, keys: Sequence[bytes]) -> None:
        """Add `keys`, the last one most recent."""
        for key in keys:
            self[key] = None
            self.move_to_end(key)
        while len(self) > self.cap:
            self.popitem(last=False)

    def discard(self, key: bytes) -> None:
        self.pop(key, None)
