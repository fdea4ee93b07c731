"""How long a fill from L3 takes when the engine thread keeps the GIL between its calls.

    python bench/l3_fill_busy_engine.py [--device cuda] [--rounds 16] [--busy-ms 1.0] [--out FILE]

hicache's fetch worker needs the GIL for its Python before and after the store call. An engine
loop that waits on the GPU between steps lets go of the GIL then; one that runs Python between
steps keeps it, and the worker gets it only when the interpreter's switch interval (5 ms by
default) runs out. Each round stores 128 pages through one cache, waits until L3 holds them, and
times a second cache's fill of the same prompt (first `match` until it is no longer pending) in
one of four modes, in turn: the engine thread sleeps 1 ms between polls (`sleep`), or runs
Python for `--busy-ms` between polls (`busy`), each with the default switch interval and with
0.5 ms (`sys.setswitchinterval`). Prints JSON: the fill's median and spread per mode.

On a machine with fewer cores than threads (the 2-core VM) the busy engine thread also takes a
core from the worker and the store's threads: read such results as an upper bound.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "tests")]

import l3_cache  # noqa: E402
from l3_raw import report  # noqa: E402
from mooncake_master import MooncakeMaster, SegmentHolder  # noqa: E402

MODES = ("sleep", "busy", "sleep_switch_0.5ms", "busy_switch_0.5ms")


def spin(seconds: float) -> None:
    """Python work on the engine thread (the GIL held throughout)."""
    end, x = time.perf_counter() + seconds, 0
    while time.perf_counter() < end:
        x += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=16, help="fills per mode")
    ap.add_argument("--busy-ms", type=float, default=1.0, help="Python between polls (ms)")
    ap.add_argument("--out")
    args = ap.parse_args()
    l3_cache.DEVICE, l3_cache.CUDA = args.device, args.device.startswith("cuda")
    default_switch = sys.getswitchinterval()
    page, pages = 128 << 10, 128  # 32 objects of 512 KiB, as l3_cache's throughput
    master = MooncakeMaster().start()
    holder = SegmentHolder(master.address, 2 << 30)
    writer = l3_cache.make_cache(master, page, pages)
    reader = l3_cache.make_cache(master, page, pages)
    rng = np.random.default_rng(0)
    fills: dict[str, list[float]] = {m: [] for m in MODES}
    try:
        for r in range(args.rounds + 1):  # round 0 warms up
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                tokens = rng.integers(0, 50_000, pages * 16 + 1, dtype=np.int32)
                rid = f"{mode}{r}"
                writer.store(rid, tokens, list(range(pages)))
                writer.release(rid)
                while not writer.l3_idle:
                    writer.poll()
                    time.sleep(0.001)
                sys.setswitchinterval(0.0005 if mode.endswith("0.5ms") else default_switch)
                wait = (
                    (lambda: spin(args.busy_ms / 1e3))
                    if mode.startswith("busy")
                    else (lambda: time.sleep(0.001))
                )
                t0 = time.perf_counter()
                m = reader.match(rid, tokens)
                while m.pending:
                    wait()
                    reader.poll()
                    m = reader.match(rid, tokens)
                took = time.perf_counter() - t0
                sys.setswitchinterval(default_switch)
                reader.release(rid)
                if m.l3_tokens != pages * 16:
                    raise SystemExit(f"round {r}, {mode}: the fill hit {m.l3_tokens} tokens")
                if r:
                    fills[mode].append(took * 1e3)
    finally:
        sys.setswitchinterval(default_switch)
        writer.close()
        reader.close()
        holder.close()
        master.stop()
    report(
        {
            "bench": "l3_fill_busy_engine",
            "machine": f"{os.cpu_count()} CPUs ({platform.machine()}), loopback TCP, "
            "Mooncake 0.3.13.post1",
            "command": "python " + " ".join(sys.argv),
            "fill_ms": {
                m: {
                    "median": round(statistics.median(v), 2),
                    "min": round(min(v), 2),
                    "max": round(max(v), 2),
                }
                for m, v in fills.items()
            },
            "default_switch_interval_s": default_switch,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
