"""The simulated world: real `HiCache` instances over fake engines' pools, on simulated devices,
with simulated store tiers, driven one operation at a time (`World.step`) and checked after each.

A world holds one or more engines (`Setup.instances`) on the same stores at the same time, each
its own `Node`: a HiCache over its own pool, on its own device. The engine here is the simplest
that embeds hicache as its docs say: it matches, allocates blocks, loads, "prefills" (writes the
oracle's bytes into its blocks, as a kernel on the device), stores, releases, and polls every
step. It reuses its token buffers once a request is released, as engines do. Every byte it
loads is checked when the device runs the read, that is after the copies enqueued before it, as
a GPU's kernel would see them.
"""

from __future__ import annotations

import gc
import os
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hicache import HiCache, PagedBuffer, load_config
from hicache.config import HiCacheConfig, Layout, tier_name
from hicache.core.native.books import Lease
from hicache.core.request import Match
from hicache.testing.device import SimDevice
from hicache.testing.faults import SPACES, Gate, SimTier, Space, damage_disk
from hicache.testing.oracle import Content, Oracle, Violation
from hicache.testing.workload import Op, Setup, call_fault, content_of


def _lease_dropped(lease: Lease) -> None:
    """A lease garbage-collected while it holds pins: they can never be released."""
    world = World.active
    books = lease._books
    if world is not None and lease.slots and any(b is books for b in world.slot_books):
        found = Violation(f"a lease of {len(lease.slots)} host slots was dropped holding its pins")
        world.failure = world.failure or found


Lease.__del__ = _lease_dropped  # type: ignore[attr-defined]

GC_EVERY = 100
"""Operations between collections of cyclic garbage (a lease dropped in a cycle shows then)."""
SETTLE_S = 120.0
"""How long a step waits for the worker threads to park or finish (a real deadlock fails)."""


@dataclass
class MooncakeMode:
    """Where the shared space's objects live: in memory (None), or in the real Mooncake store
    of the master at `address` (the long mode, `python -m hicache.testing.sim --mooncake`)."""

    address: str | None = None


MOONCAKE = MooncakeMode()
FETCH_MAX_WAIT_S = 3600.0
"""The policy's `fetch_max_wait_ms`, in simulated time: past it only where the simulation lets
it pass (a store that stalls while vLLM's worker waits)."""
READY_S = 30.0
"""How long a cache's tiers may take to become available when it opens (a disk tier lists a
few hundred records: well under a second)."""
STALL_SHARE = 0.05
"""The share of the direct engine's waits for a pending match in which the store stalls past
the fetch's deadline instead of answering."""
WAIT_STEPS = 8
"""Steps the direct engine waits for a pending match when it would load it (`World._wait`)."""


@dataclass
class Req:
    """The engine's side of one request."""

    content: Content
    tokens: np.ndarray  # the engine's token buffer (reused after release)
    node: int = 0  # the instance it runs on
    computed: int = 0
    partial: bool = False
    match: Match | None = None
    blocks: list[int] = field(default_factory=list)
    slot: int | None = None
    kv_pages: int = 0  # leading pages whose KV the engine has written (or loaded)
    decoded: int = 0  # output tokens stored so far (a later store extends them)
    prefilled: bool = False


class SimStates:
    """State hooks on a node's simulated device: a state is the oracle's at its boundary."""

    def __init__(self, node: Node, slots: int, state_bytes: int, history: int) -> None:
        self.node = node
        self.state_bytes, self.history_tokens = state_bytes, history
        self.pool = torch.zeros(slots, state_bytes, dtype=torch.uint8)
        self.content: dict[int, Content] = {}  # what each slot has processed
        self.processed: dict[int, int] = {}

    def save_state(self, slot: int, boundary: int, out: torch.Tensor) -> None:
        n = self.processed[slot]
        if boundary < n - self.history_tokens or boundary > n:
            raise ValueError(f"boundary {boundary} is outside the slot's history")
        oracle = self.node.world.oracle
        data = torch.from_numpy(oracle.state(self.content[slot], boundary).copy())
        host = self.node.state_slot_of(out)
        self.node.device.run_later(lambda: out.copy_(data), ("state", (host,)))

    def load_state(self, slot: int, boundary: int, src: torch.Tensor) -> None:
        self.node.device.run_later(lambda: self.pool[slot].copy_(src))


class Node:
    """One HiCache of the world over its own engine pool, on its own simulated device: a direct
    engine's instance, or one TP rank of a vLLM instance. `identity`: what its pages' bytes
    depend on beyond the request (`Content.identity`)."""

    def __init__(self, world: World, index: int, identity: str = "", codec: bool = False) -> None:
        self.world = world
        self.index = index
        self.identity = identity
        self.codec = codec
        self.cache: HiCache | None = None
        self.closer: Callable[[], None] | None = None
        """Closes the cache where its owner does (vLLM's worker), else `HiCache.close`."""
        self.device = SimDevice()
        self.gpu: PagedBuffer | None = None
        self.layout: Layout | None = None
        self.states: SimStates | None = None
        self.config = world.node_config(self)
        # the direct engine's side of this instance
        self.reqs: dict[str, Req] = {}
        self.buffers: list[np.ndarray] = []  # free token buffers, reused last-in first-out
        self.free_blocks: list[int] = []
        self.free_slots: list[int] = []

    def attach(self, cache: HiCache) -> None:
        """Put `cache` on this node's device and the world's clock, once its tiers are ready."""
        self.cache = cache
        cache._transfers.sim_device = self.device
        self.world.slot_books += [cache.host.page_slots._books, cache.host.state_slots._books]
        _wait_ready(cache)
        self.device.to_host = cache._routes.to_host
        self.guard_reserve(cache)
        chain = cache._chain
        if chain is not None:  # the simulation's clock, for deadlines, rates and breakers
            clock = self.world.clock
            chain.clock = clock
            for link in chain.links:
                link.clock = clock
                link.breaker._clock = clock
        self.world.instrument(self, cache)

    @property
    def links(self) -> list[Any]:
        cache = self.cache
        return [] if cache is None or cache._chain is None else cache._chain.links

    def lacks(self, name: str) -> bool:
        """Whether this node's host tier lacks the last page of object `name` (a request may
        read the object from a store tier)."""
        key = bytes.fromhex(name.rsplit("/", 1)[-1])
        return self.cache is None or len(key) != 16 or key not in self.cache.host.page_slots

    def sim_tiers(self) -> list[SimTier]:
        return [link.store for link in self.links if isinstance(link.store, SimTier)]

    def state_slot_of(self, out: torch.Tensor) -> int:
        host = self._cache().host
        first = host.state(0)
        return (out.data_ptr() - first.data_ptr()) // max(1, first.numel())

    def _cache(self) -> HiCache:
        if self.cache is None:
            raise RuntimeError("the cache is closed")
        return self.cache

    def write_block(self, block: int, data: np.ndarray) -> None:
        at = 0
        assert self.gpu is not None
        for seg in self.gpu.segments:
            width = seg.shape[1]
            seg[block].copy_(torch.from_numpy(data[at : at + width].copy()))
            at += width

    def block(self, block: int) -> np.ndarray:
        assert self.gpu is not None
        return torch.cat([seg[block] for seg in self.gpu.segments]).numpy()

    # -- invariants ---------------------------------------------------------------------------

    def check(self, live: set[str]) -> None:
        """The node's books and host memory: consistent, every published slot holds its key's
        bytes, no released request kept, no pin without a request (`live`: its requests)."""
        cache, oracle = self._cache(), self.world.oracle
        pages = cache.host.page_slots
        try:
            pages.check()
            cache.host.state_slots.check()
        except AssertionError as err:
            raise Violation(f"host slot books: {err}") from None
        pending = self.device.pending_host("page")
        host = np.concatenate([seg.numpy() for seg in cache.host.pages.segments], axis=1)
        key_of = pages._books.key_of
        for slot in range(pages.capacity):
            key = key_of(slot)
            if key is None or slot in pending:
                continue
            want = oracle.expected_page(key)
            if want is not None and not np.array_equal(host[slot], want):
                raise Violation(f"host slot {slot} holds other bytes than its key's page")
        if self.states is not None:
            self._check_states()
        stray = set(cache._requests) - live
        if stray:
            raise Violation(f"the cache keeps released requests: {sorted(stray)[:3]}")
        for link in self.links:
            self._check_held(link)
        quiet = self.device.idle and not cache._transfers.in_flight and cache.tiers_idle
        if not live and quiet and not self.world.space.gate.parked:
            reserve = sum(len(ln.fetcher.reserve.slots) for ln in self.links)
            if pages.pinned != reserve:
                raise Violation(f"{pages.pinned - reserve} host pages pinned with no request")

    @staticmethod
    def _check_held(link: Any) -> None:
        """Once a link has applied every answer of its tier, it takes as held no object that
        the tier said it lacks after the link learned it (a group the tier dropped is put
        again by a later store)."""
        tier = link.store
        if not isinstance(tier, SimTier) or link.jobs_in_flight or link._results:
            return
        books = link.fetcher
        for name, said in tier.said_absent.items():
            kind, key = name.rsplit("/", 2)[1:]
            held = books._states_held if kind == "s" else books._held
            learned = held.get(bytes.fromhex(key))
            if learned is not None and learned < said:
                raise Violation(f"tier {link.name} takes as held {key[:16]}, which the tier "
                                "said it lacks")  # fmt: skip
        tier.said_absent.clear()

    def _check_states(self) -> None:
        states = self._cache().host.state_slots
        pending = self.device.pending_host("state")
        for slot in range(states.capacity):
            key = states._books.key_of(slot)
            if key is None or slot in pending:
                continue
            want = self.world.oracle.expected_state(key)
            got = self._cache().host.state(slot).numpy()
            if want is not None and not np.array_equal(got, want):
                raise Violation(f"host state slot {slot} holds other bytes than its key's state")

    def check_put(self, name: str, data: bytes, pieces: list[tuple[int, int]]) -> None:
        """A put of this node's reads host memory (a worker thread): none of it may be waiting
        for a copy, and it holds the pages its name says."""
        cache = self.cache
        if cache is None:
            return
        if self.device.pending_host("page") & self._slots_of(pieces):
            raise Violation(f"a put read host slot(s) of {name[-8:]} before their copy")
        self.world.oracle.check_put(name, data)

    def _slots_of(self, pieces: list[tuple[int, int]]) -> set[int]:
        """The host page slots that `pieces` (address, bytes) lie in."""
        cache = self._cache()
        seg = cache.host.pages.segments[0]
        base, stride, cap = seg.data_ptr(), seg.stride(0), cache.host.page_slots.capacity
        out: set[int] = set()
        for ptr, size in pieces:
            if base <= ptr < base + cap * stride:
                out.update(range((ptr - base) // stride, (ptr + size - 1 - base) // stride + 1))
        return out

    def check_get(self, name: str, pieces: list[tuple[int, int]]) -> None:
        """A get of this node's writes into host memory (a worker thread): only into page slots
        reserved for it, that is pinned and holding no key."""
        if self.cache is None:
            return
        books = self.cache.host.page_slots._books
        for slot in sorted(self._slots_of(pieces)):
            if books.refs(slot) == 0 or books.key_of(slot) is not None:
                raise Violation(
                    f"a get of {name[-8:]} writes into host slot {slot}, which is not reserved "
                    "for it"
                )

    def guard_reserve(self, cache: HiCache) -> None:
        """Check every reserve of `cache`'s host slots: a slot it hands out was free or idle
        (the reserve's own pin is its only one), never taken from under a pin."""
        for pool in (cache.host.page_slots, cache.host.state_slots):
            reserve, books = pool.reserve, pool._books

            def guarded(n: int, reserve: Any = reserve, books: Any = books) -> Any:
                lease = reserve(n)
                for slot in lease.slots:
                    if books.refs(slot) != 1:
                        raise Violation(f"host slot {slot} was evicted while pinned")
                return lease

            pool.reserve = guarded  # type: ignore[method-assign]

    def close_cache(self) -> None:
        """Finish the device's work and close the cache (the parked calls go on by themselves
        once the gate opens: they then run in real time, so what they read must not depend on
        how fast they woke: the device's queued work runs first)."""
        cache = self.cache
        if cache is None:
            return
        self.device.advance()
        self.world.space.gate.open()
        self.device.advance()
        cache.poll()
        (self.closer or cache.close)()
        self.cache = None


def _wait_ready(cache: HiCache) -> None:
    """The host pools allocated, registered with every store tier, and every disk listed
    (whether a store is down is the simulation's, not the wall clock's)."""
    deadline = time.monotonic() + READY_S
    links = [] if cache._chain is None else cache._chain.links
    while not (
        cache.host.ready
        and all(link._registered.is_set() for link in links)
        and all(link.store.inner is None or link.store.inner.available for link in links)
    ):
        if time.monotonic() > deadline:
            raise Violation(f"the cache's tiers did not become available in {READY_S} s")
        time.sleep(0.001)


class World:
    """One seed's world (see the module docstring). `close` checks that nothing leaked."""

    active: World | None = None
    """The world running in this process (a dropped lease is reported to it)."""

    def __init__(self, setup: Setup, name: str) -> None:
        self.setup = setup
        self.name = name
        self.dir = tempfile.mkdtemp(prefix="hicache-sim-")
        self.space = SPACES[name] = self._space()
        self.now = 0.0
        self.up_at = -1  # the operation at which the shared store comes back up
        self.roomy_at = -1  # the operation at which the shared store is no longer full
        self.sound_at = -1  # the operation at which its `available` no longer raises
        self.rng = random.Random(f"{name}/engine")  # the faults of calls served while waiting
        self.log: list[str] = []
        self.failure: Violation | None = None  # one found on another thread, raised by `check`
        P, size = setup.page_tokens, setup.page_bytes
        self.oracle = Oracle(size, setup.state_bytes, P, setup.compressible)
        self.slot_books: list[Any] = []  # the caches' slot books (see `_lease_dropped`)
        World.active = self
        self._threads_before = set(threading.enumerate())  # others' (the leak check skips them)
        self.nodes: list[Node] = []
        self._build()

    def _build(self) -> None:
        """Make and open the world's nodes (the direct engine: one per instance)."""
        for i, codec in enumerate(self.setup.codecs):
            node = Node(self, i, codec=codec)
            self.nodes.append(node)
            self._open(node)

    # -- building -----------------------------------------------------------------------------

    def node_config(self, node: Node) -> HiCacheConfig:
        """The configuration of `node`'s cache: the host tier, and the world's store tiers as
        this node sees them (the shared space; its own private spaces and disk directories)."""
        s, n = self.setup, node.index
        tiers: list[dict[str, Any]] = [{
            "type": "host", "size": s.host_pages * s.page_bytes, "state_slots": s.host_states,
            "policy": s.policy,
        }]  # fmt: skip
        for i, (kind, write, G) in enumerate(s.stores):
            tier = {
                "type": "sim", "name": f"{kind}{i}n{n}", "space": self.name, "write": write,
                "group_pages": G, "fetch_workers": s.fetch_workers, "breaker_failures": 3,
                "breaker_reprobe_s": 0.2, "fetch_reserve": s.reserve_pages * s.page_bytes,
                "close_timeout_s": 30.0, "node": n,
            }  # fmt: skip
            if kind == "private":  # its own objects, behind the same gate
                private = f"{self.name}-private{i}n{n}"
                if private not in SPACES:
                    SPACES[private] = self._space(self.space.gate)
                tier.update(private=True, space=private)
            if kind == "memory":
                tier["prefix"] = s.prefix_reads
                if MOONCAKE.address is not None:  # a real Mooncake store, this world's objects
                    tier.update(mooncake=MOONCAKE.address, key_prefix=self.name)
            if kind == "disk":
                tier["disk"] = os.path.join(self.dir, f"disk{i}n{n}")
                tier["disk_size"] = s.disk_objects * (G * s.page_bytes + 2 * 4096)
            if node.codec:  # decoded on the worker thread: the sim schedules no codec threads
                tier.update(codec="lossless", codec_threads=1)
            tiers.append(tier)
        policy = {
            "fetch_max_wait_ms": FETCH_MAX_WAIT_S * 1e3, "prefix_memo": s.memo,
            "state_boundaries": s.state_boundaries,
        }  # fmt: skip
        layout = {
            "model": "sim-model", "kv_dtype": "bfloat16", "page_tokens": s.page_tokens,
            "page_bytes": s.page_bytes, "state_bytes": s.state_bytes,
        }  # fmt: skip
        return load_config({"layout": layout, "tiers": tiers, "policy": policy}, env={})

    def _open(self, node: Node) -> None:
        s = self.setup
        self.space.gate.auto = False
        node.device = SimDevice()
        layout = node.config.layout
        assert layout is not None
        if s.layers:
            seg = s.page_bytes // s.layers
            pool = [torch.zeros(s.blocks, seg, dtype=torch.uint8) for _ in range(s.layers)]
            gpu = PagedBuffer.layer_first(pool)
            layout = layout.model_copy(update={"segments": (seg,) * s.layers, "page_bytes": 0})
        else:
            gpu = PagedBuffer.page_first(torch.zeros(s.blocks, s.page_bytes, dtype=torch.uint8))
        node.layout, node.gpu, node.states = layout, gpu, None
        if s.state_bytes:
            node.states = SimStates(node, s.blocks, s.state_bytes, s.history_tokens)
        cache = HiCache(node.config, gpu, layout=layout, states=node.states, layers=s.layers)
        node.attach(cache)
        node.free_blocks = list(range(s.blocks - 1, -1, -1))
        node.free_slots = list(range(s.blocks - 1, -1, -1))
        node.reqs = {}

    def clock(self) -> float:
        return self.now

    def _space(self, gate: Gate | None = None) -> Space:
        """A store of this world (behind `gate`, else a gate of its own)."""
        space = Space(gate or Gate(), on_put=self._on_put, on_get=self._on_get, clock=self.clock)
        space.report = self._report
        return space

    def _report(self, err: Exception) -> None:
        """A violation found on a worker thread: raised by the next `check`."""
        self.failure = self.failure or err  # type: ignore[assignment]

    def instrument(self, node: Node, cache: HiCache) -> None:
        """Learn the keys the cache gives each page it hashed for a match, and each stored page
        (before the request is released)."""
        store, match = cache.store, cache.match

        def matched(rid: str, tokens: Any, *args: Any, **kwargs: Any) -> Match:
            out = match(rid, tokens, *args, **kwargs)
            req = cache._requests.get(rid)
            content = self.content_of_match(node, rid, tokens)
            if req is not None and content is not None:
                self.oracle.learn(list(req.chain.hashed), content, f"match of {rid}")
            return out

        def recorded(rid: str, tokens: Any, *args: Any, **kwargs: Any) -> int:
            out = store(rid, tokens, *args, **kwargs)
            req = cache._requests.get(rid)
            if req is not None:
                content = self.content_of_store(node, rid, tokens)
                pages = len(tokens) // self.setup.page_tokens
                self.oracle.learn(req.chain.hash_to(pages)[:pages], content, f"store of {rid}")
            return out

        cache.store = recorded  # type: ignore[method-assign]
        cache.match = matched  # type: ignore[method-assign]

    def content_of_match(self, node: Node, rid: str, tokens: Any) -> Content | None:
        """What the tokens of a match of `rid` mean (None: a request the engine lost)."""
        return self.content_of_store(node, rid, tokens) if rid in node.reqs else None

    def content_of_store(self, node: Node, rid: str, tokens: Any) -> Content:
        c = node.reqs[rid].content
        return Content(tuple(int(t) for t in tokens), c.salt, c.lora, c.images, node.identity)

    def live(self, node: Node) -> set[str]:
        """The requests of `node` the engine has not released."""
        return set(node.reqs)

    def node_of(self, rid: str) -> Node | None:
        """The node (instance) that runs request `rid`, if any."""
        return next((node for node in self.nodes if rid in node.reqs), None)

    # -- one step -----------------------------------------------------------------------------

    def step(self, op: Op) -> None:
        """Apply `op`, let the worker threads settle, and check the invariants."""
        self.now += 0.01
        self.log.append(repr(op))
        if len(self.log) == self.up_at:
            self.space.down = False
        if len(self.log) == self.roomy_at:
            self.space.capacity = Space.capacity
        if len(self.log) == self.sound_at:
            self.space.raising = False
        if len(self.log) % GC_EVERY == 0:  # the garbage collector runs here only (see `sim`)
            gc.collect()
        getattr(self, "op_" + op[0])(*op[1:])
        self.settle()
        self._restart_killed()
        self.check()

    def _node(self, index: int) -> Node:
        return self.nodes[index % len(self.nodes)]

    def op_ask(
        self, rid: str, spec: tuple, computed_pages: int, partial: bool, inst: int = 0
    ) -> None:
        P = self.setup.page_tokens
        content = content_of(spec)
        n = len(content.tokens)
        node = self.node_of(rid) or self._node(inst)
        cache = node._cache()
        req = node.reqs.get(rid)
        if req is not None and req.prefilled:
            return  # running: it is released (finished, aborted, preempted) before asked again
        if req is None or req.content != content:
            reuse = node.buffers and "reuse-buffers" in self.setup.features
            buf = node.buffers.pop() if reuse else np.zeros(4096, dtype=np.int32)
            buf[:n] = content.tokens
            if req is not None:
                node.buffers.append(req.tokens)
                self._free(node, req)
            req = node.reqs[rid] = Req(content, buf, node.index)
        computed = min(computed_pages, (n - 1) // P) * P
        if req.match is None or not req.match.pending:
            req.computed = computed
        if req.computed and not self._own_prefix(node, req):
            return
        req.partial = partial
        req.match = cache.match(
            rid, req.tokens[:n], salt=content.salt, computed_tokens=req.computed, partial=partial
        )

    def _own_prefix(self, node: Node, req: Req) -> bool:
        """The engine's own prefix cache holds `req.computed` tokens: written into its blocks."""
        if not self._blocks(node, req):
            return False
        pages = req.computed // self.setup.page_tokens
        if req.kv_pages < pages:
            self._compute(node, req, req.kv_pages, pages)
        return True

    def _blocks(self, node: Node, req: Req) -> bool:
        need = -(-(len(req.content.tokens) + self.setup.decode_max) // self.setup.page_tokens)
        if len(req.blocks) >= need:
            return True
        if need - len(req.blocks) > len(node.free_blocks):
            return False
        req.blocks += [node.free_blocks.pop() for _ in range(need - len(req.blocks))]
        if node.states is not None and req.slot is None:
            req.slot = node.free_slots.pop()
        return True

    def _compute(
        self, node: Node, req: Req, lo: int, hi: int, content: Content | None = None
    ) -> None:
        """The engine's prefill of pages [lo, hi): a kernel writing the oracle's KV."""
        content = self._mine(node, content or req.content)
        P, blocks = self.setup.page_tokens, list(req.blocks)
        pages = [(blocks[i], self.oracle.page(content, (i + 1) * P)) for i in range(lo, hi)]

        def write() -> None:
            for block, data in pages:
                node.write_block(block, data)

        node.device.run_later(write)
        req.kv_pages = max(req.kv_pages, hi)

    @staticmethod
    def _mine(node: Node, content: Content) -> Content:
        """`content` as `node` computes it (its identity)."""
        c = content
        return Content(c.tokens, c.salt, c.lora, c.images, node.identity)

    def op_load(self, rid: str, by_layer: bool, skip: float) -> None:
        node = self.node_of(rid)
        req = None if node is None else node.reqs.get(rid)
        if node is None or req is None or req.match is None:
            return
        if req.match.pending and not self._wait(node, rid, req):
            return
        if req.prefilled or not self._blocks(node, req):
            return
        m, P = req.match, self.setup.page_tokens
        hit_page, first = m.hit_tokens // P, m.computed_tokens // P
        start = m.head_tokens // P if m.head_tokens else first
        if not m.head_tokens and m.load_pages and skip:
            start = first + int(skip * m.load_pages)
        if start > first:
            self._compute(node, req, first, start)  # the engine computes the head itself
        slot = req.slot if m.needs_state else None
        req.match = None
        node._cache().load(
            m, req.blocks[first:], slot, by_layer=by_layer and bool(self.setup.layers),
            from_token=start * P if start > first else None,
        )  # fmt: skip
        self._check_loaded(node, rid, req, start, hit_page, m)
        n = len(req.content.tokens)
        if node.states is not None and req.slot is not None:
            node.states.content[req.slot] = self._mine(node, req.content)
            node.states.processed[req.slot] = n
        self._compute(node, req, hit_page, n // P)
        req.prefilled = True

    def _wait(self, node: Node, rid: str, req: Req) -> bool:
        """The engine waits a few steps for a pending match: the store answers the fetches'
        calls parked meanwhile (each with a fault drawn from the world's own generator), or
        now and then stalls past the fetch's deadline, and it asks again. Whether the answer
        came."""
        cache, n = node._cache(), len(req.content.tokens)
        for _ in range(WAIT_STEPS):
            fetch = cache._requests[rid].fetch
            if fetch is None or not fetch.busy:
                break
            if self.rng.random() < STALL_SHARE:  # the store stalls past the fetch's deadline
                self.now += FETCH_MAX_WAIT_S
                break
            node.device.advance(2)  # the device goes on meanwhile
            self.settle()
            self.serve()
            cache.poll()
        req.match = cache.match(
            rid, req.tokens[:n], salt=req.content.salt, computed_tokens=req.computed,
            partial=req.partial,
        )  # fmt: skip
        return not req.match.pending

    def serve(self) -> None:
        """The store answers every call parked now, in the gate's order, each with a fault
        drawn from the world's generator."""
        gate = self.space.gate
        for call in gate.sorted():
            gate.release_call(call, call_fault(self.rng, self.setup, call.op))
            self.settle()

    def _check_loaded(self, node: Node, rid: str, req: Req, lo: int, hi: int, m: Match) -> None:
        """A kernel that reads the loaded pages (and state) and checks them."""
        P, content = self.setup.page_tokens, self._mine(node, req.content)
        oracle = self.oracle
        wanted = [(i, req.blocks[i], oracle.page(content, (i + 1) * P)) for i in range(lo, hi)]
        state = None
        states = node.states
        if m.needs_state and states is not None:
            state = (req.slot, oracle.state(content, m.hit_tokens))

        def read() -> None:
            for i, block, want in wanted:
                if not np.array_equal(node.block(block), want):
                    raise Violation(f"request {rid}: page {i} loaded wrong bytes")
            got = None if state is None or states is None else states.pool[state[0]].numpy()
            if state is not None and not np.array_equal(got, state[1]):
                raise Violation(f"request {rid}: wrong state at {m.hit_tokens}")

        node.device.run_later(read)

    def op_store(self, rid: str, decode: int) -> None:
        node = self.node_of(rid)
        req = None if node is None else node.reqs.get(rid)
        if node is None or req is None or not req.prefilled:
            return
        P, n = self.setup.page_tokens, len(req.content.tokens)
        req.decoded = max(req.decoded, min(decode, self.setup.decode_max))
        extra = tuple(range(7, 7 + req.decoded))
        content = req.content.extended(extra)
        total = n + len(extra)
        req.tokens[n:total] = extra
        pages = total // P
        if pages > req.kv_pages:
            self._compute(node, req, req.kv_pages, pages, content)
        if node.states is not None and req.slot is not None:
            node.states.content[req.slot] = self._mine(node, content)
            node.states.processed[req.slot] = total
        node._cache().store(rid, req.tokens[:total], req.blocks, req.slot)

    def op_release(self, rid: str) -> None:
        node = self.node_of(rid)
        if node is None:
            return
        req = node.reqs.pop(rid)
        node._cache().release(rid)
        self._free(node, req)
        node.buffers.append(req.tokens)

    def _free(self, node: Node, req: Req) -> None:
        node.free_blocks += reversed(req.blocks)
        if req.slot is not None:
            node.free_slots.append(req.slot)
            if node.states is not None:
                node.states.content.pop(req.slot, None)
        req.blocks, req.slot, req.kv_pages, req.prefilled, req.decoded = [], None, 0, False, 0

    def op_device(self, n: int, inst: int = 0) -> None:
        self._node(inst).device.advance(n if n > 0 else None)

    def op_poll(self, inst: int = 0) -> None:
        self._node(inst)._cache().poll()

    def op_call(self, index: int, fault: str | None) -> None:
        self.space.gate.release(index, fault)

    def op_drain(self) -> None:
        """The store answers every call parked now (in the gate's order, no fault)."""
        for _ in range(len(self.space.gate.parked)):
            if self.space.gate.release(0, None) is None:
                break
            self.settle()

    def op_space(self, what: str, arg: int, target: int = 0) -> None:
        """A fault at rest, or the shared store down, back, full or restarted. `target` picks
        where damage at rest lands: the shared space, or a node's private space or disk."""
        space = self.space
        if what == "down":  # for a few operations (or until an "up")
            space.down = True
            self.up_at = len(self.log) + arg % 16 + 1
        elif what == "up":
            space.down = False
        elif what == "restart":
            space.restart()
            for _ in range(len(space.remote)):  # a Mooncake store's objects
                self._lose(0)
        elif what == "full":  # for a few operations
            space.capacity = arg * self.setup.page_bytes
            self.roomy_at = len(self.log) + arg % 16 + 1
        elif what == "raising":  # its `available` raises, for a few operations
            space.raising = True
            self.sound_at = len(self.log) + arg % 4 + 1
        else:
            self._damage(what, arg, target)

    def _damage(self, how: str, index: int, target: int) -> None:
        """Damage an object at rest where `target` says (mod the places the world has). A
        stray entry in a disk tier's directory matters when the tier lists it: its process
        restarts then."""
        places: list[tuple[Space | str, int, Node | None]] = []  # where; whose
        if any(kind == "memory" for kind, _, _ in self.setup.stores):
            places.append((self.space, -1, None))
        for i, nodes in enumerate(self.processes()):
            for node, tier in ((n, tier) for n in nodes for tier in n.sim_tiers()):
                if tier.config.disk is not None and not tier.dead:
                    places.append((tier.config.disk, i, node))
                elif tier.config.private:
                    places.append((tier.space, i, node))
        if not places:
            return
        place, process, owner = places[target % len(places)]
        if place is self.space and MOONCAKE.address is not None:
            if how == "lost":
                self._lose(index)
        elif isinstance(place, Space):
            place.damage(index, how)
        else:
            damage_disk(place, index, how, owner.lacks if owner is not None else lambda n: True)
            if how == "stray":
                self.restart(process)

    def _lose(self, index: int) -> None:
        """Remove an object from the Mooncake store behind the shared space (through a tier of
        an open node)."""
        for node in self.nodes:
            for tier in node.sim_tiers():
                if tier.config.mooncake is not None:
                    tier.lose(index)
                    return

    def op_reopen(self, index: int = 0, codec: bool = False) -> None:
        """The process of node `index` (of all its instance's ranks) restarts cleanly; with
        `codec`, its stores' codec turned on or off (in a world whose bytes compress)."""
        i = index // self.setup.tp % len(self.processes())
        if codec and self.setup.compressible:
            for node in self.processes()[i]:
                node.codec = not node.codec
                node.config = self.node_config(node)
        self.restart(i)

    def op_kill(self, inst: int, point: str) -> None:
        """The process of instance `inst` is to die at `point` of its disk tier's next record
        write (see `faults.KillableDisk`); it restarts on the same directory after."""
        for tier in self._node(inst).sim_tiers():
            if tier.config.disk is not None:
                tier.arm(point)

    def _restart_killed(self) -> None:
        """Restart each process one of whose disk tiers was killed: new caches on the same
        stores, its disk directory taken over as after a crash."""
        for i, nodes in enumerate(self.processes()):
            if any(tier.dead for node in nodes for tier in node.sim_tiers()):
                self.restart(i)
                self.settle()

    def processes(self) -> list[list[Node]]:
        """The nodes of each engine instance (restarted together)."""
        return [[node] for node in self.nodes]

    def restart(self, i: int) -> None:
        """Close instance `i`'s caches and open new ones on the same stores."""
        self.release_all(i)
        for node in self.processes()[i]:
            node.close_cache()
        self._check_leaks()
        self.reopen(i)

    def release_all(self, i: int) -> None:
        """The engine of instance `i` releases every request."""
        for rid in list(self.nodes[i].reqs):
            self.op_release(rid)

    def reopen(self, i: int) -> None:
        """Open instance `i`'s caches again."""
        self._open(self.nodes[i])

    # -- invariants ---------------------------------------------------------------------------

    def settle(self) -> None:
        """Wait until every worker thread is parked at the gate or a device, or idle."""
        deadline = time.monotonic() + SETTLE_S
        while not self._settled():
            if time.monotonic() > deadline:
                raise Violation(f"worker threads did not settle in {SETTLE_S} s: a call hangs")
            time.sleep(0.0002)

    def _settled(self) -> bool:
        """Every job of every link is posted, or queued or running on a blocked worker."""
        blocked = {c.thread for c in self.space.gate.parked}
        for node in self.nodes:
            blocked |= node.device.waiting
        for node in self.nodes:
            for link in node.links:
                self._check_workers(link)
                queues = [(f"fetch-{i}", q) for i, q in enumerate(link._fetch_jobs)]
                queues.append(("put", link._put_jobs))
                held = 0
                for name, jobs in queues:
                    thread = f"hicache-{link.name}-{name}"
                    if thread in blocked:
                        held += 1 + jobs.qsize()
                    elif jobs.qsize():
                        return False
                if link.jobs_in_flight != len(link._results) + held:
                    return False
        return True

    @staticmethod
    def _check_workers(link: Any) -> None:
        """A link with jobs in flight has every worker thread alive (one that died leaves its
        jobs unanswered for good)."""
        dead = [t.name for t in link._threads if not t.is_alive()]
        if dead and link.jobs_in_flight:
            raise Violation(f"worker thread {dead[0]} died with jobs in flight")

    def check(self) -> None:
        if self.failure is not None:
            raise self.failure
        for node in self.nodes:
            node.check(self.live(node))

    def _on_get(self, name: str, pieces: list[tuple[int, int]], node: int) -> None:
        """A get of node `node`'s store tier is about to write into host memory (a worker
        thread)."""
        try:
            self.nodes[node].check_get(name, pieces)
        except Violation as err:
            self.failure = self.failure or err
            raise

    def _on_put(self, name: str, data: bytes, pieces: list[tuple[int, int]], node: int) -> None:
        """A store tier of node `node` reads host memory for a put (a worker thread)."""
        try:
            self.nodes[node].check_put(name, data, pieces)
        except Violation as err:
            self.failure = self.failure or err
            raise

    # -- teardown -----------------------------------------------------------------------------

    def close(self, final: bool = True) -> None:
        """Finish the devices' work, let every call through, close the caches and check that
        they left no thread, registration or open file behind."""
        try:
            for i, nodes in enumerate(self.processes()):
                self.release_all(i)
                for node in nodes:
                    node.close_cache()
            self._check_leaks()
        finally:  # whatever went wrong, the next world of this name starts afresh
            if final:
                gc.collect()  # a lease dropped in a cycle of this world's garbage shows now
                World.active = None
                for name in [n for n in SPACES if n == self.name or n.startswith(self.name + "-")]:
                    del SPACES[name]
                shutil.rmtree(self.dir, ignore_errors=True)

    def _check_leaks(self) -> None:
        """No thread of a closed cache alive, no host memory still registered with a store, no
        file of a closed cache open."""
        open_nodes = [n for n in self.nodes if n.cache is not None]
        closed = tuple(
            f"hicache-{tier_name(tier)}-"
            for n in self.nodes
            if n.cache is None
            for tier in n.config.tiers[1:]
        )
        deadline = time.monotonic() + 30
        while True:  # with caches still open, the threads named after a closed one's tiers
            alive = [
                t.name
                for t in set(threading.enumerate()) - self._threads_before
                if t.name.startswith(closed if open_nodes else "hicache")
            ]
            if not alive:
                break
            if time.monotonic() > deadline:
                raise Violation(f"threads alive after close: {alive}")
            time.sleep(0.01)
        tiers = [t for n in open_nodes for t in n.sim_tiers()]
        spaces = [SPACES[n] for n in SPACES if n == self.name or n.startswith(self.name + "-")]
        for space in spaces:
            if space.registered != sum(t._registered for t in tiers if t.space is space):
                raise Violation("host memory still registered with a store after close")
        open_files = []
        dirs = [t.config.disk for t in tiers if t.config.disk]
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if target.startswith(self.dir) and not any(target.startswith(d) for d in dirs):
                open_files.append(target)
        if open_files:
            raise Violation(f"files of the cache open after close: {open_files[:3]}")
