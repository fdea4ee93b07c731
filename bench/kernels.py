"""Benchmark of the page copies on a CUDA GPU; prints one JSON document on stdout.

    python bench/kernels.py [--gib 1] [--reps 7] [--sweep] [--table] [--out FILE]

Measured in one run, against the same run's contiguous ``cudaMemcpyAsync`` (the ceiling: the
faster of two measurements, at the start of the run and at its end):
``copy_pages`` (path "auto"), each CUDA path forced, and a loop of one ``cudaMemcpyAsync`` per
page, for pages of 64 KiB, 512 KiB, 4 MiB and 16 MiB, host→GPU and GPU→host; both directions at
once; segmented (layer-first) GPU pools against a page-first host pool; vLLM's own layout (one
separately allocated ``(2, blocks, 16, 8, 128)`` bf16 tensor per layer, 32 layers: an 8B model's
KV in 16-token blocks) against a page-first host pool of 2 MiB pages; and the slowdown of a
bf16 GEMM loop while copies run in both directions. ``--sweep`` adds kernel shapes and grid
bounds. ``--table`` also writes each row on stderr as it is measured.

Method: each measurement moves `--gib` GiB per direction between pools of `POOL_BYTES` (far
larger than the L2) with page ids drawn at random without repeats; its time is taken with CUDA
events on a stream that a short sleep kernel holds while the host enqueues, so the figure is
the device's time (the host's enqueue time is reported beside it as ``host_ms``); the median of
`--reps` timed runs after one warm-up. A few copied pages are compared byte for byte.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from common import command, commit, cpu_model

from hicache.kernels import PagedBuffer, copy_pages
from hicache.kernels.cuda import (
    COPY_ENGINE_MIN_ROW_BYTES,
    COPY_ENGINE_ROWS_PER_CALL,
    KERNEL_CHUNK_BYTES,
    KERNEL_MAX_BLOCKS,
    STAGED_BLOCKS,
    STAGING_BYTES,
    choose_path,
    copy_pages_cuda,
    copy_pages_loop,
    load_extension,
)

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
POOL_BYTES = 2 * GiB
PAGE_SIZES = (64 * KiB, 512 * KiB, 4 * MiB, 16 * MiB)
SLEEP_CYCLES = 20_000_000  # ~10 ms at H200 clocks: covers the host's enqueue of one copy call
METHODS = ("auto", "kernel", "copy_engine", "loop")
#: vLLM's KV caches for Llama-3-8B in bf16: layers, block size, KV heads, head dim.
VLLM_SHAPE = (32, 16, 8, 128)
ROUNDS = 4  # copy calls per direction while the GEMM loop runs
GEMM_HEAD_START_CYCLES = 40_000_000  # ~20 ms: the copies start before the GEMMs

Enqueue = Callable[[list[torch.cuda.Stream]], None]


class Pools:
    """Two pinned host pools and two GPU pools of random bytes (a and b: one per direction)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.gpu_a = torch.randint(0, 256, (POOL_BYTES,), dtype=torch.uint8, device=device)
        self.gpu_b = torch.randint(0, 256, (POOL_BYTES,), dtype=torch.uint8, device=device)
        self.host_a = torch.empty(POOL_BYTES, dtype=torch.uint8, pin_memory=True)
        self.host_b = torch.empty(POOL_BYTES, dtype=torch.uint8, pin_memory=True)
        self.host_a.copy_(self.gpu_b)
        self.host_b.copy_(self.gpu_a)
        torch.cuda.synchronize(device)

    @staticmethod
    def page_first(flat: torch.Tensor, page_bytes: int) -> PagedBuffer:
        pages = flat.numel() // page_bytes
        return PagedBuffer.page_first(flat[: pages * page_bytes].view(pages, page_bytes))

    @staticmethod
    def layer_first(flat: torch.Tensor, layers: int, row_bytes: int) -> PagedBuffer:
        pages = flat.numel() // (layers * row_bytes)
        view = flat[: layers * pages * row_bytes].view(layers, pages, row_bytes)
        return PagedBuffer.layer_first([view[i] for i in range(layers)])


def _ids(src: PagedBuffer, dst: PagedBuffer, n: int, gen: torch.Generator):
    src_ids = torch.randperm(src.num_pages, generator=gen)[:n].to(torch.int32)
    dst_ids = torch.randperm(dst.num_pages, generator=gen)[:n].to(torch.int32)
    return src_ids, dst_ids


def _verify(src: PagedBuffer, src_ids, dst: PagedBuffer, dst_ids, sample: int = 3) -> None:
    for j in range(0, src_ids.numel(), max(1, src_ids.numel() // sample)):
        for s_seg, d_seg in zip(src.segments, dst.segments, strict=True):
            a = s_seg[int(src_ids[j])].cpu()
            b = d_seg[int(dst_ids[j])].cpu()
            if not torch.equal(a, b):
                raise RuntimeError(f"page copy gave wrong bytes (page pair {j})")


def _copy(method: str, src, src_ids, dst, dst_ids, stream, **knobs) -> None:
    if method == "auto":
        copy_pages(src, src_ids, dst, dst_ids, stream)
    elif method == "loop":
        copy_pages_loop(src, src_ids, dst, dst_ids, stream)
    else:
        copy_pages_cuda(src, src_ids, dst, dst_ids, stream, path=method, **knobs)


def sleep_cycles_per_ms(device: torch.device) -> float:
    """GPU clock cycles of ``torch.cuda._sleep`` per millisecond, measured."""
    stream = torch.cuda.current_stream(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(SLEEP_CYCLES)  # warm-up
    start.record(stream)
    torch.cuda._sleep(SLEEP_CYCLES)
    end.record(stream)
    end.synchronize()
    return SLEEP_CYCLES / start.elapsed_time(end)


def measure(
    enqueue: Enqueue, streams: list[torch.cuda.Stream], reps: int, cycles_per_ms: float
) -> dict:
    """Median device time (ms) of `enqueue`, which puts work on `streams`; also each stream's own
    median time from the common start, and the host's enqueue time.

    The streams are held by a sleep kernel while the host enqueues, so that the time is the
    device's: the warm-up run measures the enqueue, and the timed runs sleep 1.5 times as long
    (at least `SLEEP_CYCLES`). ``host_ms`` says whether one host thread could feed the device
    at that rate (it could where host_ms < ms)."""
    device_ms, host_ms, own_ms = [], [], []
    sleep = SLEEP_CYCLES
    for rep in range(reps + 1):
        first = streams[0]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(first):
            torch.cuda._sleep(sleep)
        start.record(first)
        for s in streams[1:]:
            s.wait_event(start)
        t0 = time.perf_counter()
        enqueue(streams)
        host = (time.perf_counter() - t0) * 1e3
        ends = []
        for s in streams:
            ends.append(torch.cuda.Event(enable_timing=True))
            ends[-1].record(s)
            first.wait_event(ends[-1])
        end.record(first)
        end.synchronize()
        if rep:  # the first run is the warm-up
            device_ms.append(start.elapsed_time(end))
            host_ms.append(host)
            own_ms.append([start.elapsed_time(e) for e in ends])
        else:
            sleep = max(SLEEP_CYCLES, int(1.5 * host * cycles_per_ms))
    return {
        "ms": statistics.median(device_ms),
        "ms_min": min(device_ms),
        "ms_max": max(device_ms),
        "host_ms": round(statistics.median(host_ms), 3),
        "stream_ms": [statistics.median(col) for col in zip(*own_ms, strict=True)],
    }


def _row(case, page_bytes, direction, moved, timing, ceiling, **extra) -> dict:
    gbps = moved / timing["ms"] / 1e6
    return {
        "case": case,
        "page_bytes": page_bytes,
        "direction": direction,
        "gbps": round(gbps, 2),
        "ceiling_gbps": round(ceiling, 2) if ceiling else None,
        "ratio": round(gbps / ceiling, 4) if ceiling else None,
        "gbps_range": [
            round(moved / timing["ms_max"] / 1e6, 2),
            round(moved / timing["ms_min"] / 1e6, 2),
        ],
        "host_ms": timing["host_ms"],
        **extra,
    }


class Bench:
    def __init__(self, gib: float, reps: int, verbose: bool) -> None:
        self.verbose = verbose
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.bytes = int(gib * GiB)
        self.reps = reps
        self.pools = Pools(self.device)
        self.streams = [torch.cuda.Stream(self.device) for _ in range(3)]
        self.gen = torch.Generator().manual_seed(1234)
        self.cycles_per_ms = sleep_cycles_per_ms(self.device)
        self.rows: list[dict] = []
        self.ceiling: dict[str, float] = {}
        self._vllm: dict[str, PagedBuffer] = {}

    def add(self, row: dict) -> dict:
        self.rows.append(row)
        if self.verbose:
            print(_line(row), file=sys.stderr, flush=True)
        return row

    def safely(self, fn: Callable[..., dict | None], *args, **kwargs) -> dict:
        """Run one case; a failure becomes a row with an "error" field instead of ending the run."""
        try:
            return fn(*args, **kwargs) or {}
        except Exception as exc:  # reported in the output, not hidden
            case = kwargs.get("case") or f"{fn.__name__}_{args[0]}"
            return self.add(
                {"case": case, "args": repr(args), "knobs": repr(kwargs), "error": repr(exc)}
            )

    def pair(self, direction: str, page_bytes: int, layers: int = 0):
        """(src, dst) buffers for a direction; GPU pools layer-first when `layers`."""
        p = self.pools
        host, gpu = (p.host_a, p.gpu_a) if direction == "h2d" else (p.host_b, p.gpu_b)
        host_buf = Pools.page_first(host, page_bytes)
        if layers:
            gpu_buf = Pools.layer_first(gpu, layers, page_bytes // layers)
            host_buf = host_buf.resegment(gpu_buf.seg_bytes)
        else:
            gpu_buf = Pools.page_first(gpu, page_bytes)
        return (host_buf, gpu_buf) if direction == "h2d" else (gpu_buf, host_buf)

    def vllm_pair(self, direction: str):
        """(src, dst) for a direction between vLLM-shaped GPU caches and a page-first host pool
        of 2 MiB pages: per direction 32 tensors of (2, blocks, 16, 8, 128) bf16, each its own
        allocation, `POOL_BYTES` in all, made at first use and kept."""
        gpu = self._vllm.get(direction)
        if gpu is None:
            layers, block, heads, dim = VLLM_SHAPE
            blocks = POOL_BYTES // (layers * 2 * block * heads * dim * 2)
            tensors = []
            for _ in range(layers):
                shape = (2, blocks, block, heads, dim)
                t = torch.empty(shape, dtype=torch.bfloat16, device=self.device)
                t.view(torch.uint8).random_(0, 256)
                tensors.append(t)
            gpu = self._vllm[direction] = PagedBuffer.from_kv_tensors(tensors)
        p = self.pools
        host = Pools.page_first(p.host_a if direction == "h2d" else p.host_b, gpu.page_bytes)
        host = host.resegment(gpu.seg_bytes)
        return (host, gpu) if direction == "h2d" else (gpu, host)

    def contiguous(self, case: str = "memcpy_contiguous") -> None:
        """Measure the ceiling; a second call keeps the faster figure (see `rescale`)."""
        p, n = self.pools, self.bytes
        ops = {
            "h2d": lambda s: p.gpu_a[:n].copy_(p.host_a[:n], non_blocking=True),
            "d2h": lambda s: p.host_b[:n].copy_(p.gpu_b[:n], non_blocking=True),
        }

        def run(directions):
            def enqueue(streams):
                for d, s in zip(directions, streams, strict=False):
                    with torch.cuda.stream(s):
                        ops[d](s)

            return enqueue

        for direction in ("h2d", "d2h", "both"):
            moved = 2 * n if direction == "both" else n
            jobs = ["h2d", "d2h"] if direction == "both" else [direction]
            t = measure(run(jobs), self.streams[: len(jobs)], self.reps, self.cycles_per_ms)
            gbps = moved / t["ms"] / 1e6
            self.ceiling[direction] = max(gbps, self.ceiling.get(direction, 0.0))
            self.add(_row(case, n, direction, moved, t, self.ceiling[direction]))

    def rescale(self) -> None:
        """Give every row its ratio to the final ceiling (the faster of the two measurements)."""
        for row in self.rows:
            ceiling = self.ceiling.get(row.get("direction"))
            if row.get("ceiling_gbps") and ceiling:
                row["ceiling_gbps"] = round(ceiling, 2)
                row["ratio"] = round(row["gbps"] / ceiling, 4)

    def pages(self, method, page_bytes, direction, layers=0, case=None, **knobs) -> dict:
        """One case; `layers` = "vllm" takes `vllm_pair` (pages of 2 MiB)."""
        directions = ["h2d", "d2h"] if direction == "both" else [direction]
        jobs = []
        for d in directions:
            if layers == "vllm":
                src, dst = self.vllm_pair(d)
            else:
                src, dst = self.pair(d, page_bytes, layers)
            sid, did = _ids(src, dst, self.bytes // page_bytes, self.gen)
            jobs.append((src, sid, dst, did))

        def enqueue(streams):
            for (src, sid, dst, did), s in zip(jobs, streams, strict=False):
                _copy(method, src, sid, dst, did, s, **knobs)

        t = measure(enqueue, self.streams[: len(jobs)], self.reps, self.cycles_per_ms)
        for src, sid, dst, did in jobs:
            _verify(src, sid, dst, did)
        each = (self.bytes // page_bytes) * page_bytes
        moved = len(jobs) * each
        path = choose_path(jobs[0][0], jobs[0][2]) if method == "auto" else method
        if direction == "both":  # each direction's own rate, from the common start to its end
            knobs["gbps_each"] = [round(each / ms / 1e6, 2) for ms in t["stream_ms"]]
        if layers == "vllm":
            layers, block, heads, dim = VLLM_SHAPE
            layout = f"vllm_{layers}x(2,N,{block},{heads},{dim})bf16"
        else:
            layout = f"{layers}x{page_bytes // layers // KiB}KiB" if layers else "page_first"
        row = _row(
            case or f"pages_{method}",
            page_bytes,
            direction,
            moved,
            t,
            self.ceiling[direction],
            path=path,
            layout=layout,
            **knobs,
        )
        return self.add(row)

    def gemm(self, method: str, page_bytes: int, iters: int = 30, layers: int = 0, **knobs) -> None:
        """Slowdown of a bf16 GEMM loop on one stream while copies run both ways on two others.
        Runs with and without copies alternate, so that both see the same clocks."""
        g = torch.Generator(device=self.device).manual_seed(7)
        a = torch.randn(8192, 8192, device=self.device, dtype=torch.bfloat16, generator=g)
        b = torch.randn(8192, 8192, device=self.device, dtype=torch.bfloat16, generator=g)
        c = torch.empty_like(a)
        gemm_stream, s1, s2 = self.streams
        jobs = []
        for d, s in (("h2d", s1), ("d2h", s2)):
            src, dst = self.pair(d, page_bytes, layers)
            sid, did = _ids(src, dst, self.bytes // page_bytes, self.gen)
            jobs.append((src, sid, dst, did, s))

        def gemms(with_copies: bool) -> tuple[float, float | None]:
            # The GEMM stream first sleeps, so that the copies (enqueued after the GEMMs, and
            # started at once on their own streams) are under way when the first GEMM starts,
            # and outlast the last one.
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(gemm_stream):
                torch.cuda._sleep(GEMM_HEAD_START_CYCLES)
                e0.record(gemm_stream)
                for _ in range(iters):
                    torch.mm(a, b, out=c)
                e1.record(gemm_stream)
            if with_copies:
                c0 = torch.cuda.Event(enable_timing=True)
                c0.record(s1)
                s2.wait_event(c0)
                for _ in range(ROUNDS):
                    for src, sid, dst, did, s in jobs:
                        _copy(method, src, sid, dst, did, s, **knobs)
            e1.synchronize()
            if not with_copies:
                return e0.elapsed_time(e1), None
            c1 = torch.cuda.Event(enable_timing=True)
            s1.wait_stream(s2)
            c1.record(s1)
            c1.synchronize()
            return e0.elapsed_time(e1), c0.elapsed_time(c1)

        gemms(False)  # warm-up: cuBLAS handle and workspace, copy path
        gemms(True)
        alone, busy, copy_ms = [], [], []
        for _ in range(self.reps):
            alone.append(gemms(False)[0])
            gemm_ms, ms = gemms(True)
            busy.append(gemm_ms)
            copy_ms.append(ms)
        alone_ms, busy_ms = statistics.median(alone), statistics.median(busy)
        moved = ROUNDS * 2 * (self.bytes // page_bytes) * page_bytes
        timing = {
            "ms": statistics.median(copy_ms),
            "ms_min": min(copy_ms),
            "ms_max": max(copy_ms),
            "host_ms": None,
        }
        self.add(
            _row(
                "gemm_concurrent",
                page_bytes,
                "both",
                moved,
                timing,
                self.ceiling["both"],
                path=method,
                gemm_ms_alone=round(alone_ms, 3),
                gemm_ms_with_copies=round(busy_ms, 3),
                gemm_ms_alone_range=[round(min(alone), 3), round(max(alone), 3)],
                gemm_ms_with_copies_range=[round(min(busy), 3), round(max(busy), 3)],
                gemm_slowdown=round(busy_ms / alone_ms - 1, 4),
                gemm_slowdown_of_minimums=round(min(busy) / min(alone) - 1, 4),
                layout=f"{layers}x{page_bytes // layers // KiB}KiB" if layers else "page_first",
                **knobs,
            )
        )


def run(args: argparse.Namespace) -> dict:
    load_extension()  # the build is not part of any measurement
    bench = Bench(args.gib, args.reps, args.table)
    bench.contiguous()
    if args.pages:  # only page-first pages of these sizes, each path, both ways
        return _only_pages(bench, [int(k) * KiB for k in args.pages.split(",")])
    for page_bytes in PAGE_SIZES:
        for direction in ("h2d", "d2h"):
            for method in METHODS:
                bench.safely(bench.pages, method, page_bytes, direction)
    for page_bytes in PAGE_SIZES:
        for method in ("auto", "kernel", "copy_engine"):
            bench.safely(bench.pages, method, page_bytes, "both")
    # Below the copy-engine threshold: pages of 16 and 32 KiB.
    for page_bytes in (16 * KiB, 32 * KiB):
        for direction in ("h2d", "d2h"):
            for method in ("auto", "kernel", "copy_engine"):
                bench.safely(bench.pages, method, page_bytes, direction, case=f"small_{method}")
    # Segmented: 32 x 64 KiB, 64 x 32 KiB and 128 x 16 KiB rows, against page-first 2 MiB pages.
    for direction in ("h2d", "d2h"):
        for method in ("auto", "kernel", "copy_engine", "staged"):
            flat = bench.safely(bench.pages, method, 2 * MiB, direction, case=f"pages_{method}")
            for layers in (32, 64, 128):
                seg = bench.safely(
                    bench.pages, method, 2 * MiB, direction, layers, case=f"segmented_{method}"
                )
                if "gbps" in seg and "gbps" in flat:
                    seg["vs_page_first"] = round(seg["gbps"] / flat["gbps"], 4)
        bench.safely(bench.pages, "loop", 2 * MiB, direction, 32, case="segmented_loop")
    # vLLM's layout: 32 separate per-layer (2, N, 16, 8, 128) bf16 caches, 2 MiB pages.
    for direction in ("h2d", "d2h", "both"):
        for method in ("auto", "kernel", "copy_engine", "staged"):
            if direction == "both" and method != "auto":
                continue
            bench.safely(bench.pages, method, 2 * MiB, direction, "vllm", case=f"vllm_{method}")
    for method in ("auto", "kernel", "copy_engine"):
        for page_bytes in (64 * KiB, 4 * MiB):
            bench.safely(bench.gemm, method, page_bytes)
    bench.safely(bench.gemm, "auto", 2 * MiB, layers=64)  # the staged path
    if args.sweep:
        sweep(bench)
    return _finish(bench, args)


def _only_pages(bench: Bench, sizes: list[int]) -> dict:
    """`--pages`: each path for page-first pages of `sizes` bytes, host→GPU and GPU→host."""
    for page_bytes in sizes:
        for direction in ("h2d", "d2h"):
            for method in ("auto", "kernel", "copy_engine"):
                bench.safely(bench.pages, method, page_bytes, direction)
    return _finish(bench, argparse.Namespace(reps=bench.reps))


def _finish(bench: Bench, args: argparse.Namespace) -> dict:
    """The closing ceiling, every row's ratio to it, and the run's record."""
    bench.contiguous("memcpy_contiguous_end")
    bench.rescale()
    props = torch.cuda.get_device_properties(bench.device)
    return {
        "commit": commit(),
        "machine": f"{props.name} ({props.multi_processor_count} SMs), "
        f"{os.cpu_count()} x {cpu_model()}",
        "command": command(),
        "gpu": props.name,
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "bytes_per_measurement": bench.bytes,
        "pool_bytes": POOL_BYTES,
        "reps": args.reps,
        "defaults": {
            "kernel_max_blocks": KERNEL_MAX_BLOCKS,
            "kernel_chunk_bytes": KERNEL_CHUNK_BYTES,
            "copy_engine_min_row_bytes": COPY_ENGINE_MIN_ROW_BYTES,
            "copy_engine_rows_per_call": COPY_ENGINE_ROWS_PER_CALL,
            "staging_bytes": STAGING_BYTES,
            "staged_blocks": STAGED_BLOCKS,
        },
        "rows": bench.rows,
    }


def sweep(bench: Bench) -> None:
    """Kernel grid bounds and chunk sizes; rows per copy-engine call."""
    bench.reps = 3
    for page_bytes in (16 * KiB, 64 * KiB):
        for direction in ("h2d", "d2h"):
            for blocks in (4, 8, 16):
                for chunk in (4 * KiB, 16 * KiB, 64 * KiB):
                    bench.safely(
                        bench.pages,
                        "kernel",
                        page_bytes,
                        direction,
                        case="sweep_kernel",
                        max_blocks=blocks,
                        chunk_bytes=chunk,
                    )
    for page_bytes in (32 * KiB, 64 * KiB, 512 * KiB, 4 * MiB):
        for direction in ("h2d", "d2h", "both"):
            for rows in (256, 2048, 1 << 30):
                bench.safely(
                    bench.pages,
                    "copy_engine",
                    page_bytes,
                    direction,
                    case="sweep_copy_engine",
                    rows_per_call=rows,
                )
    for blocks in (2, 16):
        bench.safely(bench.gemm, "kernel", 4 * MiB, max_blocks=blocks)


_KNOBS = (
    "layout",
    "path",
    "max_blocks",
    "chunk_bytes",
    "rows_per_call",
    "gbps_each",
    "gemm_slowdown",
    "vs_page_first",
    "error",
)


def _line(r: dict) -> str:
    knobs = {k: r[k] for k in _KNOBS if k in r}
    if "gbps" not in r:
        return f"{r['case']:<22} {knobs}"
    ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else "-"
    return (
        f"{r['case']:<22} {r['page_bytes']:>9} {r['direction']:<4} {r['gbps']:>7.2f} GB/s "
        f"{ratio:>6} host {r['host_ms']} ms {knobs}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python bench/kernels.py", description=__doc__)
    parser.add_argument("--gib", type=float, default=1.0, help="GiB moved per direction per run")
    parser.add_argument("--reps", type=int, default=7, help="timed runs per case (median)")
    parser.add_argument("--sweep", action="store_true", help="add kernel and copy-engine sweeps")
    parser.add_argument("--table", action="store_true", help="print each row on stderr as it comes")
    parser.add_argument(
        "--pages", help="only page-first pages of these KiB (e.g. 64,512): each path, both ways"
    )
    parser.add_argument(
        "--out", help="also write the JSON here (bench/results/kernels_<machine>.json)"
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the page-copy benchmark needs a CUDA GPU")
    text = json.dumps(run(args), indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
