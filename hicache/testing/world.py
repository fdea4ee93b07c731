"""The simulated world: a real `HiCache` over a fake engine's pool, on the simulated device, with
simulated store tiers, driven one operation at a time (`World.step`) and checked after each.

The engine here is the simplest that embeds hicache as its docs say: it matches, allocates
blocks, loads, "prefills" (writes the oracle's bytes into its blocks, as a kernel on the
device), stores, releases, and polls every step. It reuses its token buffers once a request is
released, as engines do. Every byte it loads is checked when the device runs the read, that is
after the copies enqueued before it, as a GPU's kernel would see them.
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hicache import HiCache, PagedBuffer, load_config
from hicache.config import HiCacheConfig, Layout
from hicache.core.native.books import Lease
from hicache.core.request import Match
from hicache.testing.device import SimDevice
from hicache.testing.faults import SPACES, Space
from hicache.testing.oracle import Content, Oracle, Violation
from hicache.testing.workload import Op, Setup, content_of


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
class Req:
    """The engine's side of one request."""

    content: Content
    tokens: np.ndarray  # the engine's token buffer (reused after release)
    computed: int = 0
    match: Match | None = None
    blocks: list[int] = field(default_factory=list)
    slot: int | None = None
    kv_pages: int = 0  # leading pages whose KV the engine has written (or loaded)
    decoded: int = 0  # output tokens stored so far (a later store extends them)
    prefilled: bool = False


class SimStates:
    """State hooks on the simulated device: a state is the oracle's at its boundary."""

    def __init__(self, world: World, slots: int, state_bytes: int, history: int) -> None:
        self.world = world
        self.state_bytes, self.history_tokens = state_bytes, history
        self.pool = torch.zeros(slots, state_bytes, dtype=torch.uint8)
        self.content: dict[int, Content] = {}  # what each slot has processed
        self.processed: dict[int, int] = {}

    def save_state(self, slot: int, boundary: int, out: torch.Tensor) -> None:
        n = self.processed[slot]
        if boundary < n - self.history_tokens or boundary > n:
            raise ValueError(f"boundary {boundary} is outside the slot's history")
        data = torch.from_numpy(self.world.oracle.state(self.content[slot], boundary).copy())
        host = self.world.state_slot_of(out)
        self.world.device.run_later(lambda: out.copy_(data), ("state", (host,)))

    def load_state(self, slot: int, boundary: int, src: torch.Tensor) -> None:
        self.world.device.run_later(lambda: self.pool[slot].copy_(src))


class World:
    """One seed's world (see the module docstring). `close` checks that nothing leaked."""

    active: World | None = None
    """The world running in this process (a dropped lease is reported to it)."""

    def __init__(self, setup: Setup, name: str) -> None:
        self.setup = setup
        self.name = name
        self.dir = tempfile.mkdtemp(prefix="hicache-sim-")
        self.space = SPACES[name] = Space()
        self.space.on_put = self._on_put
        for i, (kind, _, _) in enumerate(setup.stores):
            if kind == "private":  # its own objects, behind the same gate
                SPACES[f"{name}-private{i}"] = Space(self.space.gate, on_put=self._on_put)
        self.now = 0.0
        self.log: list[str] = []
        self.failure: Violation | None = None  # one found on another thread, raised by `check`
        P, size = setup.page_tokens, setup.page_bytes
        self.oracle = Oracle(size, setup.state_bytes, P)
        self.config = self._config()
        self.cache: HiCache | None = None
        self.buffers: list[np.ndarray] = []  # free token buffers, reused last-in first-out
        World.active = self
        self.slot_books: list[Any] = []  # the cache's slot books (see `_lease_dropped`)
        self._threads_before = set(threading.enumerate())  # others' (the leak check skips them)
        self._open()

    # -- building -----------------------------------------------------------------------------

    def _config(self) -> HiCacheConfig:
        s = self.setup
        tiers: list[dict[str, Any]] = [
            {"type": "host", "size": s.host_pages * s.page_bytes, "state_slots": s.host_states}
        ]
        for i, (kind, write, G) in enumerate(s.stores):
            tier = {
                "type": "sim", "name": f"{kind}{i}", "space": self.name, "write": write,
                "group_pages": G, "fetch_workers": s.fetch_workers, "breaker_failures": 3,
                "breaker_reprobe_s": 5.0, "fetch_reserve": s.reserve_pages * s.page_bytes,
                "close_timeout_s": 30.0,
            }  # fmt: skip
            if kind == "private":
                tier["private"] = True
                tier["space"] = f"{self.name}-private{i}"
            if kind == "disk":
                tier["disk"] = os.path.join(self.dir, f"disk{i}")
                tier["disk_size"] = 64 * G * s.page_bytes
            if s.codec:  # decoded on the worker thread: the sim schedules no codec threads
                tier.update(codec="lossless", codec_threads=1)
            tiers.append(tier)
        policy = {"fetch_max_wait_ms": 3.6e6, "prefix_memo": s.memo, "state_boundaries": 2}
        layout = {
            "model": "sim-model", "kv_dtype": "bfloat16", "page_tokens": s.page_tokens,
            "page_bytes": s.page_bytes, "state_bytes": s.state_bytes,
        }  # fmt: skip
        return load_config({"layout": layout, "tiers": tiers, "policy": policy}, env={})

    def _open(self) -> None:
        s = self.setup
        self.device = SimDevice()
        self.space.gate.auto = False
        layout = self.config.layout
        assert layout is not None
        if s.layers:
            seg = s.page_bytes // s.layers
            self.pool = [torch.zeros(s.blocks, seg, dtype=torch.uint8) for _ in range(s.layers)]
            gpu = PagedBuffer.layer_first(self.pool)
            layout = layout.model_copy(update={"segments": (seg,) * s.layers, "page_bytes": 0})
        else:
            self.pool = [torch.zeros(s.blocks, s.page_bytes, dtype=torch.uint8)]
            gpu = PagedBuffer.page_first(self.pool[0])
        self.layout: Layout = layout
        self.gpu = gpu
        self.states = None
        if s.state_bytes:
            self.states = SimStates(self, s.blocks, s.state_bytes, s.history_tokens)
        self.cache = HiCache(self.config, gpu, layout=layout, states=self.states, layers=s.layers)
        self._attach(self.cache)
        self.free_blocks = list(range(s.blocks - 1, -1, -1))
        self.free_slots = list(range(s.blocks - 1, -1, -1))
        self.reqs: dict[str, Req] = {}

    def _attach(self, cache: HiCache) -> None:
        """Put `cache` on the simulated device and clock, once its tiers are ready."""
        cache._transfers.sim_device = self.device
        self.slot_books += [cache.host.page_slots._books, cache.host.state_slots._books]
        self._wait_ready(cache)
        self.device.to_host = cache._routes.to_host
        chain = cache._chain
        if chain is not None:  # the simulation's clock, for deadlines, rates and breakers
            chain.clock = self.clock
            for link in chain.links:
                link.clock = self.clock
                link.breaker._clock = self.clock
        self._instrument(cache)

    def _live(self) -> set[str]:
        """The requests the engine has not released."""
        return set(self.reqs)

    @staticmethod
    def _wait_ready(cache: HiCache) -> None:
        """The host pools allocated, registered with every store tier, and every disk listed
        (whether a store is down is the simulation's, not the wall clock's)."""
        deadline = time.monotonic() + SETTLE_S
        links = [] if cache._chain is None else cache._chain.links
        while not (
            cache.host.ready
            and all(link._registered.is_set() for link in links)
            and all(link.store.inner is None or link.store.inner.available for link in links)
        ):
            if time.monotonic() > deadline:
                raise RuntimeError("the cache's tiers did not become ready")
            time.sleep(0.001)

    def clock(self) -> float:
        return self.now

    def _instrument(self, cache: HiCache) -> None:
        """Learn the keys the cache gives each page it hashed for a match, and each stored page
        (before the request is released)."""
        store, match = cache.store, cache.match

        def matched(rid: str, tokens: Any, *args: Any, **kwargs: Any) -> Match:
            out = match(rid, tokens, *args, **kwargs)
            req = cache._requests.get(rid)
            content = self.content_of_match(rid, tokens)
            if req is not None and content is not None:
                self.oracle.learn(list(req.chain.hashed), content, f"match of {rid}")
            return out

        def recorded(rid: str, tokens: Any, *args: Any, **kwargs: Any) -> int:
            out = store(rid, tokens, *args, **kwargs)
            req = cache._requests.get(rid)
            if req is not None:
                content = self.content_of_store(rid, tokens)
                pages = len(tokens) // self.layout.page_tokens
                self.oracle.learn(req.chain.hash_to(pages)[:pages], content, f"store of {rid}")
            return out

        cache.store = recorded  # type: ignore[method-assign]
        cache.match = matched  # type: ignore[method-assign]

    def content_of_match(self, rid: str, tokens: Any) -> Content | None:
        """What the tokens of a match of `rid` mean (None: a request the engine lost)."""
        return self.content_of_store(rid, tokens) if rid in self.reqs else None

    def content_of_store(self, rid: str, tokens: Any) -> Content:
        content = self.reqs[rid].content
        return Content(tuple(int(t) for t in tokens), content.salt, content.lora, content.images)

    # -- one step -----------------------------------------------------------------------------

    def step(self, op: Op) -> None:
        """Apply `op`, let the worker threads settle, and check the invariants."""
        self.now += 0.01
        self.log.append(repr(op))
        if len(self.log) % GC_EVERY == 0:  # the garbage collector runs here only (see `sim`)
            gc.collect()
        getattr(self, "op_" + op[0])(*op[1:])
        self.settle()
        self.check()

    def op_ask(self, rid: str, spec: tuple, computed_pages: int, partial: bool) -> None:
        cache, P = self._cache(), self.setup.page_tokens
        content = content_of(spec)
        n = len(content.tokens)
        req = self.reqs.get(rid)
        if req is not None and req.prefilled:
            return  # running: it is released (finished, aborted, preempted) before asked again
        if req is None or req.content != content:
            reuse = self.buffers and "reuse-buffers" in self.setup.features
            buf = self.buffers.pop() if reuse else np.zeros(4096, dtype=np.int32)
            buf[:n] = content.tokens
            if req is not None:
                self.buffers.append(req.tokens)
                self._free(req)
            req = self.reqs[rid] = Req(content, buf)
        computed = min(computed_pages, (n - 1) // P) * P
        if req.match is None or not req.match.pending:
            req.computed = computed
        if req.computed and not self._own_prefix(req):
            return
        req.match = cache.match(
            rid, req.tokens[:n], salt=content.salt, computed_tokens=req.computed, partial=partial
        )

    def _own_prefix(self, req: Req) -> bool:
        """The engine's own prefix cache holds `req.computed` tokens: written into its blocks."""
        if not self._blocks(req):
            return False
        pages = req.computed // self.setup.page_tokens
        if req.kv_pages < pages:
            self._compute(req, req.kv_pages, pages)
        return True

    def _blocks(self, req: Req) -> bool:
        need = -(-(len(req.content.tokens) + self.setup.decode_max) // self.setup.page_tokens)
        if len(req.blocks) >= need:
            return True
        if need - len(req.blocks) > len(self.free_blocks):
            return False
        req.blocks += [self.free_blocks.pop() for _ in range(need - len(req.blocks))]
        if self.states is not None and req.slot is None:
            req.slot = self.free_slots.pop()
        return True

    def _compute(self, req: Req, lo: int, hi: int, content: Content | None = None) -> None:
        """The engine's prefill of pages [lo, hi): a kernel writing the oracle's KV."""
        content = content or req.content
        P, blocks = self.setup.page_tokens, list(req.blocks)
        pages = [(blocks[i], self.oracle.page(content, (i + 1) * P)) for i in range(lo, hi)]

        def write() -> None:
            for block, data in pages:
                self._write_block(block, data)

        self.device.run_later(write)
        req.kv_pages = max(req.kv_pages, hi)

    def _write_block(self, block: int, data: np.ndarray) -> None:
        at = 0
        for seg in self.gpu.segments:
            width = seg.shape[1]
            seg[block].copy_(torch.from_numpy(data[at : at + width].copy()))
            at += width

    def _block(self, block: int) -> np.ndarray:
        return torch.cat([seg[block] for seg in self.gpu.segments]).numpy()

    def op_load(self, rid: str, by_layer: bool, skip: float) -> None:
        req = self.reqs.get(rid)
        if req is None or req.match is None or req.match.pending or req.prefilled:
            return
        if not self._blocks(req):
            return
        m, P = req.match, self.setup.page_tokens
        hit_page, first = m.hit_tokens // P, m.computed_tokens // P
        start = m.head_tokens // P if m.head_tokens else first
        if not m.head_tokens and m.load_pages and skip:
            start = first + int(skip * m.load_pages)
        if start > first:
            self._compute(req, first, start)  # the engine computes the head itself
        slot = req.slot if m.needs_state else None
        req.match = None
        self._cache().load(
            m, req.blocks[first:], slot, by_layer=by_layer and bool(self.setup.layers),
            from_token=start * P if start > first else None,
        )  # fmt: skip
        self._check_loaded(rid, req, start, hit_page, m)
        n = len(req.content.tokens)
        if self.states is not None and req.slot is not None:
            self.states.content[req.slot] = req.content
            self.states.processed[req.slot] = n
        self._compute(req, hit_page, n // P)
        req.prefilled = True

    def _check_loaded(self, rid: str, req: Req, lo: int, hi: int, m: Match) -> None:
        """A kernel that reads the loaded pages (and state) and checks them."""
        P, content = self.setup.page_tokens, req.content
        wanted = [(i, req.blocks[i], self.oracle.page(content, (i + 1) * P)) for i in range(lo, hi)]
        state = None
        if m.needs_state and self.states is not None:
            state = (req.slot, self.oracle.state(content, m.hit_tokens))

        def read() -> None:
            for i, block, want in wanted:
                if not np.array_equal(self._block(block), want):
                    raise Violation(f"request {rid}: page {i} loaded wrong bytes")
            if state is not None:
                got = self.states.pool[state[0]].numpy()  # type: ignore[union-attr]
                if not np.array_equal(got, state[1]):
                    raise Violation(f"request {rid}: wrong state at {m.hit_tokens}")

        self.device.run_later(read)

    def op_store(self, rid: str, decode: int) -> None:
        req = self.reqs.get(rid)
        if req is None or not req.prefilled:
            return
        P, n = self.setup.page_tokens, len(req.content.tokens)
        req.decoded = max(req.decoded, min(decode, self.setup.decode_max))
        extra = tuple(range(7, 7 + req.decoded))
        content = req.content.extended(extra)
        total = n + len(extra)
        req.tokens[n:total] = extra
        pages = total // P
        if pages > req.kv_pages:
            self._compute(req, req.kv_pages, pages, content)
        if self.states is not None and req.slot is not None:
            self.states.content[req.slot] = content
            self.states.processed[req.slot] = total
        self._cache().store(rid, req.tokens[:total], req.blocks, req.slot)

    def op_release(self, rid: str) -> None:
        req = self.reqs.pop(rid, None)
        self._cache().release(rid)
        if req is not None:
            self._free(req)
            self.buffers.append(req.tokens)

    def _free(self, req: Req) -> None:
        self.free_blocks += reversed(req.blocks)
        if req.slot is not None:
            self.free_slots.append(req.slot)
            if self.states is not None:
                self.states.content.pop(req.slot, None)
        req.blocks, req.slot, req.kv_pages, req.prefilled, req.decoded = [], None, 0, False, 0

    def op_device(self, n: int) -> None:
        self.device.advance(n if n > 0 else None)

    def op_poll(self) -> None:
        self._cache().poll()

    def op_call(self, index: int, fault: str | None) -> None:
        self.space.gate.release(index, fault)

    def op_space(self, what: str, arg: int) -> None:
        space = self.space
        if what == "down":
            space.down = True
        elif what == "up":
            space.down = False
        elif what == "restart":
            space.restart()
        elif what == "full":
            space.capacity = arg * self.setup.page_bytes
        elif what in ("lost", "truncated", "replaced"):
            space.damage(arg, what)

    def op_reopen(self) -> None:
        self.close(final=False)
        self._open()

    # -- invariants ---------------------------------------------------------------------------

    def settle(self) -> None:
        """Wait until every worker thread is parked at the gate or the device, or idle."""
        chain = self._cache()._chain
        if chain is None:
            return
        deadline = time.monotonic() + SETTLE_S
        while not self._settled(chain.links):
            if time.monotonic() > deadline:
                raise Violation(f"worker threads did not settle in {SETTLE_S} s: a call hangs")
            time.sleep(0.0002)

    def _settled(self, links: list[Any]) -> bool:
        """Every job of every link is posted, or queued or running on a blocked worker."""
        blocked = {c.thread for c in self.space.gate.parked} | self.device.waiting
        for link in links:
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

    def check(self) -> None:
        if self.failure is not None:
            raise self.failure
        cache = self._cache()
        pages = cache.host.page_slots
        try:
            pages.check()
            cache.host.state_slots.check()
        except AssertionError as err:
            raise Violation(f"host slot books: {err}") from None
        pending = self.device.pending_host("page")
        host = cache.host.pages
        for slot in range(pages.capacity):
            key = pages._books.key_of(slot)
            if key is None or slot in pending:
                continue
            want = self.oracle.expected_page(key)
            got = torch.cat([seg[slot] for seg in host.segments]).numpy()
            if want is not None and not np.array_equal(got, want):
                raise Violation(f"host slot {slot} holds other bytes than its key's page")
        if self.states is not None:
            self._check_states()
        stray = set(cache._requests) - self._live()
        if stray:
            raise Violation(f"the cache keeps released requests: {sorted(stray)[:3]}")
        quiet = self.device.idle and not cache._transfers.in_flight and cache.tiers_idle
        if not self._live() and quiet and not self.space.gate.parked:
            chain = cache._chain
            links = [] if chain is None else chain.links
            reserve = sum(len(ln.fetcher.reserve.slots) for ln in links)
            if pages.pinned != reserve:
                raise Violation(f"{pages.pinned - reserve} host pages pinned with no request")

    def _check_states(self) -> None:
        states = self._cache().host.state_slots
        pending = self.device.pending_host("state")
        for slot in range(states.capacity):
            key = states._books.key_of(slot)
            if key is None or slot in pending:
                continue
            want = self.oracle.expected_state(key)
            got = self._cache().host.state(slot).numpy()
            if want is not None and not np.array_equal(got, want):
                raise Violation(f"host state slot {slot} holds other bytes than its key's state")

    def _on_put(self, name: str, data: bytes, pieces: list[tuple[int, int]]) -> None:
        """A store tier reads host memory for a put (a worker thread): none of it may be waiting
        for a copy, and it holds the pages its name says."""
        try:
            self._check_put(name, data, pieces)
        except Violation as err:
            self.failure = self.failure or err
            raise

    def _check_put(self, name: str, data: bytes, pieces: list[tuple[int, int]]) -> None:
        cache = self.cache
        if cache is None:
            return
        seg = cache.host.pages.segments[0]
        base, stride, cap = seg.data_ptr(), seg.stride(0), cache.host.page_slots.capacity
        pending = self.device.pending_host("page")
        for ptr, size in pieces:
            if base <= ptr < base + cap * stride:
                first, last = (ptr - base) // stride, (ptr + size - 1 - base) // stride
                if pending & set(range(first, last + 1)):
                    raise Violation(f"a put read host slot(s) of {name[-8:]} before their copy")
        self.oracle.check_put(name, data)

    def state_slot_of(self, out: torch.Tensor) -> int:
        host = self._cache().host
        first = host.state(0)
        return (out.data_ptr() - first.data_ptr()) // max(1, first.numel())

    def _cache(self) -> HiCache:
        if self.cache is None:
            raise RuntimeError("the cache is closed")
        return self.cache

    # -- teardown -----------------------------------------------------------------------------

    def close(self, final: bool = True) -> None:
        """Finish the device's work, let every call through, close the cache and check that it
        left no thread, registration or open file behind."""
        cache = self.cache
        if cache is not None:
            for rid in list(self.reqs):
                self.op_release(rid)
            # the device's queued work runs before the parked calls go on by themselves (they
            # then run in real time: what they read must not depend on how fast they woke)
            self.device.advance()
            self.space.gate.open()
            self.device.advance()
            cache.poll()
            cache.close()
            self.cache = None
            self._check_leaks()
        if final:
            gc.collect()  # a lease dropped in a cycle of this world's garbage shows now
            World.active = None
            for name in [n for n in SPACES if n == self.name or n.startswith(self.name + "-")]:
                del SPACES[name]
            shutil.rmtree(self.dir, ignore_errors=True)

    def _check_leaks(self) -> None:
        deadline = time.monotonic() + 30
        while True:
            alive = [
                t.name
                for t in set(threading.enumerate()) - self._threads_before
                if t.name.startswith("hicache")
            ]
            if not alive:
                break
            if time.monotonic() > deadline:
                raise Violation(f"threads alive after close: {alive}")
            time.sleep(0.01)
        if self.space.registered:
            raise Violation("host memory still registered with a store after close")
        open_files = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if target.startswith(self.dir):
                open_files.append(target)
        if open_files:
            raise Violation(f"files of the cache open after close: {open_files[:3]}")
