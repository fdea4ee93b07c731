"""Where the engine thread's time goes in a host-tier `store` of 64 pages, piece by piece.

    python bench/store_parts.py [--device cuda] [--calls 600] [--under-load] [--beside-load N]
                                [--beside-l3 ROUNDS [--conditions A,B]] [--out FILE]

A host-only cache stores 64 new pages per call, as the engine-thread phase of `l3_cache.py` does
(64 KiB pages on CUDA, 4 KiB on the CPU; into 64 consecutive blocks, then into 64 blocks drawn
at random from 128), with the heap frozen and in a tight loop (a warm thread: the figures are a
floor for the bench's, whose calls alternate with other work). First the whole call untimed
inside; then again with each piece wrapped in a timer (each wrapper costs ~0.3 µs, so the
wrapped total is larger). On CUDA it also times the extension's event and copy calls alone.
Prints JSON: p50, p99 and max in µs, and how many times a store calls each piece. With
--under-load also `under_load`: which pieces carry the slowest stores while the store is
saturated (a real `mooncake_master` on loopback, as in `l3_cache.py`). With --beside-load N
also `beside_load`: a host-only store alone and beside N busy processes, which compute only or
stream memory (what the machine's other work does to the engine thread without any L3). With
--beside-l3 ROUNDS also `beside_l3`: a host-only store alone, beside the store's traffic from
another process or from a thread of its own, beside a saturated L3 cache in its process (its
store client in the process, or in one of its own), beside GPU -> host copies alone (and with a
thread waiting for them), and beside bursts of Python from a thread of its own or from another
process.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import multiprocessing as mp
import platform
import queue
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "tests")]

import l3_cache  # noqa: E402
from l3_raw import put_loop, raw_client, report, store_load  # noqa: E402
from mooncake_master import MooncakeMaster, SegmentHolder  # noqa: E402

from hicache import PagedBuffer, cache, keys, l3, native, slots, transfers  # noqa: E402
from hicache.backends import gpu  # noqa: E402

PIECES = [
    (cache.HiCache, "_request"),
    (keys.KeyChain, "upto"),
    (keys, "page_keys"),
    (gpu.GpuTier, "block_ids"),
    (slots.SlotPool, "split"),
    (slots.SlotPool, "reserve"),
    (native, "align_slots"),
    (transfers.Transfers, "copy"),
    (slots.SlotPool, "publish"),
    (transfers.Transfers, "then"),
    (cache.HiCache, "_after_store"),
    (slots.SlotPool, "_unpin"),
]


def pct(seconds: list[float]) -> dict[str, float]:
    """`l3_cache.percentiles` of `seconds`, in µs."""
    return l3_cache.percentiles([x * 1e6 for x in seconds])


def stores(calls: int, scattered: bool) -> list[float]:
    """Seconds of each of `calls` stores of 64 new pages into a fresh host-only cache."""
    c = l3_cache.make_cache(None, l3_cache.ENGINE_PAGE, 128)
    rng = np.random.default_rng(1)
    total: list[float] = []
    gc.collect()
    gc.freeze()  # as an engine does once started (and as the bench runs with --gc-freeze)
    try:
        for i in range(calls):
            tokens = rng.integers(0, 50_000, 64 * 16 + 1, dtype=np.int32)
            blocks = rng.permutation(128)[:64].tolist() if scattered else list(range(64))
            t0 = time.perf_counter()
            c.store(f"s{i}", tokens, blocks)
            total.append(time.perf_counter() - t0)
            c.release(f"s{i}")
            c.poll()
    finally:
        gc.unfreeze()
        c.close()
    return total


def _timer(fn, label: str, sink: Callable[[str, float], None]):
    """`fn`, handing `sink` its label and the seconds of each call."""

    @functools.wraps(fn)
    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            sink(label, time.perf_counter() - t0)

    return timed


@contextlib.contextmanager
def pieces_timed(sink: Callable[[str, float], None], pieces=PIECES):
    """Wrap every piece of `pieces` in a timer that hands `sink` its name and seconds."""
    originals = []
    for owner, name in pieces:
        fn = getattr(owner, name)
        label = f"{getattr(owner, '__name__', owner)}.{name}".removeprefix("hicache.")
        originals.append((owner, name, fn))
        setattr(owner, name, _timer(fn, label, sink))
    try:
        yield
    finally:
        for owner, name, fn in reversed(originals):
            setattr(owner, name, fn)


def under_load(calls: int) -> dict:
    """Which pieces carry the slowest stores while the store is saturated.

    Runs `l3_cache`'s saturated phase (an L3 cache with a write-behind queue of 2, and a
    host-only cache making the same calls beside it) with every piece timed on the engine
    thread, store by store (both kinds of store; nested pieces are counted in their caller
    too: `KeyChain.upto` holds `keys.page_keys`, `HiCache._after_store` holds
    `Transfers.then` and `L3.write_behind`). For each cache: a piece's median over the stores
    within 10 % of the median store, against its mean over the slowest 1 %. A piece whose share
    grows far more than the others' is what makes a store slow; every piece growing alike is
    the thread running slower as a whole.
    """
    engine = threading.get_ident()
    records: list[dict] = []
    current: list[dict | None] = [None]

    def sink(label: str, seconds: float) -> None:
        rec = current[0]
        if rec is not None and threading.get_ident() == engine:  # workers hash pages too
            rec[label] = rec.get(label, 0.0) + seconds

    plain_store = cache.HiCache.store

    def store(self, *args, **kwargs):
        rec = current[0] = {"l3": self._l3 is not None}
        t0 = time.perf_counter()
        try:
            return plain_store(self, *args, **kwargs)
        finally:
            rec["store"] = time.perf_counter() - t0
            current[0] = None
            records.append(rec)

    master = MooncakeMaster().start()
    holder = SegmentHolder(master.address, 8 << 30)
    frozen, l3_cache.GC_FREEZE = l3_cache.GC_FREEZE, True  # as the bench runs with --gc-freeze
    try:
        with pieces_timed(sink, [*PIECES, (l3.L3, "write_behind")]):
            cache.HiCache.store = store
            try:
                l3_cache.engine_thread_times(master, calls, "saturated")
            finally:
                cache.HiCache.store = plain_store
    finally:
        l3_cache.GC_FREEZE = frozen
        holder.close()
        master.stop()
    out = {}
    for name, with_l3 in (("l3_cache", True), ("host_only_alongside", False)):
        recs = [r for r in records if r["l3"] == with_l3]
        totals = sorted(r["store"] for r in recs)
        p50, p99 = totals[len(totals) // 2], totals[int(0.99 * (len(totals) - 1))]
        slow = [r for r in recs if r["store"] >= p99]
        typical = [r for r in recs if abs(r["store"] - p50) <= 0.1 * p50]
        labels = ["store", *sorted({k for r in recs for k in r} - {"l3", "store"})]
        out[name] = {
            "stores": len(recs),
            "slowest": len(slow),
            "typical": len(typical),
            "us": {
                k: {
                    "typical_median": round(
                        statistics.median(r.get(k, 0.0) for r in typical) * 1e6, 1
                    ),
                    "slowest_mean": round(statistics.mean(r.get(k, 0.0) for r in slow) * 1e6, 1),
                }
                for k in labels
            },
        }
    return out


def _occupy(kind: str, stop) -> None:
    """Child process of `beside_load`: keep one CPU busy until `stop` is set, with arithmetic
    on a few registers (`spin`) or by copying 64 MiB arrays (`stream`: the memory bus and the
    shared caches, as loopback TCP's copies do)."""
    if kind == "spin":
        while not stop.is_set():
            x = 0
            for i in range(100_000):
                x += i
        return
    src = np.ones(8 << 20)
    dst = np.empty_like(src)
    while not stop.is_set():
        np.copyto(dst, src)


def beside_load(calls: int, procs: int) -> dict:
    """A host-only `store` (consecutive blocks) with nothing else running, then beside `procs`
    processes that only compute, then beside `procs` that stream memory, then alone again (a
    drift check). No L3, no Mooncake: what other work on the machine does to the engine
    thread by itself."""
    ctx = mp.get_context("spawn")
    out = {}
    for label in ("alone", "beside_spin", "beside_stream", "alone_again"):
        kind = label.removeprefix("beside_")
        stop = ctx.Event()
        workers = (
            []
            if label.startswith("alone")
            else [ctx.Process(target=_occupy, args=(kind, stop), daemon=True) for _ in range(procs)]
        )
        for w in workers:
            w.start()
        time.sleep(2.0 if workers else 0.0)  # let them start and get busy
        try:
            out[label] = pct(stores(calls, scattered=False))
        finally:
            stop.set()
            for w in workers:
                w.join(10)
    return {"processes": procs, "store_us": out}


def _python_bursts(stop) -> None:
    """Until `stop` is set: every millisecond, 0.1 ms of the kind of Python an L3 worker runs
    around its store calls (hicache's key hashing, lists, dicts), then a sleep, which lets go of
    the GIL. Run in a thread of the engine's process or in a process of its own."""
    tokens = np.random.default_rng(2).integers(0, 50_000, 64 * 16, dtype=np.int32)
    while not stop.is_set():
        end = time.perf_counter() + 1e-4
        while time.perf_counter() < end:
            page_keys = keys.page_keys(bytes(16), tokens, 16)
            where = {k: i for i, k in enumerate(page_keys)}
            _ = [where[k] for k in page_keys]
        time.sleep(1e-3)


def ask_loop(
    master: str, obj: int, batch: int, gbps: float, stop: threading.Event, on_ready, get: bool
) -> dict[str, float]:
    """`put_loop`'s shape, asking instead, with a client of its own, every 0.3 ms until `stop`
    is set: `batch_is_exist` for `batch` absent objects, or (`get`) a batched get of them into
    a registered buffer, as a fetch of objects the store does not hold (`gbps` is unused)."""
    client = raw_client(master, 0)
    try:
        names = [f"absent/{uuid.uuid4().hex}/{i}" for i in range(batch)]
        buf = torch.empty(obj * batch, dtype=torch.uint8)
        if get and client.register_buffer(buf.data_ptr(), buf.numel()) != 0:
            raise RuntimeError("register_buffer failed")
        ptrs = [[buf.data_ptr() + i * obj] for i in range(batch)]
        sizes = [[obj]] * batch
        on_ready()
        calls, t0 = 0, time.perf_counter()
        while not stop.is_set():
            if get:
                client.batch_get_into_multi_buffers(names, ptrs, sizes)
            else:
                client.batch_is_exist(names)
            calls += 1
            time.sleep(3e-4)
        return {"calls_per_s": round(calls / (time.perf_counter() - t0), 1)}
    finally:
        client.close()


def _gpu_irqs() -> list[int]:
    """Interrupts each CPU has taken from NVIDIA devices so far (/proc/interrupts; [] where
    there is none)."""
    try:
        lines = Path("/proc/interrupts").read_text().splitlines()
    except OSError:
        return []
    cpus = len(lines[0].split())
    total = [0] * cpus
    for line in lines[1:]:
        if "nvidia" in line.lower():
            counts = line.split()[1 : 1 + cpus]
            total = [t + int(c) for t, c in zip(total, counts, strict=False) if c.isdigit()]
    return total


def _cpu_now() -> int:
    """The CPU the calling thread runs on (Linux; -1 elsewhere)."""
    try:
        stat = Path("/proc/thread-self/stat").read_text()
    except OSError:
        return -1
    return int(stat.rsplit(")", 1)[1].split()[36])  # field 39, "processor"


CONDITIONS = (
    "alone",
    "busy_elsewhere",
    "busy_in_thread",
    "beside_saturated_l3",
    "beside_saturated_l3_own_process",
    "beside_copies",
    "python_in_thread",
    "python_elsewhere",
    "copies_waited_in_thread",
    "copies_polled_in_thread",
    "beside_l3_puts_only",
    "beside_l3_fetches_only",
    "beside_l3_probes_only",
    "exists_in_thread",
    "beside_l3_fetches_no_store",
    "gets_in_thread",
    "beside_l3_fetches_engine_only",
)
"""`beside_l3`'s conditions, in the order of its even rounds."""


def beside_l3(calls: int, rounds: int, conditions: tuple[str, ...] = CONDITIONS) -> dict:
    """Does L3 in the engine's process slow the engine thread's other work? A host-only `store`
    (consecutive blocks) timed back to back under each condition, round by round, the order
    reversed every other round (the machine's speed drifts within a minute):

    - `alone`: nothing else runs;
    - `busy_elsewhere`: another process puts group-size objects (`l3_raw.store_load`);
    - `busy_in_thread`: a thread of this process does the same (`l3_raw.put_loop`): a Mooncake
      client, its transfer threads and the loopback traffic inside the engine's process,
      without hicache's L3;
    - `beside_saturated_l3`: before every timed store, an L3 cache in this process stores 64
      new pages (its write-behind queue of 2 always full) and matches a new prompt (a fetch
      starts), as in a step of `l3_cache.py`'s saturated phase: hicache's L3 workers and
      Mooncake's threads in the process;
    - `beside_saturated_l3_own_process`: the same with a cache whose store client runs in a
      process of its own (``own_process``): L3's workers in this process, Mooncake in another;
    - `beside_copies`: before every timed store, a second host-only cache stores 64 new pages:
      the GPU -> host copies that feed a saturated L3's write-behind, without L3;
    - `python_in_thread`, `python_elsewhere`: Python in bursts of 0.1 ms every millisecond
      (`_python_bursts`), from a thread of this process or from another process: whether
      Python beside the engine thread in its own interpreter slows it, with no L3 and no
      Mooncake at all;
    - `copies_waited_in_thread`, `copies_polled_in_thread`: `beside_copies`, with a thread that
      waits for each of those stores' copies to complete, as the write-behind worker does:
      asleep on a blocking-sync CUDA event (woken by the GPU's interrupt), or polling the event
      every 0.2 ms;
    - `beside_l3_puts_only`, `beside_l3_fetches_only`: `beside_saturated_l3` with the L3 cache
      only storing (its write-behind puts) or only matching (its fetches: one batched get each,
      of objects the store does not hold); `beside_l3_probes_only`: only matching, each fetch
      asking `exists` first (as it does when the fetch reserve is short or the layout has
      states);
    - `beside_l3_fetches_no_store`: `beside_l3_fetches_only` with the store's get answered at
      once as "not found" without calling Mooncake: hicache's fetch path alone;
      `beside_l3_fetches_engine_only`: that path's engine-thread part alone, each job's result
      posted at once by the engine thread (`l3_cache.answer_on_engine_thread`): no worker wakes
      or runs;
    - `exists_in_thread`, `gets_in_thread`: a Mooncake client in a thread of this process asks
      `batch_is_exist` for 16 absent objects every 0.3 ms, or gets them (a batched get into a
      registered buffer): the store's round trips alone, without hicache.

    Each round also counts the interrupts from NVIDIA devices, on all CPUs and on the CPU the
    engine thread was on at the end of the round.

    The loaders put at the rate the saturated L3 cache reaches here, measured first. Every step
    also times a fixed compiled hash of 64 pages (`l3_cache.reference_hash_us`, no Python,
    nothing shared): the CPU's own speed at that moment. Where the store beside L3 stays within the
    spread of the `alone` rounds, L3 does not slow the rest of the engine thread; a difference
    that the reference hash shows too is the machine, not the process."""
    spawn = mp.get_context("spawn")
    master = MooncakeMaster().start()
    holder = SegmentHolder(master.address, 4 << 30)
    host = l3_cache.make_cache(None, l3_cache.ENGINE_PAGE, 128)
    busy = l3_cache.make_cache(master, l3_cache.ENGINE_PAGE, 128, write_queue_depth=2)
    busy_own = l3_cache.make_cache(
        master, l3_cache.ENGINE_PAGE, 128, write_queue_depth=2, own_process=True
    )
    rng = np.random.default_rng(1)
    obj = 4 * l3_cache.ENGINE_PAGE  # a group of 4 pages: what the caches put

    def feeder(c: cache.HiCache, store: bool = True, match: bool = True) -> Callable[[int], None]:
        def feed(i: int) -> None:  # the calls of a saturated phase's step (with L3: a fetch)
            tokens = rng.integers(0, 50_000, 64 * 16 + 1, dtype=np.int32)
            if store:
                c.store(f"b{i}", tokens, list(range(64)))
                c.release(f"b{i}")
            if match:
                c.match(f"m{i}", rng.integers(0, 50_000, 64 * 16 + 1, dtype=np.int32))
                c.release(f"m{i}")
            c.poll()

        return feed

    copier = l3_cache.make_cache(None, l3_cache.ENGINE_PAGE, 128)
    feed_l3, feed_own, feed_copies = feeder(busy), feeder(busy_own), feeder(copier)
    feed_puts, feed_fetches = feeder(busy, match=False), feeder(busy, store=False)
    copied: queue.SimpleQueue = queue.SimpleQueue()

    def feed_waited(i: int) -> None:  # beside_copies, and a thread waits for each store's copies
        feed_copies(i)
        copied.put(copier._transfers.then(lambda: None))

    def wait_each(poll_s: float) -> None:
        while (done := copied.get()) is not None:
            if poll_s:
                while not done.done():
                    time.sleep(poll_s)
            else:
                done.wait()

    def timed(feed: Callable[[int], None] | None) -> dict:
        l3 = busy_own if feed is feed_own else busy
        put_before, t_start = l3.stats().get("l3_put_bytes", 0), time.perf_counter()
        irqs_before = _gpu_irqs()
        store, store_cpu, hashed = [], [], []
        for i in range(calls):
            tokens = rng.integers(0, 50_000, 64 * 16 + 1, dtype=np.int32)
            if feed is not None:
                feed(i)
            t0, c0 = time.perf_counter(), time.thread_time()
            host.store(f"s{i}", tokens, list(range(64)))
            store.append(time.perf_counter() - t0)
            store_cpu.append(time.thread_time() - c0)
            host.release(f"s{i}")
            hashed.append(l3_cache.reference_hash_us())
            host.poll()
        seconds = time.perf_counter() - t_start
        put = l3.stats().get("l3_put_bytes", 0) - put_before
        irqs = [b - a for a, b in zip(irqs_before, _gpu_irqs(), strict=False)]
        cpu = _cpu_now()
        return {
            "gpu_irqs": sum(irqs),
            "gpu_irqs_on_engine_cpu": irqs[cpu] if 0 <= cpu < len(irqs) else None,
            "engine_cpu": cpu,
            "store_us": pct(store),
            "store_cpu_us": pct(store_cpu),  # the thread's own CPU time: below the wall time
            "reference_hash_us": l3_cache.percentiles(hashed),  # when it waited (the GIL, the OS)
            "seconds": round(seconds, 2),
            "l3_put_gbps": round(put / seconds / 1e9, 3),
        }

    def one(condition: str, gbps: float) -> dict:
        if condition == "alone":
            return timed(None)
        if condition == "beside_saturated_l3":
            return timed(feed_l3)
        if condition == "beside_saturated_l3_own_process":
            return timed(feed_own)
        if condition == "beside_l3_puts_only":
            return timed(feed_puts)
        if condition == "beside_l3_fetches_only":
            return timed(feed_fetches)
        if condition == "beside_l3_fetches_no_store":  # hicache's fetch path, no Mooncake call
            store = busy._l3.store
            store.get_into = lambda keys, buffers: [store.missing_code] * len(keys)
            try:
                return timed(feed_fetches)
            finally:
                del store.get_into
        if condition == "beside_l3_fetches_engine_only":  # no worker: the engine thread's part
            undo = l3_cache.answer_on_engine_thread(busy)
            try:
                return timed(feed_fetches)
            finally:
                undo()
        if condition == "beside_l3_probes_only":  # fetches that ask `exists` before they get
            l3 = busy._l3
            l3._can_get_at_once = lambda pages: False  # type: ignore[method-assign]
            try:
                return timed(feed_fetches)
            finally:
                del l3._can_get_at_once
        if condition == "beside_copies":
            return timed(feed_copies)
        if condition.startswith("copies_"):
            poll_s = 2e-4 if condition == "copies_polled_in_thread" else 0.0
            waiter = threading.Thread(target=wait_each, args=(poll_s,), daemon=True)
            waiter.start()
            try:
                return timed(feed_waited)
            finally:
                copied.put(None)
                waiter.join(10)
        if condition.startswith("python_"):
            in_thread = condition == "python_in_thread"
            stop = threading.Event() if in_thread else spawn.Event()
            kind = threading.Thread if in_thread else spawn.Process
            worker = kind(target=_python_bursts, args=(stop,), daemon=True)
            worker.start()
            time.sleep(0.1 if in_thread else 3.0)  # a process imports hicache first
            try:
                return timed(None)
            finally:
                stop.set()
                worker.join(10)
        if condition == "busy_elsewhere":
            with store_load(master.address, obj, gbps=gbps) as load:
                row = timed(None)
            return row | {"loader_gbps": load.get("gbps")}
        stop, ready, load = threading.Event(), threading.Event(), {}
        loop = (
            functools.partial(ask_loop, get=condition == "gets_in_thread")
            if condition in ("exists_in_thread", "gets_in_thread")
            else put_loop
        )
        loader = threading.Thread(
            target=lambda: load.update(loop(master.address, obj, 16, gbps, stop, ready.set))
        )
        loader.start()
        try:
            if not ready.wait(60):
                raise RuntimeError("the in-process loader did not start")
            row = timed(None)
        finally:
            stop.set()
            loader.join()
        return row | {
            "loader_gbps": load.get("gbps"),
            "loader_calls_per_s": load.get("calls_per_s"),
        }

    gc.collect()
    gc.freeze()
    try:
        rate = timed(feed_l3)["l3_put_gbps"]  # also warms the caches up
        timed(feed_own)
        out: dict[str, list[dict]] = {c: [] for c in conditions}
        for r in range(rounds):
            for condition in conditions if r % 2 == 0 else conditions[::-1]:
                out[condition].append(one(condition, rate))
    finally:
        gc.unfreeze()
        busy.close()
        busy_own.close()
        copier.close()
        host.close()
        holder.close()
        master.stop()
    return {
        "calls_per_round": calls,
        "loader_target_gbps": rate,
        "rounds": out,
        "store_p99_us_by_round": {c: [x["store_us"]["p99"] for x in out[c]] for c in conditions},
        "reference_hash_p50_us_by_round": {
            c: [x["reference_hash_us"]["p50"] for x in out[c]] for c in conditions
        },
    }


def cuda_calls() -> dict:
    """The copy extension's calls alone, warm: events, and a copy of 64 pages of 64 KiB."""
    from hicache.kernels import cuda

    ext = cuda.load_extension()
    stream = torch.cuda.Stream()
    handle = stream.cuda_stream

    def each(fn, n: int = 2000) -> dict[str, float]:
        for _ in range(100):
            fn()
        xs = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            xs.append(time.perf_counter() - t0)
        stream.synchronize()
        return pct(xs)

    event = ext.event_create(False, 0)
    gpu_pages = PagedBuffer.page_first(torch.empty(256, 64 << 10, dtype=torch.uint8, device="cuda"))
    host_pages = PagedBuffer.page_first(torch.empty(1024, 64 << 10, dtype=torch.uint8).pin_memory())
    route = cuda.CudaRoute(gpu_pages, host_pages)
    run = np.arange(64, dtype=np.int32)
    spread = np.random.default_rng(0).permutation(128)[:64].astype(np.int32)
    dst = np.arange(512, 576, dtype=np.int32)
    out = {
        "event_create_and_destroy": each(lambda: ext.event_destroy(ext.event_create(False, 0))),
        "event_record": each(lambda: ext.event_record(event, handle, 0)),
        "copy_64_pages_consecutive_blocks": each(lambda: route.copy(run, dst, handle), 600),
        "copy_64_pages_scattered_blocks": each(lambda: route.copy(spread, dst, handle), 600),
    }
    stream.synchronize()
    ext.event_destroy(event)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--calls", type=int, default=600)
    ap.add_argument("--out")
    ap.add_argument(
        "--under-load",
        action="store_true",
        help="also: which pieces carry the slowest stores while the store is saturated",
    )
    ap.add_argument(
        "--beside-load",
        type=int,
        metavar="N",
        help="also: a host-only store alone and beside N busy processes (compute, then memory)",
    )
    ap.add_argument(
        "--beside-l3",
        type=int,
        metavar="ROUNDS",
        help="also: a host-only store alone, beside the store's traffic from another process "
        "or a thread, and beside a saturated L3 cache, in ROUNDS rounds",
    )
    ap.add_argument("--beside-l3-calls", type=int, default=3000, help="stores per condition")
    ap.add_argument("--conditions", help="--beside-l3's conditions to run, comma-separated")
    args = ap.parse_args()
    conditions = tuple(args.conditions.split(",")) if args.conditions else CONDITIONS
    unknown = sorted(set(conditions) - set(CONDITIONS))
    if unknown:
        ap.error(f"--conditions: unknown {unknown}; known: {', '.join(CONDITIONS)}")
    if args.device.startswith("cuda"):
        l3_cache.DEVICE, l3_cache.CUDA = args.device, True
        l3_cache.ENGINE_PAGE = 64 << 10
        torch.cuda.set_stream(torch.cuda.Stream())
    result = {
        "bench": "store_parts",
        "machine": f"{platform.processor() or platform.machine()}, "
        + (torch.cuda.get_device_name() if l3_cache.CUDA else "CPU pool"),
        "command": "python " + " ".join(sys.argv),
    }
    for kind, scattered in (("consecutive_blocks", False), ("scattered_blocks", True)):
        plain = stores(args.calls, scattered)
        samples: dict[str, list[float]] = {}
        with pieces_timed(lambda label, t, into=samples: into.setdefault(label, []).append(t)):
            wrapped = stores(args.calls, scattered)
        result[kind] = {
            "store_us": pct(plain),
            "store_with_timers_us": pct(wrapped),
            "pieces_us": {
                k: pct(v) | {"per_store": round(len(v) / args.calls, 2)} for k, v in samples.items()
            },
        }
    if l3_cache.CUDA:
        result["cuda_calls_us"] = cuda_calls()
    if args.under_load:
        result["under_load"] = under_load(args.calls)
    if args.beside_load:
        result["beside_load"] = beside_load(args.calls, args.beside_load)
    if args.beside_l3:
        result["beside_l3"] = beside_l3(args.beside_l3_calls, args.beside_l3, conditions)
    report(result, args.out)


if __name__ == "__main__":
    main()
