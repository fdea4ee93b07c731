"""The trace tool on the agentic sessions trace: the sweep, the planner, and how fast they run.

    python bench/trace_agentic.py ../shared/traces/agentic_sessions.jsonl.gz --machine cpu

Writes bench/results/trace_agentic_<machine>.json, trace_agentic_<machine>.png (the sweep) and
planner_agentic_<machine>.png (hit share and TTFT against the host size, with and without a
disk tier):

- `speed`: page visits per second of one simulated configuration, compiled and in Python (the
  fallback), the ways interleaved, `--repeats` times each (median and range): a policy at a
  capacity (LRU, ARC, S3-FIFO, the offline reference) and one planner chain (host + disk);
- `sweep`: every policy and the offline reference at 2, 5, 10, 25 and 100 % of the distinct
  pages (`hicache trace --sweep --simulate-only`), and the seconds the whole sweep took;
- `planner`: the planner's report for llama-8b with a host tier and a disk tier, its host-size
  rows with and without the disk, and the seconds that took.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import command, commit, cpu_model

from hicache.tools.trace import fastsim, planreport
from hicache.tools.trace.chainsim import StoreSim
from hicache.tools.trace.planner import TierPlan, TtftModel, bytes_per_token, plan
from hicache.tools.trace.replay import DEFAULT_FRACTIONS, ReplaySetup, simulated
from hicache.tools.trace.report import plot
from hicache.tools.trace.workload import Workload, read_trace

PAGE_TOKENS = 512
HOST, DISK = 512 << 30, 4 << 40


def _rate(visits: int, seconds: list[float]) -> dict[str, float]:
    rates = sorted(visits / s / 1e6 for s in seconds)
    return {"m_visits_per_s": statistics.median(rates), "range": [rates[0], rates[-1]]}


def speed(workload: Workload, repeats: int) -> list[dict]:
    """Each configuration compiled and in Python, interleaved, `repeats` times."""
    U = workload.unique_pages
    configs = [
        (name, frac) for name in ("lru", "arc", "s3fifo", fastsim.OFFLINE) for frac in (0.02, 0.1)
    ]
    rows = []
    for name, frac in configs:
        cap = round(frac * U)
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(repeats):
            for python in (False, True):
                start = time.perf_counter()
                fastsim.simulate(workload, name, cap, python=python)
                times[python].append(time.perf_counter() - start)
        rows.append(
            {
                "run": f"{name} at {frac:.0%}",
                "compiled": _rate(workload.visits, times[False]),
                "python": _rate(workload.visits, times[True]),
            }
        )
    disk = [StoreSim("disk", U // 16, 4)]
    times = {False: [], True: []}
    for _ in range(repeats):
        for python in (False, True):
            start = time.perf_counter()
            fastsim.run_chain(workload, U // 20, disk, python=python)
            times[python].append(time.perf_counter() - start)
    rows.append(
        {
            "run": "planner chain: host 5 % + disk 25 %",
            "compiled": _rate(workload.visits, times[False]),
            "python": _rate(workload.visits, times[True]),
        }
    )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--machine", default="cpu", help="label of this machine in the file names")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    start = time.perf_counter()
    requests = read_trace(args.trace)
    workload = Workload(requests, PAGE_TOKENS)
    workload.dense  # noqa: B018  (built once, outside the timings)
    read_s = time.perf_counter() - start

    start = time.perf_counter()
    sweep = simulated(workload, ReplaySetup(page_tokens=PAGE_TOKENS), DEFAULT_FRACTIONS, None)
    sweep_s = time.perf_counter() - start

    page_bytes = bytes_per_token("llama-8b") * PAGE_TOKENS
    tiers = [TierPlan("host", HOST), TierPlan("disk", DISK)]
    start = time.perf_counter()
    planned = plan(workload, tiers, page_bytes)
    run = planreport.runner(TtftModel(), 1, 20_000.0, None)
    rows = planreport.host_sweep(workload, tiers, page_bytes, run)
    plan_s = time.perf_counter() - start

    result = {
        "commit": commit(),
        "machine": f"{args.machine}: {os.cpu_count()} CPUs ({platform.machine()}), {cpu_model()}",
        "command": command(),
        "trace": args.trace.name,
        "requests": len(requests),
        "page_tokens": PAGE_TOKENS,
        "page_visits": workload.visits,
        "unique_pages": workload.unique_pages,
        "read_seconds": read_s,
        "speed": speed(workload, args.repeats),
        "sweep_seconds": sweep_s,
        "sweep": sweep["sweep"],
        "oracle_share": sweep["oracle_share"],
        "planner_seconds": plan_s,
        "planner": planned,
        "planner_host_sweep": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"trace_agentic_{args.machine}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    plot(sweep, args.out / f"trace_agentic_{args.machine}.png", f"{args.trace.name}: hit share")
    planreport.plot(
        rows, "disk", args.out / f"planner_agentic_{args.machine}.png",
        f"{args.trace.name}: llama-8b, host + 4 TiB disk",
    )  # fmt: skip
    print(
        json.dumps({k: result[k] for k in ("speed", "sweep_seconds", "planner_seconds")}, indent=2)
    )
    print(planreport.table(planned))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
