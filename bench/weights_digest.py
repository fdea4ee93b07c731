"""The speed of the weights' digest (`hicache.core.weights`): GB/s over a checkpoint's bytes.

    python bench/weights_digest.py --machine <name> [--size 512MiB] [--workers 1 2]

Writes one weight file of `--size` random bytes in a temporary folder (it stays in the page
cache: the figure is the digest's, not the disk's) and, `--repeats` times, interleaved: reads it
whole (the baseline: the same reads with no hashing), digests it on each `--workers` count
(`file_digest`), and digests the folder again with its digest remembered (`weights_digest` after
a restart: a stat and a JSON file). Rows give the median seconds and GB/s with the spread
(min-max), and the machine's load average when it ended (other processes share the CPUs).
Writes bench/results/weights_digest_<machine>.json unless `--out` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from pydantic import ByteSize, TypeAdapter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import ROOT, command, commit, cpu_model
from hicache.core import weights


def read_all(path: Path) -> None:
    """The baseline: the digest's reads (`weights.READ` bytes at a time), nothing hashed."""
    buf = memoryview(bytearray(weights.READ))
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--machine", required=True)
    ap.add_argument("--size", default="512MiB")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args()
    size = int(TypeAdapter(ByteSize).validate_python(args.size))
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["HICACHE_CACHE_DIR"] = str(Path(tmp) / "cache")
        folder = Path(tmp) / "model"
        folder.mkdir()
        path = folder / "model.safetensors"
        with open(path, "wb") as f:
            for _ in range(0, size, 64 << 20):
                f.write(os.urandom(min(64 << 20, size - f.tell())))
        weights.weights_digest(folder)  # remembered from here on
        cases = {"read only": lambda: read_all(path)}
        for n in args.workers:
            cases[f"digest, {n} threads"] = lambda n=n: weights.file_digest(path, workers=n)
        cases["digest remembered"] = lambda: weights.weights_digest(folder)
        read_all(path)  # warm
        seconds: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.repeats):
            for name, fn in cases.items():
                seconds[name].append(timed(fn))
    rows = []
    for name, times in seconds.items():
        med = statistics.median(times)
        rows.append({
            "case": name, "median_s": round(med, 6), "gb_per_s": round(size / med / 1e9, 3),
            "gb_per_s_min": round(size / max(times) / 1e9, 3),
            "gb_per_s_max": round(size / min(times) / 1e9, 3),
        })  # fmt: skip
        print(f"{name:24s} {med * 1e3:9.2f} ms  {size / med / 1e9:8.2f} GB/s")
    out = Path(args.out or ROOT / "bench" / "results" / f"weights_digest_{args.machine}.json")
    out.write_text(
        json.dumps(
            {
                "commit": commit(), "machine": args.machine, "cpu": cpu_model(),
                "cpus": os.cpu_count(), "load_average": os.getloadavg(), "command": command(),
                "bytes": size,
                "repeats": args.repeats, "rows": rows,
            },
            indent=2,
        ) + "\n"
    )  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
