"""The disk tier's read and write throughput against raw parallel I/O of the same bytes.

For each object size, in the same run and on the same directory:

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

Usage::

    python bench/disk.py --dir /path/on/the/disk --machine <name> [--total 1GiB]

writes ``bench/results/disk_<machine>.json`` (rows ``tier, op, object_bytes, gbps, raw_gbps,
ratio``) unless `--out` says otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from hicache.backends.base import Buffers  # noqa: E402
from hicache.backends.disk import DiskTier, DiskTierConfig  # noqa: E402
from hicache.backends.disk_records import read_full, write_full  # noqa: E402
from hicache.config import _to_bytes  # noqa: E402
from hicache.memory import HostMemory  # noqa: E402

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
    direct = tier._direct_align is not None
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


def _first(buffers: Buffers, k: int) -> Buffers:
    return buffers if k == len(buffers) else Buffers(buffers.ptrs[:k], buffers.sizes[:k])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=str(ROOT / ".bench-disk"), help="on the disk measured")
    parser.add_argument("--total", type=_to_bytes, default=1 << 30, help="bytes per object size")
    parser.add_argument("--sizes", default="256KiB,1MiB,4MiB,16MiB")
    parser.add_argument("--batch", type=int, default=32, help="objects per tier call")
    parser.add_argument("--threads", type=int, default=8, help="the tier's io_threads")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--machine", default=socket.gethostname())
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    args.work = tempfile.mkdtemp(prefix="bench-", dir=args.dir)  # this run's own
    rows = []
    for size in (_to_bytes(s) for s in args.sizes.split(",")):
        for sync in (True, False):
            rows += measure(args, size, sync)
    shutil.rmtree(args.work, ignore_errors=True)
    with contextlib.suppress(OSError):  # the default directory, if nothing else is in it
        os.rmdir(args.dir)
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    result = {
        "commit": commit,
        "machine": args.machine,
        "command": " ".join(["python", "bench/disk.py", *sys.argv[1:]]),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "measured": "tier put_from/get_into vs raw parallel pwritev/preadv of the same bytes, "
        "same directory, same run; page cache dropped before reads; "
        "ratio: median of the rounds' ratios",
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "machine", "work")},
        "rows": rows,
    }
    out = Path(args.out or ROOT / "bench" / "results" / f"disk_{args.machine}.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
