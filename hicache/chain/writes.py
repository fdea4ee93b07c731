"""A store link's writes (`WriteBehind`, a part of `hicache.chain.link.StoreLink`; engine thread).

- *write: behind*: `store` queues a put with the completion of its host copy: the worker waits
  for that copy, then sends the full page groups (and group-aligned states) that the tier is not
  known to hold straight from the pinned host slots, which stay pinned until the put returns.
- *write: on_evict*: `store` only notes the new groups; once the host tier runs short of free
  slots, `poll` puts the oldest of them (pinned until the put returns, so not evicted before).

Every put carries a fence (`ready`): a completion of every copy enqueued on the engine's stream
before the put was queued, which the worker waits for before it reads a slot (a slot is
published as its copy is enqueued, so a put of any published page may otherwise read it early).

The put queue is bounded (`queue_depth` puts queued or running): when it is full, work is
dropped and counted, never queued without bound and never waited for.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from itertools import filterfalse
from queue import SimpleQueue

from hicache.backends.host import HostTier
from hicache.chain.fetch import Held
from hicache.chain.jobs import Job
from hicache.config import Layout
from hicache.core.marks import mark
from hicache.kernels.completions import Completion
from hicache.observability.events import EventSink, emit
from hicache.observability.stats import TierStats

WRITE_BACK_GROUPS = 64
"""`write: on_evict`: page groups one write-back put takes at most."""


class WriteBehind:
    """A store link's writes (engine thread): which groups and states to put, their slots and
    pins, and the put jobs, queued on `jobs` (the put worker's queue); their results come back
    through `on_put`, which the link calls from its `apply`."""

    def __init__(
        self,
        name: str,
        host: HostTier,
        layout: Layout,
        group_pages: int,
        *,
        stats: TierStats,
        events: EventSink | None,
        clock: Callable[[], float],
        held: Held,
        states_held: Held,
        jobs: SimpleQueue[Job | None],
        depth: int,
        usable: Callable[[], bool],
        fence: Callable[[], Completion],
    ) -> None:
        """`held`, `states_held`: the groups and states the link knows the tier holds (the
        fetches add theirs and forget those they find missing); a put adds its objects when
        queued and drops those that failed, and each store first forgets those the link has
        taken as held for longer than they are trusted (`Held.expire`), so that a group the
        tier dropped meanwhile is put again. `depth`: put jobs queued or
        running at most. `usable`: whether the tier can be used now (the link's). `fence`: a
        completion of every copy enqueued so far on the engine's stream."""
        self.name = name
        self.host = host
        self.layout = layout
        self.G = group_pages
        self.stats = stats
        self.events = events
        self.clock = clock
        self._groups_held = held
        self._states_held = states_held
        self._jobs = jobs
        self._depth = depth
        self.usable = usable
        self.fence = fence
        self.out = 0
        """Put jobs queued or running (at most `depth`)."""
        self.dirty: OrderedDict[bytes, tuple[list[bytes], bytes]] = OrderedDict()
        """write: on_evict: groups stored in the host and not yet put here, oldest first, by
        their end key: the keys of their pages and their request's chain seed."""

    def note_dirty(self, keys: list[bytes], n_pages: int, seed: bytes = b"") -> None:
        """`write: on_evict`: `store` has written `keys[:n_pages]` (of a request whose chain
        seed is `seed`) to the host; note the groups the tier does not hold, for
        `write_back`."""
        G, held, dirty = self.G, self._groups_held, self.dirty
        held.expire(self.clock())
        for g in range(n_pages // G):
            end = keys[(g + 1) * G - 1]
            if end not in held and end not in dirty:
                dirty[end] = (keys[g * G : (g + 1) * G], seed)

    def write_behind(
        self,
        keys: list[bytes],
        n_pages: int,
        state_pages: Sequence[int],
        ready: Completion | None = None,
        slots: list[int] | None = None,
        tail: bool = False,
        seed: bytes = b"",
    ) -> None:
        """Queue puts of the full groups of `keys[:n_pages]` (and states) the tier does not hold,
        and with `tail` the pages past the last of them as one tail object
        (`hicache.core.span`; never for a layout with states, whose runs end at group ends).

        `ready`: a fence the caller has just made (`store` gives the completion of its host
        write-through); None: one is made here. The worker waits for it before reading the
        slots, which stay pinned until the put has returned. On this
        thread: which groups are new, their slots, their pins; the worker names them and finds
        their bytes. `slots`, where the caller knows them: the host slot of each of `keys`
        (all published), so that they need not be looked up. `seed`: the chain seed of the
        request the keys are of (it picks the tenant's key, `hicache.backends.crypt`).
        """
        G, n_groups = self.G, n_pages // self.G
        if not self.usable():  # not connected, or the breaker is open: offer nothing
            self.stats.puts_skipped += n_groups
            return
        mark("write.behind")
        held, now = self._groups_held, self.clock()
        held.expire(now)
        self._states_held.expire(now)
        every_end = keys[G - 1 : n_groups * G : G]
        ends = list(filterfalse(held.__contains__, every_end))
        if self.out >= self._depth:  # drop at once, build nothing
            self.stats.puts_dropped += len(ends)
            return
        pins: list[int] = []
        if slots is not None and len(ends) == n_groups:  # every group is new: no loop
            pins = slots[: n_groups * G]
        elif ends:
            page_slots: Sequence[int | None] = (
                slots if slots is not None else self.host.page_slots.lookup(keys[: n_groups * G])
            )
            ends = []
            for g, end in enumerate(every_end):
                if end in held:
                    continue
                group = page_slots[g * G : (g + 1) * G]
                if None in group:  # the host dropped or evicted a page of it: can't be put
                    self.stats.puts_dropped += 1
                    continue
                ends.append(end)
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
        tail_pages = 0
        if tail and n_pages % G and not self.layout.state_bytes and keys[n_pages - 1] not in held:
            rest = slice(n_groups * G, n_pages)
            found = slots[rest] if slots is not None else self.host.page_slots.lookup(keys[rest])
            if None in found:  # the host dropped or evicted a page of it
                self.stats.puts_dropped += 1
            else:
                ends.append(keys[n_pages - 1])
                pins += found  # type: ignore[arg-type]
                tail_pages = n_pages % G
        self._put(ends, pins, state_ends, state_pins, ready, tail_pages, seed)

    def _put(
        self,
        ends: list[bytes],
        pins: list[int],
        state_ends: list[bytes],
        state_pins: list[int],
        ready: Completion | None = None,
        tail: int = 0,
        seed: bytes = b"",
    ) -> None:
        """Queue one put of the groups named by `ends` (their pages in host slots `pins`, `G`
        a group; the last `tail` pages a tail object where `tail` > 0) and the states in
        `state_pins`; the slots stay pinned until it has returned. `ready`: a fence made after
        the last copy enqueued so far (None: made here). `seed`: their request's chain seed."""
        if not ends and not state_ends:
            return
        if ready is None:
            ready = self.fence()
        leases = (self.host.page_slots.lease(pins),)
        if state_pins:
            leases += (self.host.state_slots.lease(state_pins),)
        job = Job(
            "put", ends, state_ends, pins, state_pins, leases=leases, ready=ready, tail=tail,
            seed=seed,
        )  # fmt: skip
        job.started = now = self.clock()
        self.out += 1
        self._jobs.put(job)
        self._groups_held.add_all(ends, now)
        if state_ends:
            self._states_held.add_all(state_ends, now)

    def write_back(self, force: bool = False) -> None:
        """`write: on_evict`: once the host tier runs short of free slots (fewer than an eighth
        of them free; `force`: at once), put the oldest groups noted by `stored` that it still
        holds, up to `WRITE_BACK_GROUPS` in one put. A group the host evicted first is counted
        lost (`evict_lost`)."""
        dirty = self.dirty
        if not dirty or self.out >= self._depth or not self.usable():
            return
        pool = self.host.page_slots
        if not force and pool.free >= pool.capacity // 8:
            return
        mark("write.on_evict")
        batch = [dirty.popitem(last=False) for _ in range(min(WRITE_BACK_GROUPS, len(dirty)))]
        flat = [key for _, (group, _) in batch for key in group]
        found = pool.lookup(flat)
        G = self.G
        by_seed: dict[bytes, tuple[list[bytes], list[int]]] = {}  # a put per tenant
        for i, (end, (_, seed)) in enumerate(batch):
            group = found[i * G : (i + 1) * G]
            if None in group:
                self.stats.evict_lost += 1
                continue
            ends, pins = by_seed.setdefault(seed, ([], []))
            ends.append(end)
            pins += group  # type: ignore[arg-type]
        for seed, (ends, pins) in by_seed.items():
            state_ends: list[bytes] = []
            state_pins: list[int] = []
            if self.layout.state_bytes:
                for key, slot in zip(ends, self.host.state_slots.lookup(ends)):
                    if slot is not None and key not in self._states_held:
                        state_ends.append(key)
                        state_pins.append(slot)
            self._put(ends, pins, state_ends, state_pins, seed=seed)

    def evicted(self, keys: Sequence[bytes]) -> None:
        """The host evicted `keys`: groups noted for write-back whose end was among them are
        lost to this tier (counted)."""
        dirty = self.dirty
        if dirty:
            for key in keys:
                if dirty.pop(key, None) is not None:
                    self.stats.evict_lost += 1

    def on_put(self, job: Job, codes: list[int] | None) -> None:
        """A put returned: `codes` one per object (the worker checked), or None for a failed
        call. Release its slots, count what was stored, forget what was not."""
        self.out -= 1
        for lease in job.leases:
            lease.release()
        groups, layout, stats = len(job.ends), self.layout, self.stats
        group_bytes = self.G * layout.page_size
        n = groups + len(job.state_ends)
        # codes: one per object (the worker checked), or None for a failed call
        if codes is not None and min(codes) >= 0:  # the usual case: counted in one step
            stats.objects_put += n
            stats.put_bytes += (
                len(job.page_slots) * layout.page_size + len(job.state_slots) * layout.state_bytes
            )
            put = job.ends
        else:
            put = []
            for i, key in enumerate(job.ends + job.state_ends):
                if codes is not None and codes[i] >= 0:
                    stats.objects_put += 1
                    if i >= groups:
                        stats.put_bytes += layout.state_bytes
                    else:
                        last = job.tail and i == groups - 1
                        stats.put_bytes += job.tail * layout.page_size if last else group_bytes
                    if i < groups:
                        put.append(key)
                else:
                    (self._groups_held if i < groups else self._states_held).discard(key)
                    stats.put_failed += 1
        if self.events is not None:
            emit(self.events, "stored", self.name, put)
