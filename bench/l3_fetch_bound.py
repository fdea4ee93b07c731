"""What the fetch-queue bound does while the master is dead and the breaker still closed.

    python bench/l3_fetch_bound.py [--calls 400] [--repeats 2] [--out FILE]

Runs the "down" phase of `l3_cache.py` (master killed just before the calls) with
`fetch_queue_depth` 64 (the default) and unbounded, alternately. Unbounded, every `match` of a
new prompt queues a fetch job behind the calls the dead master holds, and the jobs pile up until
the breaker opens; the garbage they make is collected inside engine-thread calls. Prints JSON:
per run, `match` CPU p50/p99 and how many garbage collections ran (and inside which timed calls).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "bench")]

import l3_cache  # noqa: E402
from l3_raw import report  # noqa: E402
from mooncake_master import MooncakeMaster, SegmentHolder  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out")
    args = ap.parse_args()
    make = l3_cache.make_cache
    runs = []
    for depth in [64, 1 << 30] * args.repeats:

        def bounded(master, page_bytes, pages, depth=depth, **store):
            if master is not None:
                store["fetch_queue_depth"] = depth
            return make(master, page_bytes, pages, **store)

        l3_cache.make_cache = bounded
        master = MooncakeMaster().start()
        holder = SegmentHolder(master.address, 1 << 30)
        try:
            r = l3_cache.engine_thread_times(master, args.calls, "down")
        finally:
            holder.close()
            master.stop()
        runs.append(
            {
                "fetch_queue_depth": depth if depth < 1 << 30 else "unbounded",
                "match_cpu_us": r["match_cpu_us"],
                "store_cpu_us": r["store_cpu_us"],
                "garbage_collections": r["garbage_collections"]["count"],
                "calls_with_a_garbage_collection": r["calls_with_a_garbage_collection"],
            }
        )
    l3_cache.make_cache = make
    machine = f"{os.cpu_count()} CPUs ({platform.machine()}), CPU pool, loopback TCP"
    result = {
        "bench": "l3_fetch_bound",
        "machine": machine,
        "command": "python " + " ".join(sys.argv),
        "runs": runs,
    }
    report(result, args.out)


if __name__ == "__main__":
    main()
