"""hicache's L3 path against raw Mooncake batch calls, in one run, on loopback.

    python bench/l3_cache.py --out bench/results/l3_cache_loopback.json

1. Throughput, for objects of 512 KiB and of 4 MiB, round by round: raw
   `batch_put_from_multi_buffers` / `batch_get_into_multi_buffers` of 32 objects (one contiguous
   piece each, as hicache sends a group whose page slots are consecutive, and 4 scattered
   pieces each, as it sends a group in scattered slots; `hicache_pieces_per_object` says which
   it did; one client puts them and another reads them, as hicache's writer and reader are
   two caches: on loopback TCP a client reads what it put itself twice as fast; the batches
   take turns over buffers as large as the caches' host tiers, as a cache's slots do), then
   hicache's write-behind (a `store` of 128 pages = 32 groups of 4 = 32 objects, timed from
   its host copy's end (at once on the CPU) until every put has been applied) and fill (a
   fresh cache's `match` of the same prompt, timed until the pages are in its host tier and
   the match is no longer pending). The caches stand in for idle engines: between steps they
   sleep until hicache's `wake` callback says an L3 result was posted, 0.5 ms at most.
   Objects live in a segment of another process in both cases, so every byte crosses loopback
   TCP.
2. Engine-thread time of `store` and `match` while the store is saturated (a write-behind queue of
   2 batches and a burst of stores) and while it is down: master killed just before the calls
   (the breaker still closed), and killed until the breaker has opened. p50/p99/max in µs.
   Each step stores 64 new pages twice: into 64 consecutive blocks (`store`: the copy merges
   them into one row, as it does for any run of blocks) and into 64 blocks drawn at random from
   a pool of 128 (`store_scattered`: one row per page, the worst case). Pages are 4 KiB on the
   CPU (so that the CPU stand-in for the GPU copy does not hide the L3 part), 64 KiB on CUDA.
   In each phase a host-only cache makes the same calls side by side (`host_only_alongside`),
   so that what L3 adds is read under the same machine conditions; a separate host-only phase
   runs first (`engine_thread_host_only_baseline`), and one more times a host-only cache while
   another process keeps the store as busy, at the same put rate
   (`engine_thread_host_only_store_busy_elsewhere`): the store's traffic without L3's threads
   in the engine's process; and one (`engine_thread_l3_engine_part_busy_elsewhere`) times an L3
   cache whose jobs are answered at once on the engine thread (`answer_on_engine_thread`: no L3
   worker runs in the process) under that same load: the engine thread's own share of L3, what
   it would pay with L3's workers and client in another process. `store_put_gbps` says how
   many bytes were put per second meanwhile; `reference_hash_us`, how fast the CPU itself ran
   (a fixed compiled hash of 64 pages, timed once per step: the lent machines' CPUs change
   speed by half within a minute, idle).

With --engine-cpu N the timed engine thread runs on CPU N alone, and everything else on the
other cores (less N's SMT siblings): the caches' L3 threads and the Mooncake clients' own
threads through the store tier's `worker_cpus`, the master and the segment's process by
inheritance. That is how an engine should deploy hicache; without it the OS may put L3's busy
threads on the engine thread's core.

Prints JSON; with --out also writes it.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import os
import platform
import pstats
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "bench")]

from l3_raw import measure, raw_client, report, store_load  # noqa: E402
from mooncake_master import MooncakeMaster, SegmentHolder  # noqa: E402

from hicache import HiCache, PagedBuffer, load_config, native, threads  # noqa: E402
from hicache.store_worker import Job  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
DEVICE = "cpu"  # --device cuda puts the engine's pool on the GPU (copies: the CUDA paths)
CUDA = False
ENGINE_PAGE = 4 * KiB  # page size of the engine-thread timings (64 KiB on CUDA: copy engines)
PROFILE = False  # --profile: cProfile the engine-thread stores
GC_FREEZE = False  # --gc-freeze: freeze the heap before the engine-thread timings
ENGINE_CPU: int | None = None  # --engine-cpu: the engine thread's CPU while it is timed
OTHERS: frozenset[int] = frozenset()  # then: every other CPU (less its SMT siblings)
FETCH_WORKERS: int | None = None  # --fetch-workers: the caches' fetch threads (None: default)
OWN_PROCESS = False  # --own-process: the caches' store clients run in a process of their own
STREAM = 4  # requests at once in the streamed throughput
ROTATE = 16  # the raw calls' buffers: as many batches as a cache's host tier holds here


def percentiles(xs: list[float]) -> dict[str, float]:
    """p50, p99 and max of `xs` (in the unit given), rounded to 0.1."""
    xs = sorted(xs)
    return {
        "p50": round(xs[len(xs) // 2], 1),
        "p99": round(xs[int(0.99 * (len(xs) - 1))], 1),
        "max": round(xs[-1], 1),
    }


REFERENCE_PAGES = np.random.default_rng(0).integers(0, 50_000, (64, 16), dtype=np.int32)


def reference_hash_us() -> float:
    """µs of one fixed compiled hash of 64 pages (no Python inside, nothing shared with other
    threads): how fast this CPU runs right now, to read the engine-thread timings against."""
    t0 = time.perf_counter()
    native.chain_keys(bytes(16), REFERENCE_PAGES)
    return (time.perf_counter() - t0) * 1e6


def make_cache(master: MooncakeMaster | None, page_bytes: int, pages: int, **store) -> HiCache:
    """A cache over a CPU pool of `pages` pages; with `master` None, the host tier alone."""
    l3 = {
        "type": "mooncake",
        "master_address": master.address if master else "127.0.0.1:1",
        "global_segment_size": 0,
        "group_pages": 4,
        "call_timeout_s": 2.0,
        "breaker_reprobe_s": 0.5,
        "worker_cpus": sorted(OTHERS),
        **({"fetch_workers": FETCH_WORKERS} if FETCH_WORKERS else {}),
        "own_process": OWN_PROCESS,
        **store,
    }
    # a host tier of 16 stores' pages, and at least 512 MiB: the fetch reserve (64 MiB by
    # default, at most an eighth of the host tier) is whole, as in a host tier of GiBs
    size = max(16 * pages * page_bytes, 512 * MiB)
    host = {"type": "host", "size": size, "pin": "yes" if CUDA else "no"}
    cfg = load_config(
        {
            "layout": {
                "model": "bench",
                "kv_dtype": "bfloat16",
                "page_tokens": 16,
                "page_bytes": page_bytes,
            },
            "tiers": [host] if master is None else [host, l3],
            "policy": {"l3_max_wait_ms": 60_000, "l3_read_gbps": 100},
        },
        env={},
    )
    pool = torch.randint(0, 255, (pages, page_bytes), dtype=torch.uint8, device=DEVICE)
    woken = threading.Event()
    cache = HiCache(cfg, PagedBuffer.page_first(pool), wake=woken.set)
    _WOKEN[cache] = woken
    if not cache.wait_ready(20):
        raise SystemExit("the host tier or the store did not become ready")
    return cache


_WOKEN: dict[HiCache, threading.Event] = {}
"""Each bench cache's wake event, set by its L3 workers (`HiCache(wake=...)`)."""


class CallClock:
    """Stands in for a cache's Mooncake client and adds up the seconds of its batch calls, so
    that a job's store call can be told from the rest of the job, and counts the objects and
    pieces of its puts and gets (how hicache laid them out)."""

    def __init__(self, client) -> None:
        self._client = client
        self.seconds: dict[str, float] = {}
        self.objects = self.pieces = 0

    def __getattr__(self, name: str):
        fn = getattr(self._client, name)
        if not name.startswith("batch_"):
            return fn

        def timed(*args):
            if name.endswith("multi_buffers"):  # (keys, ptrs, sizes, ...)
                self.objects += len(args[1])
                self.pieces += sum(map(len, args[1]))
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

        return timed


def call_clock(cache: HiCache) -> CallClock:
    """Put a `CallClock` between `cache`'s store and its (connected) Mooncake client. With
    --own-process the client is in another process: the clock stands by and counts nothing."""
    store = cache._l3.store  # type: ignore[union-attr]
    if OWN_PROCESS:
        return CallClock(None)
    store._client = CallClock(store._client)
    return store._client


@contextlib.contextmanager
def on_engine_cpu():
    """With --engine-cpu, run the block on that CPU alone (the timed engine thread), and go back
    to the other CPUs after it (where the master, the other processes and the caches' L3
    threads run, as `worker_cpus` keeps them in a deployment)."""
    if ENGINE_CPU is None:
        yield
        return
    os.sched_setaffinity(0, {ENGINE_CPU})
    try:
        yield
    finally:
        os.sched_setaffinity(0, OTHERS)


def pin_engine(cpu: int, avoid: frozenset[int] = frozenset()) -> None:
    """Keep this process and everything it starts from now on off `cpu`, its SMT siblings and
    the CPUs in `avoid` (siblings that the topology does not show: `bench/cpu_pairs.py` finds
    them); `on_engine_cpu` moves the engine thread onto `cpu` for the timed parts."""
    global ENGINE_CPU, OTHERS
    path = f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"
    siblings = {cpu}
    with contextlib.suppress(OSError):
        for part in Path(path).read_text().strip().split(","):
            lo, _, hi = part.partition("-")
            siblings.update(range(int(lo), int(hi or lo) + 1))
    others = frozenset(os.sched_getaffinity(0) - siblings - avoid)
    if cpu not in os.sched_getaffinity(0) or not others:
        raise SystemExit(f"--engine-cpu {cpu}: not a CPU of this process, or no other core left")
    ENGINE_CPU, OTHERS = cpu, others
    os.sched_setaffinity(0, others)


def next_step(cache: HiCache) -> None:
    """One step of an engine with nothing else to do: it sleeps until hicache wakes it (an L3
    result was posted), 0.5 ms at most, then polls. Clear before asking: a result posted after
    the clear is applied by this poll or the match after it."""
    woken = _WOKEN[cache]
    woken.wait(0.0005)
    woken.clear()
    cache.poll()


def answer_on_engine_thread(cache: HiCache) -> Callable[[], None]:
    """Make `cache`'s L3 answer each job the moment it is handed over, on the handing (engine)
    thread: a put as stored, a probe or a get as "not found". No worker wakes or runs, and
    nothing is named, placed or sent: what is left is L3's bookkeeping on the engine thread
    (which groups are new, slots, pins, the fetch reserve, applying results in `poll`). Every
    put is taken, where a saturated store would drop most, so this is an upper bound of that
    share. Returns the undo."""
    l3 = cache._l3

    def answer(jobs: object, job: Job) -> None:
        l3.jobs_in_flight += 1
        job.finished = l3.clock()
        if job.kind == "put":
            outcome: list = [0] * (len(job.ends) + len(job.state_ends))
        elif job.kind == "probe":
            outcome = [False] * job.fetch.groups
        else:
            outcome = [l3.store.missing_code] * job.groups
        l3._results.append((job, outcome))

    l3._submit = answer  # type: ignore[method-assign]
    return lambda: delattr(l3, "_submit")


def copied() -> None:
    """Wait for the store's GPU -> host copy (CUDA only; on the CPU store copies at once).

    Write-behind starts when the host write-through has completed: the put's clock starts
    there, as the raw put's does with its bytes in host memory (the copy itself is the page
    copy path's, measured by `hicache.kernels.bench`)."""
    if CUDA:
        torch.cuda.current_stream().synchronize()


def until_idle(cache: HiCache) -> None:
    while not cache.l3_idle or cache.stats()["copies_in_flight"]:
        next_step(cache)


def raw_pieces(
    client,
    bases: list[int],
    obj: int,
    pieces: int,
    batch: int,
    tag: str,
    reader,
    reader_bases: list[int],
    spread: tuple[int, np.random.Generator] | None = None,
) -> tuple[float, float]:
    """Raw batch puts, then gets, of one batch of `batch` objects per entry of `bases`, each
    object from/into `pieces` separate buffers (as a group in scattered slots is: one piece per
    page slot). `client` puts batch b from `bases[b]`, `reader` (another client, as hicache's
    reader is another cache) gets it into `reader_bases[b]`; all puts go out before the first
    get, as hicache's stores do before its matches. With `spread` (bytes, rng), each object
    lies at a random place of its own within that many bytes from the base, its pieces back to
    back, as a group in consecutive slots of a host tier does; without it the batch's pieces
    fill one region. Returns (put seconds, get seconds) summed."""
    from mooncake.store import ReplicateConfig

    rep = ReplicateConfig()
    rep.replica_num = 1
    part = obj // pieces

    def scattered(base: int) -> list[list[int]]:
        if spread is not None:  # object i in slot slots[i] of a pool of objects
            slots = spread[1].choice(spread[0] // obj, batch, replace=False).tolist()
            return [[base + s * obj + j * part for j in range(pieces)] for s in slots]
        # object i's piece j lies at slot j * batch + i, like slots of a pool
        return [[base + (j * batch + i) * part for j in range(pieces)] for i in range(batch)]

    src = [scattered(base) for base in bases]
    dst = [scattered(base) for base in reader_bases]
    sizes = [[part] * pieces for _ in range(batch)]
    names = [[f"raw/{tag}/{b}/{i}" for i in range(batch)] for b in range(len(bases))]
    t0 = time.perf_counter()
    put = [client.batch_put_from_multi_buffers(k, p, sizes, rep) for k, p in zip(names, src)]
    t1 = time.perf_counter()
    got = [reader.batch_get_into_multi_buffers(k, p, sizes) for k, p in zip(names, dst)]
    t2 = time.perf_counter()
    for keys in names:
        client.batch_remove(keys, True)
    if any(c != 0 for codes in put for c in codes) or any(c != obj for g in got for c in g):
        raise SystemExit(f"raw pieces: put {put}, get {got}")
    return t1 - t0, t2 - t1


def touch_segment(master: MooncakeMaster, segment_bytes: int) -> float:
    """Put objects until 90 % of the store's segment has been written, then remove them.

    The segment's memory is mapped lazily: the first put into a region pays its page faults
    (several times the copy), so whichever side of a comparison wrote first would lose. After
    this, raw calls and hicache both write into memory that has been touched. Returns seconds.
    """
    from mooncake.store import ReplicateConfig

    client = raw_client(master.address, 0)
    obj, batch = 4 * MiB, 32
    buf = torch.zeros(obj, dtype=torch.uint8)
    if client.register_buffer(buf.data_ptr(), buf.numel()) != 0:
        raise SystemExit("register_buffer failed")
    rep = ReplicateConfig()
    rep.replica_num = 1
    names: list[list[str]] = []
    t0 = time.perf_counter()
    try:
        while len(names) * batch * obj < 0.9 * segment_bytes:
            keys = [f"touch/{len(names)}/{i}" for i in range(batch)]
            client.batch_put_from_multi_buffers(
                keys, [[buf.data_ptr()]] * batch, [[obj]] * batch, rep
            )
            names.append(keys)
        for keys in names:
            client.batch_remove(keys, True)
    finally:
        client.close()
    return time.perf_counter() - t0


def throughput(master: MooncakeMaster, rounds: int, page_bytes: int) -> dict:
    """Raw calls and hicache's path, round by round on the same object sizes, so that drift of
    this noisy machine hits both alike. Medians of per-round times. A store of 128 pages is 32
    objects of 4 pages."""
    pages = 128
    obj = 4 * page_bytes
    writer = make_cache(master, page_bytes, pages)
    reader = make_cache(master, page_bytes, pages)
    clocks = call_clock(writer), call_clock(reader)
    puts, gets = clocks[0].seconds, clocks[1].seconds
    client, raw_reader = raw_client(master.address, 0), raw_client(master.address, 0)
    # The raw calls move the same bytes between memory as large as the caches' host tiers (16
    # batches), a batch at a time in turn: a cache's slots are not the few MiB that one reused
    # buffer keeps in the CPU's caches, and a fair baseline is not either.
    region = 32 * obj
    buf = torch.full((ROTATE * region + region,), 7, dtype=torch.uint8)  # + the one-piece dst
    rbuf = torch.zeros(ROTATE * region, dtype=torch.uint8)
    if client.register_buffer(buf.data_ptr(), buf.numel()) != 0:
        raise SystemExit("register_buffer failed")
    if raw_reader.register_buffer(rbuf.data_ptr(), rbuf.numel()) != 0:
        raise SystemExit("register_buffer failed")
    turn = 0

    def regions(n: int) -> tuple[list[int], list[int]]:
        nonlocal turn
        picks = [(turn + i) % ROTATE for i in range(n)]
        turn += n
        return (
            [buf.data_ptr() + k * region for k in picks],
            [rbuf.data_ptr() + k * region for k in picks],
        )

    rng = np.random.default_rng(0)
    keys = (
        "raws_put",
        "raws_get",
        "raws_put_x4",
        "raws_get_x4",
        "raw_put",
        "raw_get",
        "raw4_put",
        "raw4_get",
        "put",
        "fill",
        "fill_get_call",
        "put_call",
        "fill_mooncake_call",
        "put_mooncake_call",
        "raw_put_x4",
        "raw_get_x4",
        "raw4_put_x4",
        "raw4_get_x4",
        "put_x4",
        "fill_x4",
    )
    t: dict[str, list[float]] = {k: [] for k in keys}

    def one_round(r: int) -> dict[str, float]:
        """The raw calls and hicache's, in turn: in odd rounds hicache's go first, so that an
        order effect (a warmer CPU, data still in its caches) favours neither."""
        parts = [raw_calls, hicache_calls] if r % 2 == 0 else [hicache_calls, raw_calls]
        times: dict[str, float] = {}
        for part in parts:
            times.update(part(r))
        return times

    def raw_calls(r: int) -> dict[str, float]:
        src, dst = regions(1)
        one = measure(client, src[0], obj, 32, 1, 0, raw_reader, dst[0])
        src, dst = regions(1)
        put4, get4 = raw_pieces(client, src, obj, 4, 32, str(r), raw_reader, dst)
        pool = (ROTATE * region, rng)  # one piece per object, anywhere in the buffers
        base, rbase = [buf.data_ptr()], [rbuf.data_ptr()]
        puts1, gets1 = raw_pieces(client, base, obj, 1, 32, f"{r}s", raw_reader, rbase, pool)
        # four requests at once: against four raw batch calls one after the other
        src, dst = regions(STREAM)
        raw_x4 = raw_pieces(client, src, obj, 1, 32, f"{r}x", raw_reader, dst)
        src, dst = regions(STREAM)
        raw4_x4 = raw_pieces(client, src, obj, 4, 32, f"{r}x4", raw_reader, dst)
        raws_x4 = raw_pieces(
            client, base * STREAM, obj, 1, 32, f"{r}xs", raw_reader, rbase * STREAM, pool
        )
        return {
            "raws_put": puts1,
            "raws_get": gets1,
            "raws_put_x4": raws_x4[0],
            "raws_get_x4": raws_x4[1],
            "raw_put_x4": raw_x4[0],
            "raw_get_x4": raw_x4[1],
            "raw4_put_x4": raw4_x4[0],
            "raw4_get_x4": raw4_x4[1],
            "raw_put": one["put_ms_median_round"] / 1e3,
            "raw_get": one["get_ms_median_round"] / 1e3,
            "raw4_put": put4,
            "raw4_get": get4,
        }

    def hicache_calls(r: int) -> dict[str, float]:
        tokens = rng.integers(0, 50_000, pages * 16 + 1, dtype=np.int32)
        before = writer.stats()["l3_put_bytes"]
        put_before = writer.histograms()["hicache_l3_put_seconds"]["sum"]
        mc_put_before = puts.get("batch_put_from_multi_buffers", 0.0)
        writer.store(f"w{r}", tokens, list(range(pages)))
        copied()
        t0 = time.perf_counter()
        until_idle(writer)
        put_s = time.perf_counter() - t0
        put_call_s = writer.histograms()["hicache_l3_put_seconds"]["sum"] - put_before
        mc_put_s = puts.get("batch_put_from_multi_buffers", 0.0) - mc_put_before
        writer.release(f"w{r}")
        if writer.stats()["l3_put_bytes"] - before != pages * page_bytes:
            raise SystemExit(f"round {r}: not every page group was put")
        before = reader.stats()["l3_get_bytes"]
        get_before = reader.histograms()["hicache_l3_get_seconds"]["sum"]
        mc_before = gets.get("batch_get_into_multi_buffers", 0.0)
        t0 = time.perf_counter()
        m = reader.match(f"r{r}", tokens)
        while m.pending:
            next_step(reader)
            m = reader.match(f"r{r}", tokens)
        fill_s = time.perf_counter() - t0
        get_s = reader.histograms()["hicache_l3_get_seconds"]["sum"] - get_before
        mc_get_s = gets.get("batch_get_into_multi_buffers", 0.0) - mc_before
        reader.release(f"r{r}")
        got = reader.stats()["l3_get_bytes"] - before
        if m.l3_tokens != pages * 16 or got != pages * page_bytes:
            raise SystemExit(f"round {r}: fetched {got} bytes, hit {m.l3_tokens} tokens")
        # four requests at once: their hand-offs to the engine thread overlap the calls
        prompts = [rng.integers(0, 50_000, pages * 16 + 1, dtype=np.int32) for _ in range(STREAM)]
        put_x4, fill_x4 = streamed(writer, reader, prompts, pages, f"{r}")
        return {
            "put_x4": put_x4,
            "fill_x4": fill_x4,
            "put": put_s,
            "fill": fill_s,
            "fill_get_call": get_s,
            "put_call": put_call_s,
            "fill_mooncake_call": mc_get_s,
            "put_mooncake_call": mc_put_s,
        }

    try:
        for r in range(rounds + 1):
            with on_engine_cpu():
                times = one_round(r)
            if r:  # round 0 warms up
                for k, v in times.items():
                    t[k].append(v)
    finally:
        client.close()
        raw_reader.close()
        writer.close()
        reader.close()
    nbytes = 32 * obj
    gbps = {
        k: round(nbytes * (STREAM if k.endswith("_x4") else 1) / statistics.median(v) / 1e9, 3)
        for k, v in t.items()
        if statistics.median(v) > 0  # the Mooncake calls' own times: not seen with --own-process
    }
    return {
        "objects_per_batch": 32,
        "object_bytes": obj,
        "rounds": rounds,
        "median_gbps": gbps,
        "median_ms": {k: round(statistics.median(v) * 1e3, 2) for k, v in t.items()},
        "hicache_pieces_per_object": {
            "put": round(clocks[0].pieces / max(clocks[0].objects, 1), 3),
            "get": round(clocks[1].pieces / max(clocks[1].objects, 1), 3),
        },
        **{
            f"ratio_{ours}_vs_raw_{layout}": round(gbps[ours] / gbps[raw + tail], 3)
            for layout, raw in (
                ("one_piece_spread", "raws"),
                ("one_piece", "raw"),
                ("four_pieces", "raw4"),
            )
            for ours, tail in (
                ("put", "_put"),
                ("fill", "_get"),
                ("put_x4", "_put_x4"),
                ("fill_x4", "_get_x4"),
                ("put_mooncake_call", "_put"),
                ("fill_mooncake_call", "_get"),
            )
            if ours in gbps
        },
        "notes": "put: the store's host copy done (CUDA; store() returning on the CPU) -> "
        "every put applied (write-behind worker, poll); "
        "put_call: the put job alone, from store queueing it to the worker's return (waiting "
        "for the copy included); fill_get_call: the get job alone, from match queueing it; "
        "*_mooncake_call: the Mooncake batch call inside that job alone; "
        "fill: first match -> match no longer pending (a fetch that fits the reserve is one "
        "batched get and one hand-off; a larger one asks exists first); raw: one batch call "
        "each, objects of one contiguous piece, each at a random place of a buffer as large as "
        "a host tier (raws_*: as hicache sends a group whose slots are consecutive, see "
        "hicache_pieces_per_object), or back to back in one region (raw_*), or of 4 scattered "
        "pieces (raw4_*: as it sends a group in scattered slots), put by one client and read "
        "by another, as "
        "hicache's writer and reader are two caches; *_x4: four requests at once (four "
        "stores, then four matches), against four raw batch calls one after the other",
    }


def streamed(writer: HiCache, reader: HiCache, prompts: list, pages: int, tag: str):
    """Seconds to put, then to fill, the pages of several requests at once: from all stores
    returning until every put is applied; from the first match until none is pending."""
    for i, tokens in enumerate(prompts):
        writer.store(f"sw{tag}.{i}", tokens, list(range(pages)))
    copied()
    t0 = time.perf_counter()  # as for one store: from the host copies' end
    until_idle(writer)
    put_s = time.perf_counter() - t0
    for i in range(len(prompts)):
        writer.release(f"sw{tag}.{i}")
    got_before = reader.stats()["l3_get_bytes"]
    t0 = time.perf_counter()
    pending = {i: reader.match(f"sr{tag}.{i}", p).pending for i, p in enumerate(prompts)}
    while any(pending.values()):
        next_step(reader)
        for i in [i for i, waiting in pending.items() if waiting]:
            pending[i] = reader.match(f"sr{tag}.{i}", prompts[i]).pending
    fill_s = time.perf_counter() - t0
    for i in range(len(prompts)):
        reader.release(f"sr{tag}.{i}")
    got = reader.stats()["l3_get_bytes"] - got_before
    want = len(prompts) * pages * writer.layout.page_size
    if got != want:
        raise SystemExit(f"streamed requests fetched {got} bytes from L3, not {want}")
    return put_s, fill_s


def breaker_opened(cache: HiCache, rng: np.random.Generator, timeout_s: float = 60.0) -> None:
    """Keep the cache busy (untimed) until its store reads unavailable: the breaker opens after
    `breaker_failures` calls have failed, each after up to `call_timeout_s`."""
    deadline = time.monotonic() + timeout_s
    i = 0
    while cache.stats()["l3_available"]:
        if time.monotonic() > deadline:
            raise SystemExit(f"the breaker did not open within {timeout_s:g} s of the kill")
        tokens = rng.integers(0, 50_000, 64 * 16 + 1, dtype=np.int32)
        cache.store(f"warm{i}", tokens, list(range(64)))
        cache.release(f"warm{i}")
        cache.poll()
        time.sleep(0.05)
        i += 1


def engine_thread_times(
    master: MooncakeMaster | None, calls: int, phase: str, load_gbps: float | None = None
) -> dict:
    """Wall and CPU time of store, match and poll on the engine thread. `master` None: a
    host-only cache (the baseline); phase 'down' kills the master just before the calls (its
    breaker is still closed: work is still offered to it), 'down_open' kills it and waits until
    the breaker has opened (nothing is offered).

    With a master, a host-only cache makes the same calls side by side, alternating which of
    the two goes first (`alongside`): the machine's own drift (clock, other load) hits both
    alike, so the difference is what L3 costs the engine thread.

    Phase 'host_only_store_busy_elsewhere' times a host-only cache alone while another process
    puts objects of a group's size into the store (`l3_raw.store_load`), at `load_gbps` (the
    saturated phase's put rate) or without pause: the store's traffic of the saturated phase
    without L3's threads in this process. Where the host-only cache is fast here and slow
    beside a saturated L3 cache, what slows it lives in the process; where it is slow in both,
    the traffic itself. Phase 'l3_engine_part_busy_elsewhere' adds to that load an L3 cache
    (and a host-only one alongside) whose jobs are answered on the engine thread
    (`answer_on_engine_thread`): the engine thread's own part of L3, without its workers."""
    elsewhere = phase == "host_only_store_busy_elsewhere"
    engine_part = phase == "l3_engine_part_busy_elsewhere"
    cache = make_cache(None if elsewhere else master, ENGINE_PAGE, 128, write_queue_depth=2)
    pair = make_cache(None, ENGINE_PAGE, 128) if master is not None and not elsewhere else None
    if engine_part:
        answer_on_engine_thread(cache)
    rng = np.random.default_rng(1)
    calls_timed = ("store", "store_scattered", "match", "poll")
    names = [f"{c}_{k}" for c in calls_timed for k in ("wall_us", "cpu_us")]
    times: dict[str, list[float]] = {n: [] for n in names}
    beside: dict[str, list[float]] = {n: [] for n in names}
    hashed: list[float] = []  # the CPU's own speed, once per step

    profile = cProfile.Profile() if PROFILE else None
    collections = [0]  # garbage collections so far (any generation)
    with_gc: dict[str, int] = {}  # calls during which one ran
    pauses: list[float] = []  # how long each took (µs)
    began = [0.0]

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            collections[0] += 1
            began[0] = time.perf_counter()
        else:
            pauses.append((time.perf_counter() - began[0]) * 1e6)

    def timed(into: dict, name: str, fn) -> None:
        before = collections[0]
        w0, c0 = time.perf_counter(), time.thread_time()
        if profile is not None and into is times and name.startswith("store"):
            profile.runcall(fn)
        else:
            fn()
        into[f"{name}_wall_us"].append((time.perf_counter() - w0) * 1e6)
        into[f"{name}_cpu_us"].append((time.thread_time() - c0) * 1e6)
        if into is times and collections[0] != before:
            with_gc[name] = with_gc.get(name, 0) + 1

    def step(c: HiCache, into: dict, i: int, tokens, more, other, scattered) -> None:
        timed(into, "store", lambda: c.store(f"s{i}", tokens, list(range(64))))
        c.release(f"s{i}")
        timed(into, "store_scattered", lambda: c.store(f"t{i}", more, scattered))
        c.release(f"t{i}")
        timed(into, "match", lambda: c.match(f"m{i}", other))
        c.release(f"m{i}")
        timed(into, "poll", c.poll)

    if GC_FREEZE:
        gc.collect()
        gc.freeze()  # what engines do once started: the start-up heap is never scanned again
    gc.callbacks.append(count)

    load: dict[str, float] = {}
    put_before = cache.stats().get("l3_put_bytes", 0)
    try:
        if phase.startswith("down"):
            master.kill()
        if phase == "down_open":
            breaker_opened(cache, rng)
        with contextlib.ExitStack() as busy:
            if elsewhere or engine_part:
                load = busy.enter_context(
                    store_load(master.address, 4 * ENGINE_PAGE, gbps=load_gbps)
                )
            started = time.perf_counter()
            busy.enter_context(on_engine_cpu())
            for i in range(calls):
                prompts = [rng.integers(0, 50_000, 64 * 16 + 1, dtype=np.int32) for _ in range(3)]
                scattered = rng.permutation(128)[:64].tolist()
                turns = [(cache, times)] if pair is None else [(cache, times), (pair, beside)]
                for c, into in turns[:: 1 if i % 2 else -1]:
                    step(c, into, i, *prompts, scattered)
                hashed.append(reference_hash_us())
            seconds = time.perf_counter() - started
        stats = cache.stats()
        if profile is not None:
            print(f"== profile of store, {phase}", file=sys.stderr)
            pstats.Stats(profile, stream=sys.stderr).sort_stats("tottime").print_stats(20)
    finally:
        gc.callbacks.remove(count)
        if GC_FREEZE:
            gc.unfreeze()
        if phase.startswith("down"):
            master.restart()
        cache.close()
        if pair is not None:
            pair.close()

    return {
        "calls": calls,
        **{k: percentiles(v) for k, v in times.items()},
        "puts_dropped": stats["l3_puts_dropped"],
        "puts_skipped_store_down": stats["l3_puts_skipped"],
        "l3_errors": stats["l3_errors"],
        "fetches_skipped_store_down": stats["l3_skipped"],
        "seconds": round(seconds, 2),
        # bytes this cache's write-behind put per second meanwhile, or the other process's
        "store_put_gbps": load.get("gbps")
        if elsewhere or engine_part
        else round((stats.get("l3_put_bytes", 0) - put_before) / seconds / 1e9, 3),
        "reference_hash_us": percentiles(hashed),
        "calls_with_a_garbage_collection": with_gc,
        "garbage_collections": {"count": len(pauses), **(percentiles(pauses) if pauses else {})},
        **({"host_only_alongside": {k: percentiles(v) for k, v in beside.items()}} if pair else {}),
    }


def main() -> None:
    torch.set_num_threads(1)  # the CPU page copy stands in for a GPU kernel launch: no OMP pool
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--segment-gib", type=int, default=8, help="the store's segment (GiB)")
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda for a GPU pool")
    ap.add_argument("--out")
    ap.add_argument(
        "--parts", default="throughput,engine", help="throughput, engine (comma-separated)"
    )
    ap.add_argument("--profile", action="store_true", help="cProfile of store on stderr")
    ap.add_argument(
        "--gc-freeze", action="store_true", help="gc.freeze() before the engine-thread timings"
    )
    ap.add_argument(
        "--engine-cpu",
        type=int,
        help="time the engine thread on this CPU; everything else (the caches' L3 threads "
        "through worker_cpus, the master, the raw clients) runs on the other cores",
    )
    ap.add_argument(
        "--avoid-cpus",
        default="",
        help="with --engine-cpu: CPUs (comma-separated) where nothing else runs either",
    )
    ap.add_argument("--fetch-workers", type=int, help="the caches' fetch_workers")
    ap.add_argument(
        "--own-process", action="store_true", help="the caches' store clients in their own process"
    )
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    global DEVICE, CUDA, ENGINE_PAGE, PROFILE, GC_FREEZE, FETCH_WORKERS, OWN_PROCESS
    FETCH_WORKERS, OWN_PROCESS = args.fetch_workers, args.own_process
    DEVICE, CUDA, PROFILE = args.device, args.device.startswith("cuda"), args.profile
    GC_FREEZE = args.gc_freeze
    if args.engine_cpu is not None:
        avoid = frozenset(int(c) for c in args.avoid_cpus.split(",") if c)
        pin_engine(args.engine_cpu, avoid)  # before the master and the caches start their threads
    if CUDA:
        torch.cuda.set_stream(torch.cuda.Stream())  # an engine's own stream
        ENGINE_PAGE = 64 * KiB
    master = MooncakeMaster().start()
    segment = args.segment_gib << 30
    # hicache's objects stay in the store (the raw ones are removed): a round leaves 5 stores of
    # 128 pages at each page size. They must fit below the master's eviction mark (90 %), or
    # the raw objects of the next round may be evicted before they are read.
    kept = (args.rounds + 1) * 5 * 128 * (128 * KiB + 1 * MiB)
    if "throughput" in parts and kept > 0.85 * segment:
        raise SystemExit(
            f"--rounds {args.rounds} leaves {kept / 2**30:.1f} GiB in the store: give "
            f"--segment-gib {int(kept / 0.85 / 2**30) + 1} or fewer rounds"
        )
    holder = SegmentHolder(master.address, segment)
    try:
        flow, baseline, saturated, elsewhere, engine_part = [], None, None, None, None
        down, down_open = None, None
        if "throughput" in parts:
            touch_segment(master, segment)
            flow = [throughput(master, args.rounds, size) for size in (128 * KiB, 1 * MiB)]
        if "engine" in parts:
            baseline = engine_thread_times(None, args.calls, "host_only")
            saturated = engine_thread_times(master, args.calls, "saturated")
            elsewhere = engine_thread_times(
                master, args.calls, "host_only_store_busy_elsewhere", saturated["store_put_gbps"]
            )
            engine_part = engine_thread_times(
                master, args.calls, "l3_engine_part_busy_elsewhere", saturated["store_put_gbps"]
            )
            down = engine_thread_times(master, args.calls, "down")
            down_open = engine_thread_times(master, args.calls, "down_open")
    finally:
        holder.close()
        master.stop()
    result = {
        "bench": "l3_cache",
        "machine": f"{os.cpu_count()} CPUs ({platform.machine()})"
        + (f", {torch.cuda.get_device_name()}" if CUDA else ", no GPU")
        + ", loopback TCP, Mooncake 0.3.13.post1",
        "command": "python " + " ".join(sys.argv),
        "engine_cpu": ENGINE_CPU,
        "other_cpus": sorted(OTHERS),
        "fetch_workers": FETCH_WORKERS or threads.fetch_workers(OTHERS),
        "own_process": OWN_PROCESS,
        "throughput": flow,
        "engine_thread_host_only_baseline": baseline,
        "engine_thread_store_saturated": saturated,
        "engine_thread_host_only_store_busy_elsewhere": elsewhere,
        "engine_thread_l3_engine_part_busy_elsewhere": engine_part,
        "engine_thread_store_down": down,
        "engine_thread_store_down_breaker_open": down_open,
        "targets": {"ratio": 0.9, "p99_us": 200},
    }
    report(result, args.out)


if __name__ == "__main__":
    main()
