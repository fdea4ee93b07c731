"""The cost of the stored objects' checksum (`hicache.core.checksum`) per GB.

    python bench/checksum.py --machine <name> [--total 1GiB] [--threads 1 2]

For each object size and thread count: `--total` bytes of distinct objects (random bytes, in
page-aligned memory, as the host tier's pools) checksummed one object a call, the objects split
among the threads (a store tier's workers check their objects in parallel), `--repeats` times;
rows give the median seconds per GB and GB/s, for the compiled loop and for numpy's (the path
under HICACHE_NO_NATIVE=1). Writes bench/results/checksum_<machine>.json unless `--out` says
otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from pydantic import ByteSize, TypeAdapter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import ROOT, command, commit, cpu_model
from hicache.backends.memory import HostMemory
from hicache.core import native
from hicache.core.checksum import checksum, checksum_numpy


def measure(fn, base: int, size: int, count: int, threads: int) -> float:
    """Seconds to checksum `count` objects of `size` bytes from `base` on `threads` threads."""
    objects = [[base + i * size] for i in range(count)]
    per = -(-count // threads)
    parts = [objects[i * per : (i + 1) * per] for i in range(threads)]

    def run(part: list[list[int]]) -> None:
        for ptrs in part:
            fn(ptrs, [size])

    with ThreadPoolExecutor(threads) as pool:
        start = time.perf_counter()
        list(pool.map(run, parts))
        return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--machine", required=True)
    ap.add_argument("--total", default="1GiB")
    ap.add_argument("--sizes", default="512KiB,2MiB")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--numpy-total", default="128MiB", help="bytes for numpy's path (slower)")
    ap.add_argument("--out")
    args = ap.parse_args()
    parse = TypeAdapter(ByteSize).validate_python
    total = int(parse(args.total))
    memory = HostMemory(total, pin=False)
    memory.tensor.copy_(torch.randint(0, 256, (total,), dtype=torch.uint8))
    base = memory.tensor.data_ptr()
    paths = {"numpy": (checksum_numpy, int(parse(args.numpy_total)))}
    if native.library(release_gil=True) is not None:
        paths["compiled"] = (checksum, total)
    rows = []
    for size in (int(parse(s)) for s in args.sizes.split(",")):
        for path, (fn, nbytes) in paths.items():
            count = max(1, min(total, nbytes) // size)
            for threads in args.threads:
                times = [measure(fn, base, size, count, threads) for _ in range(args.repeats)]
                t = statistics.median(times)
                gb = count * size / 1e9
                rows.append(
                    {
                        "path": path,
                        "object_bytes": size,
                        "threads": threads,
                        "gbps": round(gb / t, 3),
                        "seconds_per_gb": round(t / gb, 4),
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    result = {
        "commit": commit(),
        "machine": f"{args.machine}: {cpu_model()}, {os.cpu_count()} CPUs",
        "command": command(),
        "numpy": np.__version__,
        "rows": rows,
    }
    default = ROOT / "bench" / "results" / f"checksum_{args.machine}.json"
    out = Path(args.out) if args.out else default
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
