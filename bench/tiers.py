"""The store tiers: what the tier chain costs the engine thread, and the disk tier's throughput.

    python bench/tiers.py engine-thread --out bench/results/tiers_<machine>.json
    python bench/tiers.py disk --dir /path/on/the/disk --machine <name> [--total 1GiB]

``engine-thread``: each configuration replays the same requests through a fresh `HiCache` on the
CPU: `--prompts` distinct prompts of `--pages` pages, twice over. The host tier holds a quarter of
them, so in the second pass a prompt is gone from the host: with the chain it is fetched from the
disk tier (it holds them all); host only, it is recomputed and stored again. The engine loop is an
engine's: match (asking again, one poll apart, while the answer is pending), load, store, release.
Every call the engine thread makes to hicache is timed, by its thread CPU time and by the wall
clock; the configurations take turns `--rounds` times so that both see the same machine. A third
configuration, host + Mooncake, gives one store tier's share. Rows give p50 and p99 in µs per call
kind and configuration, and each chain's figures less host-only's (what the chain adds on the engine
thread, for one store tier and for two).

Needs Mooncake (a master is started on loopback for the run). Prints JSON; with --out also
writes it.

``disk``: for each object size, in the same run and on the same directory:

- ``tier``: `DiskTier.put_from` / `get_into` of `--total` bytes of distinct objects, in batches
  of `--batch` objects, from and into page-aligned host memory (as the host tier's pools);
- ``raw``: the same bytes as one file per object, written and read by as many threads
  (`--threads`, the tier's ``io_threads``) with one ``pwritev``/``preadv`` each, with O_DIRECT
  when the tier uses it, no header, no rename; synced (``fdatasync``) exactly when the tier
  syncs, so that each row compares writes that give the same durability.

The two take turns going first, `--repeats` times; each row gives the median throughputs and
the median of the rounds' ratios (each round's raw and tier run back to back), with their range.
Before every read phase the files are dropped from the page cache (``posix_fadvise(DONTNEED)``
after a sync), so reads come from the device whether or not O_DIRECT applies. The tier is
measured with its default ``sync: true`` (each record synced before it is published) and, as a
second row, with ``sync: false``.

With `--codec-pages` (default 128; 0: none), two more read rows: a disk tier with ``codec:
lossless`` against one with ``codec: none``, fetched through a store tier's worker (headers,
checksums, decoding on `--codec-threads` threads; `bench/codec.py`'s disk mode) on synthetic
bf16 KV of llama-8b's shape (16-token pages, groups of 4): ``codec_ratio`` (bytes held by the
raw tier over the codec tier's), ``gbps`` (KV read), ``none_gbps`` (the codec: none tier's) and
``ratio`` (their quotient), for reads overlapped with decoding (``lossless``) and read-then-decode
(``lossless_serial``).

Writes ``bench/results/tiers_disk_<machine>.json`` (rows ``tier, op, object_bytes, gbps, raw_gbps,
ratio``) unless `--out` says otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from pydantic import ByteSize, TypeAdapter

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from common import command, commit  # noqa: E402
from mooncake_master import MooncakeMaster  # noqa: E402

from hicache import HiCache, PagedBuffer, load_config  # noqa: E402
from hicache.backends.base import Buffers  # noqa: E402
from hicache.backends.disk.config import DiskTierConfig  # noqa: E402
from hicache.backends.disk.records import read_full, write_full  # noqa: E402
from hicache.backends.disk.tier import DiskTier  # noqa: E402
from hicache.backends.memory import HostMemory  # noqa: E402

to_bytes = TypeAdapter(ByteSize).validate_python
RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)  # Linux: per thread

# -- engine-thread: match, store and poll with store tiers, against host only ----------------

PAGE_TOKENS = 16
PAGE_BYTES = 16 << 10
KINDS = ("match_first", "match_again", "store", "poll")


def config(tiers: list[dict], host_pages: int) -> dict:
    return {
        "layout": {
            "model": "bench-tiers",
            "kv_dtype": "bfloat16",
            "page_tokens": PAGE_TOKENS,
            "page_bytes": PAGE_BYTES,
        },
        "tiers": [{"type": "host", "size": host_pages * PAGE_BYTES}, *tiers],
        "policy": {"fetch_max_wait_ms": 5000},
    }


def replay(cfg: dict, prompts: list[np.ndarray], pages: int) -> dict[str, list[tuple[int, int]]]:
    """Run every prompt twice through a fresh cache; per call kind, (thread ns, wall ns)."""
    samples: dict[str, list[tuple[int, int]]] = {k: [] for k in KINDS}
    waits: dict[str, list[tuple[int, int, int]]] = {k: [] for k in KINDS}
    gpu = torch.zeros(pages + 1, PAGE_BYTES, dtype=torch.uint8)
    cache = HiCache(load_config(cfg, env={}), PagedBuffer.page_first(gpu))
    if not cache.wait_ready(60):
        raise RuntimeError("hicache was not ready in 60 s")
    blocks = list(range(pages + 1))

    def timed(kind: str, call: Callable[..., object], *args: object) -> object:
        r0 = resource.getrusage(RUSAGE_THREAD)
        t0, w0 = time.thread_time_ns(), time.perf_counter_ns()
        out = call(*args)
        t1, w1 = time.thread_time_ns(), time.perf_counter_ns()
        r1 = resource.getrusage(RUSAGE_THREAD)
        samples[kind].append((t1 - t0, w1 - w0))
        # why a call was off the CPU: waits (a lock, the GIL), preemption, page faults
        waits[kind].append(
            (r1.ru_nvcsw - r0.ru_nvcsw, r1.ru_nivcsw - r0.ru_nivcsw, r1.ru_minflt - r0.ru_minflt)
        )
        return out

    try:
        for i, tokens in enumerate(prompts + prompts):
            rid = f"r{i}"
            timed("poll", cache.poll)
            m = timed("match_first", cache.match, rid, tokens)
            deadline = time.monotonic() + 10
            while m.pending:  # type: ignore[attr-defined]
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{rid}: pending for 10 s")
                time.sleep(0.0002)
                timed("poll", cache.poll)
                m = timed("match_again", cache.match, rid, tokens)
            cache.load(m, blocks)  # type: ignore[arg-type]
            timed("store", cache.store, rid, tokens, blocks)
            cache.release(rid)
        deadline = time.monotonic() + 30
        while not cache.tiers_idle and time.monotonic() < deadline:
            cache.poll()
            time.sleep(0.001)
        stats = cache.stats()
    finally:
        cache.close()
    fetched = sum(
        v for k, v in stats.items() if k.startswith("hit_tokens_") and k != "hit_tokens_host"
    )
    samples["_stats"] = [(fetched, stats["hit_tokens_host"])]
    for kind in KINDS:
        samples[f"_waits_{kind}"] = waits[kind]  # type: ignore[assignment]
    return samples


def pct(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1e3


def engine_thread(args: argparse.Namespace) -> None:
    rng = np.random.default_rng(0)
    n_tokens = args.pages * PAGE_TOKENS + 1
    host_pages = args.prompts * args.pages // 4
    results: dict[str, dict[str, list[tuple[int, int]]]] = {}
    hits: dict[str, list[tuple[int, int]]] = {}
    switches: dict[str, dict[str, list]] = {}
    with MooncakeMaster() as master, tempfile.TemporaryDirectory() as tmp:
        segment = 2 * args.prompts * args.pages * PAGE_BYTES
        moon = {
            **master.tier_config,
            "type": "mooncake",
            "global_segment_size": max(segment, 16 << 20),
        }
        for r in range(args.rounds):
            base = 1_000_000 * r  # fresh prompts every round: nothing is held from the last
            prompts = [
                rng.integers(base, base + 50_000, n_tokens).astype(np.int32)
                for _ in range(args.prompts)
            ]
            disk = {"type": "disk", "path": f"{tmp}/d{r}", "size": 2 * segment}
            prefix = f"bench{os.getpid()}r{r}"
            configs = {
                "host_only": config([], host_pages),
                "host_mooncake": config([{**moon, "key_prefix": f"{prefix}m"}], host_pages),
                "host_disk_mooncake": config(
                    [disk, {**moon, "key_prefix": f"{prefix}dm"}], host_pages
                ),
            }
            for name, cfg in configs.items():
                got = replay(cfg, prompts, args.pages)
                hits.setdefault(name, []).extend(got.pop("_stats"))
                for kind in KINDS:
                    switches.setdefault(name, {}).setdefault(kind, []).extend(
                        got.pop(f"_waits_{kind}")  # type: ignore[arg-type]
                    )
                for kind, values in got.items():
                    results.setdefault(name, {}).setdefault(kind, []).extend(values)

    rows = []
    for kind in KINDS:
        row: dict[str, object] = {"call": kind}
        for name, by_kind in results.items():
            values = by_kind[kind]
            if not values:
                continue
            cpu, wall = [v[0] for v in values], [v[1] for v in values]
            row[name] = {
                "calls": len(values),
                "cpu_p50_us": round(pct(cpu, 0.5), 1),
                "cpu_p99_us": round(pct(cpu, 0.99), 1),
                "wall_p50_us": round(pct(wall, 0.5), 1),
                "wall_p99_us": round(pct(wall, 0.99), 1),
                # off the CPU inside the call: waiting for the GIL, a lock or the scheduler
                "off_cpu_p99_us": round(pct([w - c for c, w in values], 0.99), 1),
                # per call, over the 1 % of calls slowest by wall clock: voluntary context
                # switches (the thread waited: a lock, the GIL, I/O), involuntary ones (the OS
                # preempted it) and minor page faults
                "slowest_1pct": _slowest(values, switches[name][kind]),
                "cpu_mean_us": round(statistics.fmean(cpu) / 1e3, 1),
            }
        base = row.get("host_only")
        for name in ("host_mooncake", "host_disk_mooncake"):
            if isinstance(base, dict) and isinstance(row.get(name), dict):
                for q in ("p50", "p99"):
                    added = row[name][f"cpu_{q}_us"] - base[f"cpu_{q}_us"]  # type: ignore[index]
                    row[f"{name}_adds_cpu_{q}_us"] = round(added, 1)
                ratio = row[name]["wall_p99_us"] / max(base["wall_p99_us"], 1e-3)  # type: ignore[index]
                row[f"{name}_wall_p99_over_host_only"] = round(ratio, 2)
        rows.append(row)
    out = {
        "bench": "tiers",
        "commit": commit(),
        "machine": f"{os.cpu_count()} CPUs ({platform.machine()}), CPU only, loopback TCP",
        "command": command(),
        "workload": {
            "prompts": args.prompts,
            "pages": args.pages,
            "page_bytes": PAGE_BYTES,
            "host_pages": host_pages,
            "rounds": args.rounds,
            "passes": 2,
        },
        "hit_tokens_fetched_host": {k: [sum(x) for x in zip(*v)] for k, v in hits.items()},
        "rows": rows,
    }
    text = json.dumps(out, indent=2)
    print(text)
    _print_walls(rows)
    if args.out:
        args.out.write_text(text + "\n")


def _slowest(values: list[tuple[int, int]], waits: list[tuple[int, int, int]]) -> dict:
    order = sorted(range(len(values)), key=lambda i: values[i][1])
    tail = order[-max(1, len(order) // 100) :]
    mean = [statistics.fmean(waits[i][j] for i in tail) for j in range(3)]
    return {
        "calls": len(tail),
        "voluntary_switches": round(mean[0], 2),
        "involuntary_switches": round(mean[1], 2),
        "minor_faults": round(mean[2], 1),
    }


def _print_walls(rows: list[dict]) -> None:
    """A short table on stderr: per call and configuration, CPU and wall p50/p99 in µs."""
    for row in rows:
        for name in ("host_only", "host_mooncake", "host_disk_mooncake"):
            r = row.get(name)
            if isinstance(r, dict):
                print(
                    f"{row['call']:12} {name:19} cpu {r['cpu_p50_us']:8.1f} {r['cpu_p99_us']:8.1f}"
                    f"  wall {r['wall_p50_us']:8.1f} {r['wall_p99_us']:8.1f}"
                    f"  off-cpu p99 {r['off_cpu_p99_us']:8.1f}  slowest 1%: {r['slowest_1pct']}",
                    file=sys.stderr,
                )


# -- disk: the disk tier against raw parallel I/O of the same bytes --------------------------

KiB, MiB = 1 << 10, 1 << 20


def drop_cache(directory: Path) -> None:
    """Write everything out (one sync), then drop every file below `directory` from the page
    cache."""
    os.sync()
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class Raw:
    """One file per object, moved by a pool of threads with one call each."""

    def __init__(self, directory: Path, threads: int, direct: bool, sync: bool) -> None:
        self.dir = directory
        self.pool = ThreadPoolExecutor(threads)
        self.flag = os.O_DIRECT if direct else 0
        self.sync = sync

    def write(self, names: list[str], views: list[memoryview]) -> None:
        def one(name: str, view: memoryview) -> None:
            fd = os.open(self.dir / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | self.flag, 0o644)
            try:
                write_full(fd, [view], 0)
                if self.sync:
                    os.fdatasync(fd)
            finally:
                os.close(fd)

        list(self.pool.map(one, names, views))

    def read(self, names: list[str], views: list[memoryview]) -> None:
        def one(name: str, view: memoryview) -> None:
            fd = os.open(self.dir / name, os.O_RDONLY | self.flag)
            try:
                if read_full(fd, [view], 0) != view.nbytes:
                    raise RuntimeError(f"short read of {name}")
            finally:
                os.close(fd)

        list(self.pool.map(one, names, views))


def measure(args: argparse.Namespace, object_bytes: int, sync: bool) -> list[dict]:
    """Rows (write, read) for one object size and one tier setting."""
    n = max(1, args.total // object_bytes)
    batch = min(args.batch, n)
    memory = HostMemory(batch * object_bytes, pin=torch.cuda.is_available())
    memory.tensor.random_(0, 256)
    base = memory.tensor.data_ptr()
    view = memoryview(memory.tensor.numpy())
    views = [view[i * object_bytes : (i + 1) * object_bytes] for i in range(batch)]
    buffers = Buffers([[base + i * object_bytes] for i in range(batch)], [[object_bytes]] * batch)
    names = [f"obj{i}" for i in range(n)]
    batches = [names[i : i + batch] for i in range(0, n, batch)]
    times: dict[str, list[float]] = {k: [] for k in ("tw", "tr", "rw", "rr")}
    direct = False
    for i in range(args.repeats):
        got, direct = one_round(args, memory, views, buffers, batches, sync, i % 2 == 1)
        for k, v in got.items():
            times[k].append(v)
    total = n * object_bytes
    name = "disk" if sync else "disk(sync=false)"
    rows = []
    for op, t, r in (("write", "tw", "rw"), ("read", "tr", "rr")):
        # the ratio of each round (raw and tier minutes apart at most), then their median: a
        # disk shared with other work changes speed from round to round more than within one
        ratios = [raw / tier for raw, tier in zip(times[r], times[t], strict=True)]
        rows.append(
            {
                "tier": name,
                "op": op,
                "object_bytes": object_bytes,
                "gbps": round(total / statistics.median(times[t]) / 1e9, 3),
                "raw_gbps": round(total / statistics.median(times[r]) / 1e9, 3),
                "ratio": round(statistics.median(ratios), 3),
                "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)],
                "objects": n,
                "direct_io": direct,
            }
        )
        print(rows[-1], flush=True)
    memory.close()
    return rows


def one_round(
    args: argparse.Namespace,
    memory: HostMemory,
    views: list[memoryview],
    buffers: Buffers,
    batches: list[list[str]],
    sync: bool,
    tier_first: bool,
) -> tuple[dict[str, float], bool]:
    """Writes of raw and tier, (the cache dropped) reads of raw and tier, the tier first or
    second: their seconds, and whether O_DIRECT was used."""
    work = Path(args.work) / "round"
    (work / "raw").mkdir(parents=True)
    config = DiskTierConfig(
        path=str(work / "tier"), size=2 * args.total + (1 << 30), io_threads=args.threads, sync=sync
    )
    tier = DiskTier(config)
    tier.start()
    tier.wait_ready(30)
    tier.register(memory.tensor)
    # one object put before the timed calls: the tier's counters say whether it uses O_DIRECT
    if tier.put_from(["probe"], _first(buffers, 1)) != [0]:
        raise RuntimeError("the probe put failed")
    direct = tier.stats().direct_calls > 0
    raw = Raw(work / "raw", args.threads, direct, sync)
    sizes = [[buffers.sizes[0][0]] * len(b) for b in batches]

    def tier_call(call: Callable[[list[str], Buffers], list[int]], want: int) -> None:
        for b in batches:
            if call(b, _first(buffers, len(b))) != [want] * len(b):
                raise RuntimeError(f"a {call.__name__} failed")

    writes = {
        "rw": lambda: [raw.write(b, views[: len(b)]) for b in batches],
        "tw": lambda: tier_call(tier.put_from, 0),
    }
    reads = {
        "rr": lambda: [raw.read(b, views[: len(b)]) for b in batches],
        "tr": lambda: tier_call(tier.get_into, sizes[0][0]),
    }
    order = reversed if tier_first else list  # raw first, or the tier first
    out = {k: timed(writes[k]) for k in order(list(writes))}
    drop_cache(work)
    out |= {k: timed(reads[k]) for k in order(list(reads))}
    tier.close()
    raw.pool.shutdown()
    shutil.rmtree(work, ignore_errors=True)
    return out, direct


def codec_rows(args: argparse.Namespace) -> list[dict]:
    """Read rows of a disk tier with codec: lossless against codec: none (see the docstring)."""
    import codec as codec_bench  # bench/codec.py

    kv = codec_bench.synthetic_kv(128 * 1024 * 16, args.codec_pages)  # llama-8b: 128 KiB/token
    pages = codec_bench.as_dtype(kv, "bfloat16")
    opts = argparse.Namespace(group_pages=4, page_tokens=16, disk=args.work, rounds=args.repeats)
    got = codec_bench.disk_reads(opts, "bfloat16", pages, args.codec_threads)
    none = got[0]
    rows = []
    for r in got[1:]:
        rows.append(
            {
                "tier": f"disk(codec={r['mode']})",
                "op": "read",
                "object_bytes": r["object_bytes"],
                "gbps": r["kv_gbps"],
                "none_gbps": none["kv_gbps"],
                "ratio": r["vs_raw"],
                "codec_ratio": round(none["stored_bytes"] / r["stored_bytes"], 3),
                "codec_threads": r["codec_threads"],
                "objects": r["objects"],
            }
        )
        print(rows[-1], flush=True)
    return rows


def _first(buffers: Buffers, k: int) -> Buffers:
    return buffers if k == len(buffers) else Buffers(buffers.ptrs[:k], buffers.sizes[:k])


NOT_SETTINGS = ("out", "machine", "work", "run", "func")


def disk(args: argparse.Namespace) -> None:
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    args.work = tempfile.mkdtemp(prefix="bench-", dir=args.dir)  # this run's own
    rows = []
    for size in (to_bytes(s) for s in args.sizes.split(",")):
        for sync in (True, False):
            rows += measure(args, size, sync)
    if args.codec_pages:
        rows += codec_rows(args)
    shutil.rmtree(args.work, ignore_errors=True)
    with contextlib.suppress(OSError):  # the default directory, if nothing else is in it
        os.rmdir(args.dir)
    result = {
        "commit": commit(),
        "machine": args.machine,
        "command": command(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "measured": "tier put_from/get_into vs raw parallel pwritev/preadv of the same bytes, "
        "same directory, same run; page cache dropped before reads; "
        "ratio: median of the rounds' ratios",
        "settings": {k: v for k, v in vars(args).items() if k not in NOT_SETTINGS},
        "rows": rows,
    }
    out = Path(args.out or ROOT / "bench" / "results" / f"tiers_disk_{args.machine}.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="run", required=True)
    et = sub.add_parser("engine-thread", help="engine-thread cost of match/store with store tiers")
    et.add_argument("--prompts", type=int, default=48)
    et.add_argument("--pages", type=int, default=64)
    et.add_argument("--rounds", type=int, default=3)
    et.add_argument("--out", type=Path)
    et.set_defaults(func=engine_thread)
    dk = sub.add_parser("disk", help="disk tier throughput against raw parallel I/O")
    dk.add_argument("--dir", default=str(ROOT / ".bench-disk"), help="on the disk measured")
    dk.add_argument("--total", type=to_bytes, default=1 << 30, help="bytes per object size")
    dk.add_argument("--sizes", default="256KiB,1MiB,4MiB,16MiB")
    dk.add_argument("--batch", type=int, default=32, help="objects per tier call")
    dk.add_argument("--threads", type=int, default=8, help="the tier's io_threads")
    dk.add_argument("--repeats", type=int, default=3)
    dk.add_argument("--codec-pages", type=int, default=128, help="KV pages for codec rows")
    dk.add_argument("--codec-threads", type=int, default=8, help="the codec tier's codec_threads")
    dk.add_argument("--machine", default=socket.gethostname())
    dk.add_argument("--out", default=None)
    dk.set_defaults(func=disk)
    args = ap.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
