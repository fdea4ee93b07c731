"""CPU cost of match, store and load per page over a whole trace (real prompt mix).

Replays the trace through HiCache (host tier at --host-size of the distinct pages) and prints
JSON: µs per page for each call (all time over all pages, and the median over calls of the
call's µs per page), plus the page-key hashing alone (the compiled SHA-256 chain over every
prompt, the floor of match) for comparison. The copies are the CPU twin of the copy kernel.

    python bench/trace_cost.py ../shared/traces/synthetic_trace.jsonl \
        --out bench/results/trace_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from hicache import native
from hicache.keys import page_keys
from hicache.trace.replay import ReplaySetup, Workload, per_page, run_hicache
from hicache.trace.workload import prompt_tokens, read_trace


def hashing_only(workload: Workload, page_tokens: int) -> dict[str, float]:
    """µs per page of `page_keys` over every prompt (what match hashes)."""
    prompts = [prompt_tokens(r) for r in workload.requests]
    seed = b"\x00" * 16
    ns, pages = [], []
    for tokens in prompts:
        t0 = time.perf_counter_ns()
        keys = page_keys(seed, tokens, page_tokens)
        ns.append(time.perf_counter_ns() - t0)
        pages.append(len(keys))
    return per_page(ns, pages)


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()}-core CPU VM ({cpu}), Python {platform.python_version()}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", type=Path)
    p.add_argument("--page-tokens", type=int, default=128)
    p.add_argument("--host-size", type=float, default=0.5, help="fraction of distinct pages")
    p.add_argument("--repeat", type=int, default=3, help="replays; the fastest is reported")
    p.add_argument("--out", type=Path)
    args = p.parse_args()

    workload = Workload(read_trace(args.trace), args.page_tokens)
    setup = ReplaySetup(page_tokens=args.page_tokens)
    host_pages = round(args.host_size * workload.unique_pages)
    runs = [run_hicache(workload, setup, host_pages) for _ in range(args.repeat)]
    best = min(runs, key=lambda r: sum(r.timings.match_ns) + sum(r.timings.store_ns))
    t = best.timings
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine(),
        "torch_threads": torch.get_num_threads(),
        "native_hashing": native.available(),
        "requests": len(workload.requests),
        "page_tokens": args.page_tokens,
        "host_pages": host_pages,
        "hit_share": best.share,
        "wrong_bytes": best.wrong_bytes,
        "match_us_per_page": per_page(t.match_ns, t.match_pages),
        "store_us_per_page": per_page(t.store_ns, t.store_pages),
        "load_us_per_page": per_page(t.load_ns, t.load_pages),
        "hashing_us_per_page": hashing_only(workload, args.page_tokens),
        "match_us_per_page_runs": [
            sum(r.timings.match_ns) / sum(r.timings.match_pages) / 1000 for r in runs
        ],
        "prompt_pages_median": statistics.median(t.match_pages),
        "prompt_pages_max": int(np.max(t.match_pages)),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
