"""Where a fill's time goes: the steps of one L3 fetch, from `match` to the answer, in µs.

    python bench/l3_fill_timeline.py [--device cuda] [--rounds 25] [--out FILE]

A writer cache stores 128 pages of 128 KiB (32 objects of 512 KiB) and a fresh reader cache
matches the same prompt until it is no longer pending, as `bench/l3_cache.py` does (asleep
between steps until hicache's `wake` callback fires, 0.5 ms at most). Timestamps
are taken around the steps by wrapping them (the wrappers cost ~1 µs each): the engine thread's
`match` and `start_fetch` (which hashes a fetch of 128 pages itself, see
`hicache.l3.ENGINE_PREP_PAGES`), the fetch worker's naming of the objects, the store's call and
the Mooncake batch get inside it, and the engine thread's applying of the result. Prints JSON:
the median and p90 of each step over the rounds after the first three.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "bench")]

import l3_cache  # noqa: E402
from l3_raw import report  # noqa: E402
from mooncake_master import MooncakeMaster, SegmentHolder  # noqa: E402

STEPS = [
    ("match, before the fetch starts", "t0", "submit0"),
    ("start_fetch: hash the pages, reserve slots, queue the job", "submit0", "submit1"),
    ("fetch worker wakes", "submit1", "place0"),
    ("worker names the objects and finds their bytes", "place0", "get0"),
    ("store call: checks before the Mooncake call", "get0", "mc0"),
    ("Mooncake batch get", "mc0", "mc1"),
    ("store call: result codes", "mc1", "get1"),
    ("engine woken, asks again", "get1", "apply0"),
    ("engine applies the result (publish the pages)", "apply0", "apply1"),
    ("rest of the final match", "apply1", "done"),
]


class _Timed:
    """A stand-in for the Mooncake client that times its batch gets."""

    def __init__(self, client, mark) -> None:
        self._client, self._mark = client, mark

    def batch_get_into_multi_buffers(self, *args):
        self._mark("mc0")
        try:
            return self._client.batch_get_into_multi_buffers(*args)
        finally:
            self._mark("mc1")

    def __getattr__(self, name: str):
        return getattr(self._client, name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.device.startswith("cuda"):
        l3_cache.DEVICE, l3_cache.CUDA = args.device, True
        torch.cuda.set_stream(torch.cuda.Stream())
    master = MooncakeMaster().start()
    holder = SegmentHolder(master.address, 2 << 30)
    page, pages = 128 << 10, 128
    writer = l3_cache.make_cache(master, page, pages)
    reader = l3_cache.make_cache(master, page, pages)
    rounds: list[dict[str, float]] = []  # per round: the first time each mark was reached

    def mark(name: str) -> None:
        if rounds:
            rounds[-1].setdefault(name, time.perf_counter())

    def wrap(obj, attr: str, before: str, after: str) -> None:
        fn = getattr(obj, attr)

        def timed(*a, **kw):
            mark(before)
            try:
                return fn(*a, **kw)
            finally:
                mark(after)

        setattr(obj, attr, timed)

    l3 = reader._l3
    wrap(l3, "start_fetch", "submit0", "submit1")
    wrap(l3, "_place", "place0", "place1")  # place1 unused: the store call begins right after
    wrap(l3.store, "get_into", "get0", "get1")
    wrap(l3, "_on_get", "apply0", "apply1")
    l3.store._client = _Timed(l3.store._client, mark)
    rng = np.random.default_rng(0)
    fills = []
    try:
        for r in range(args.rounds):
            tokens = rng.integers(0, 50_000, pages * 16 + 1, dtype=np.int32)
            writer.store(f"w{r}", tokens, list(range(pages)))
            l3_cache.until_idle(writer)
            writer.release(f"w{r}")
            reader.poll()  # as an engine does every step: fills the fetch reserve
            rounds.append({})
            t0 = time.perf_counter()
            mark("t0")
            m = reader.match(f"r{r}", tokens)
            while m.pending:
                l3_cache.next_step(reader)
                m = reader.match(f"r{r}", tokens)
            mark("done")
            fills.append(time.perf_counter() - t0)
            reader.release(f"r{r}")
            if m.l3_tokens != pages * 16:
                raise SystemExit(f"round {r}: the fill hit {m.l3_tokens} tokens from L3")
    finally:
        writer.close()
        reader.close()
        holder.close()
        master.stop()
    steps = {}
    for label, a, b in STEPS:
        d = sorted((r[b] - r[a]) * 1e6 for r in rounds[3:])
        steps[label] = {
            "median_us": round(statistics.median(d), 1),
            "p90_us": round(d[int(0.9 * (len(d) - 1))], 1),
        }
    result = {
        "bench": "l3_fill_timeline",
        "device": torch.cuda.get_device_name() if l3_cache.CUDA else "cpu",
        "command": "python " + " ".join(sys.argv),
        "objects": "32 x 512 KiB (128 pages of 128 KiB, groups of 4)",
        "fill_median_ms": round(statistics.median(fills[3:]) * 1e3, 3),
        "steps": steps,
    }
    report(result, args.out)


if __name__ == "__main__":
    main()
