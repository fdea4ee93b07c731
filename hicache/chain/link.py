"""One store tier below the host, seen from the engine: look-ahead fetches and writes, run on
worker threads. `hicache.chain.walk.TierChain` holds one `StoreLink` per store tier and walks them.

The engine thread never calls the store. It hands jobs to worker threads — one for puts,
`fetch_workers` for fetches, each fetch to the least busy of them — and applies their results in
`poll` (and in `match`, for a request whose fetch is running):

- a *fetch* (for one request whose prompt runs past the host tier's hit: `hicache.chain.fetch`
  `Fetcher`), into its reserve of free host slots where it fits;
- a *put* (`write: behind` from `store`, or `write: on_evict` once the host runs short of free
  slots: `hicache.chain.writes` `WriteBehind`).

Both queues are bounded by a count of jobs queued or running (`queue_depth` puts,
`fetch_depth` fetches); beyond it a put is dropped and a fetch not started, both counted. On
the engine thread a job is bookkeeping only (keys, slots, pins), besides a fetch's first
`ENGINE_PREP_PAGES` pages hashed; what a worker does with it (hash the rest, name the objects,
find their bytes, make the call) is `hicache.chain.jobs.JobRunner`'s. Nothing
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
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from hicache import threads
from hicache.backends.base import StoreTier, StoreUnavailable
from hicache.backends.breaker import CircuitBreaker
from hicache.backends.codec import Codec
from hicache.backends.crypt import Keyring
from hicache.backends.host import HostTier
from hicache.chain.fetch import HELD_TRUST_S, Fetch, Fetcher, Held
from hicache.chain.jobs import Job, JobRunner
from hicache.chain.writes import WriteBehind
from hicache.config import Layout, Policy
from hicache.core.cost import Rate
from hicache.core.marks import mark
from hicache.errors import HiCacheError
from hicache.kernels.completions import Completion
from hicache.observability.events import EventSink
from hicache.observability.stats import TierStats

log = logging.getLogger(__name__)

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
    """CPUs of the worker threads (`hicache.threads`); empty: no restriction."""
    write: str = "behind"
    """behind | on_evict | off (see `StoreTierConfig.write`)."""
    read_gbps: float = 4.0
    """The read throughput the cost model starts from."""
    breaker_failures: int = 3
    breaker_reprobe_s: float = 5.0
    codec: Codec | None = None
    """Encodes the objects a put writes (`codec: lossless`); None: stored raw."""
    codec_threads: int = 1
    """Threads that encode and decode one call's objects in parallel."""
    keyring: Keyring | None = None
    """The encrypted tenants' keys (`hicache.backends.crypt`); None: every object is plain."""
    owners: Mapping[bytes, str] = field(default_factory=dict)
    """The tenant whose name each chain seed's objects carry (`hicache.core.shares.owners`)."""


class StoreLink:
    """Fetches and puts between the host tier and one `StoreTier`, off the engine thread.

    Its parts: `fetcher` (`Fetcher`: fetches and the reserve of free host slots) and `writer`
    (`WriteBehind`: puts), each given what it uses; the link owns the worker threads, their
    queues (handed to the parts that fill them) and the results, which `apply` routes to the
    part that queued the job. It also owns what both parts ask: whether the tier is `usable`,
    its `read` rate and its `stats`."""

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
        *,
        on_done: Callable[[Fetch], None],
        fence: Callable[[], Completion],
    ) -> None:
        """`on_done`: called on the engine thread when a fetch's part here is over; it marks
        the part done (`phase`) and the chain walks on. `fence`: a completion of every copy
        enqueued so far on the engine's stream (a put waits for one)."""
        self.store = store
        self.settings = settings
        self.name = settings.name
        self.G = settings.group_pages
        self.host = host
        self.layout = layout
        self.fingerprint = fingerprint
        self.policy = policy
        self.stats = TierStats()
        self._clock = clock
        self.wake = wake
        """Called by a worker after it posted a result (see `HiCache`'s `wake`)."""
        self.read = Rate(settings.read_gbps * 1e9)
        """This tier's read throughput (bytes/s), learned from its gets."""
        own = store.breaker
        self._own_breaker = own is None
        self.breaker = own or CircuitBreaker(settings.breaker_failures, settings.breaker_reprobe_s)
        """The store's own breaker, or one the link keeps from the outcomes of its calls."""
        self._runner = JobRunner(
            store,
            host,
            settings.key_prefix,
            fingerprint,
            self.G,
            layout.page_tokens,
            bool(layout.state_bytes),
            settings.codec,
            settings.codec_threads,
            keyring=settings.keyring,
            owners=settings.owners,
        )
        self._registered = threading.Event()
        self._available_raised = False  # the store's `available` has raised (logged once)
        self._results: deque[tuple[Job, object]] = deque()
        # SimpleQueue: putting never blocks, nor releases the GIL (queue.Queue's lock may). A
        # queue per fetch worker: a job goes to the least busy, the first of equals, so that
        # one fetch at a time always finds the same thread (and its state in Mooncake's client)
        # and a second thread runs only while the first is busy.
        self._fetch_jobs: list[queue.SimpleQueue[Job | None]] = [
            queue.SimpleQueue() for _ in range(settings.fetch_workers)
        ]
        self._put_jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        # the groups and states the tier holds (or receives), by their object's key; taken at
        # the link's word for HELD_TRUST_S, for ever where only this link writes the tier
        trust = HELD_TRUST_S if store.shared or store.persistent else math.inf
        held, states_held = Held(1 << 20, trust), Held(1 << 18, trust)
        self.fetcher = Fetcher(
            self.name, store, host, layout, policy, self.G,
            stats=self.stats, events=events, clock=clock, read=self.read, prefill=prefill,
            held=held, states_held=states_held, jobs=self._fetch_jobs,
            depth=settings.fetch_depth, reserve_pages=settings.reserve_pages,
            usable=self.usable, on_done=on_done,
        )  # fmt: skip
        self.writer = WriteBehind(
            self.name, host, layout, self.G,
            stats=self.stats, events=events, clock=clock, held=held, states_held=states_held,
            jobs=self._put_jobs, depth=settings.queue_depth, usable=self.usable, fence=fence,
        )  # fmt: skip
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

    @property
    def clock(self) -> Callable[[], float]:
        """The clock of the link and its parts (a job's times, a fetch's deadline)."""
        return self._clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:
        """Put the link and its parts on another clock (a simulation's)."""
        self._clock = self.fetcher.clock = self.writer.clock = clock

    def usable(self) -> bool:
        """Whether the tier can be used now: the host pools are registered, the store answers
        and the breaker lets calls through (an open one, one probe per `breaker_reprobe_s`)."""
        if not (self._registered.is_set() and self._available()):
            return False
        return self.breaker.closed or (self._own_breaker and self.breaker.allow())

    def _available(self) -> bool:
        """The store's `available`, read on the engine thread; a store whose `available`
        raises (a plugin with a bug) reads as down (logged once), never raises here."""
        try:
            return bool(self.store.available)
        except Exception as err:
            if not self._available_raised:
                self._available_raised = True
                log.warning("hicache tier %s: available raised %r; taken as down", self.name, err)
            return False

    # -- engine thread: results -------------------------------------------------------------------

    def poll(self) -> None:
        """Apply the results the workers have posted, refill the fetch reserve, write back.
        Never blocks."""
        self.fetcher.refill(after_fetch=self.apply())
        if self.writer.dirty:
            self.writer.write_back()

    def apply(self) -> bool:
        """Apply the results the workers have posted (engine thread); True if a fetch finished.
        `match` calls it for a request whose fetch is running, so that an answer posted since
        the last `poll` counts."""
        fetched = False
        while self._results:
            job, outcome = self._results.popleft()
            family = _LATENCY[job.kind]
            self.stats.latency[family].observe(job.finished - job.started)
            failed = isinstance(outcome, BaseException)
            if failed:
                self.stats.call_errors += 1
            self.stats.corrupt += job.corrupt
            self.stats.key_misses += job.key_misses
            if job.page_keys:  # a fetch's first job: its pages' keys, the worker's part too
                job.fetch.keys = job.page_keys
            if job.kind == "probe":
                self.fetcher.on_probe(job, None if failed else outcome)  # type: ignore[arg-type]
            elif job.kind == "get":
                self.fetcher.on_get(job, None if failed else outcome)  # type: ignore[arg-type]
                fetched = True
            else:
                self.writer.on_put(job, None if failed else outcome)  # type: ignore[arg-type]
        return fetched

    def gauges(self) -> dict[str, int]:
        """Gauges for `HiCache.stats`, each ``<gauge>_<name>``: availability (1 the store
        answers and the breaker is closed, 0 not), puts queued or running, jobs in flight, the
        free host slots held for fetches (counted in host_pinned too), groups waiting for their
        write-back, and the read throughput the cost model uses now (MB/s); where the tier
        keeps tenants' terms, each tenant's bytes held and evicted,
        ``tenant_store_bytes_<name>.<tenant>`` and ``tenant_store_evicted_<name>.<tenant>``
        ("none": the objects of no tenant)."""
        n = self.name
        out = {
            f"available_{n}": int(self._available() and self.breaker.closed),
            f"queue_depth_{n}": self.writer.out,
            f"jobs_in_flight_{n}": self.jobs_in_flight,
            f"fetch_reserve_{n}": len(self.fetcher.reserve.slots),
            f"write_back_pending_{n}": len(self.writer.dirty),
            f"read_mbps_{n}": int(self.read.per_s / 1e6),
        }
        for tenant, (held, evicted) in self.store.tenant_bytes().items():
            out[f"tenant_store_bytes_{n}.{tenant or 'none'}"] = held
            out[f"tenant_store_evicted_{n}.{tenant or 'none'}"] = evicted
        return out

    @property
    def jobs_in_flight(self) -> int:
        """Jobs handed to the workers whose results `apply` has not applied yet."""
        return self.writer.out + sum(self.fetcher.load)

    @property
    def idle(self) -> bool:
        """No job is queued or running."""
        return self.jobs_in_flight == 0

    # -- worker threads ---------------------------------------------------------------------------

    def _work(self, jobs: queue.SimpleQueue[Job | None]) -> None:
        """A worker thread: run each job and post its outcome, whatever the store raises (a
        plugin's `BaseException` too, such as asyncio.CancelledError): every job is answered,
        so its slots are released and the next job runs."""
        while True:
            job = jobs.get()
            if job is None:
                return
            try:
                outcome: object = self._runner.run(job)
            except BaseException as err:  # reported to the engine thread as a failed job
                if not isinstance(err, Exception):
                    mark("plugin.base-exception")
                if not isinstance(err, StoreUnavailable):
                    log.warning("hicache tier %s: %s failed: %r", self.name, job.kind, err)
                outcome = err
                if self._own_breaker:
                    self.breaker.record_failure()
            else:
                if self._own_breaker:
                    self.breaker.record_success()
            job.finished = self._clock()
            self._results.append((job, outcome))
            if self.wake is not None:
                try:
                    self.wake()
                except BaseException as err:  # the engine's callback must not stop the worker
                    log.warning("hicache: the wake callback raised %r", err)

    # -- helpers ----------------------------------------------------------------------------------

    def _register(self) -> None:
        """Register the host pools (and the objects' headers) with the store, off the engine
        thread (registering tens of GiB for RDMA takes seconds). The tier is not used until
        this is done."""
        try:
            if not self.host.wait_ready():
                return
        except HiCacheError:  # the host tier could not be allocated: its wait_ready says so
            return
        try:
            for tensor in (*self.host.memory(), *self._runner.memory()):
                self.store.register(tensor)
        except BaseException as err:  # the tier stays unused; the engine goes on without it
            log.error("hicache tier %s: registering the host pools failed: %r", self.name, err)
            return
        self._registered.set()

    def drain(self, timeout_s: float) -> bool:
        """Write back what waits for it and wait until every put has returned, applying the
        results, for at most `timeout_s`. True if nothing is left. Blocks (for `close`)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.apply()
            dirty = self.writer.dirty
            if dirty and self.usable():
                self.writer.write_back(force=True)
            if not self.writer.out and not (dirty and self.usable()):
                return not dirty
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
        self._runner.close()
        self.poll()
        self.fetcher.reserve.release()
        self.store.close()
