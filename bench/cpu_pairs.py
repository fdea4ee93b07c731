"""Which CPUs slow each other down: a fixed probe on one CPU, alone and beside a busy loop on each
other CPU in turn.

    python bench/cpu_pairs.py [--cpu 0] [--rounds 3] [--seconds 0.3] [--out FILE]

A guest may be given vCPUs that are sibling hyperthreads of one physical core and still report
one thread per core: then a thread on the sibling slows the engine thread's CPU, and nothing in
the guest's topology says so. This finds such pairs by measurement. The probe is the compiled
hash of 64 pages that every engine phase of `l3_cache.py` records (`reference_hash_us`); the load
is a process pinned to one CPU that hashes 1 MiB with OpenSSL's SHA-256 in a loop (the same
execution units as the probe, so the most a sibling can take). Each round takes every other CPU
in turn (order reversed every other round) and times the probe alone, beside a load on that CPU,
and alone again: the machine's own speed drifts within seconds, so each ratio is against the
two timings around it. Prints JSON: per CPU, the probe's median beside it divided by the mean of
its medians alone just before and after.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]

from l3_cache import reference_hash_us, report  # noqa: E402

LOAD = (
    "import hashlib, os, sys\n"
    "os.sched_setaffinity(0, {int(sys.argv[1])})\n"
    "b = bytes(1 << 20)\n"
    "sys.stdout.write('ready\\n'); sys.stdout.flush()\n"
    "while True:\n"
    "    hashlib.sha256(b).digest()\n"
)


def probe_us(seconds: float) -> float:
    """Median µs of the probe over `seconds`."""
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        times.append(reference_hash_us())
    return statistics.median(times)


def beside(cpu: int, seconds: float) -> float:
    """The probe's median while a load process runs on `cpu`."""
    load = subprocess.Popen([sys.executable, "-c", LOAD, str(cpu)], stdout=subprocess.PIPE)
    try:
        assert load.stdout is not None
        load.stdout.readline()  # the load is pinned and running
        return probe_us(seconds)
    finally:
        load.kill()
        load.wait()


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", type=int, default=0, help="the probe's CPU")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=0.3, help="timing per condition")
    ap.add_argument("--out")
    args = ap.parse_args()
    allowed = sorted(os.sched_getaffinity(0))
    if args.cpu not in allowed:
        raise SystemExit(f"--cpu {args.cpu}: not a CPU this process may run on ({allowed})")
    os.sched_setaffinity(0, {args.cpu})
    others = [c for c in allowed if c != args.cpu]
    probe_us(args.seconds)  # warm up: the first timing runs cold
    ratios: dict[int, list[float]] = {c: [] for c in others}
    alone: list[float] = []
    for r in range(args.rounds):
        for c in others if r % 2 == 0 else others[::-1]:
            before = probe_us(args.seconds)
            near = beside(c, args.seconds)
            after = probe_us(args.seconds)
            alone += [round(before, 2), round(after, 2)]
            ratios[c].append(round(near / ((before + after) / 2), 3))
    medians = {c: statistics.median(v) for c, v in ratios.items()}
    slowest = max(medians, key=medians.__getitem__)
    report(
        {
            "bench": "cpu_pairs",
            "machine": f"{os.cpu_count()} CPUs ({platform.machine()}), {cpu_model()}",
            "command": "python " + " ".join(sys.argv),
            "probe_cpu": args.cpu,
            "probe_alone_us": alone,
            "ratio_beside": {str(c): v for c, v in ratios.items()},
            "ratio_beside_median": {str(c): v for c, v in medians.items()},
            "slowest_neighbour": {"cpu": slowest, "ratio": medians[slowest]},
        },
        args.out,
    )


if __name__ == "__main__":
    main()
