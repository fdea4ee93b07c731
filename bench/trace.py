"""Eviction policies against the offline reference, and what `match` costs, on request traces.

    python bench/trace.py ../shared/traces/synthetic_trace.jsonl --machine cpu

Writes bench/results/trace_<machine>.json and trace_<machine>.png:

- `sweep`: every policy's simulated prefix hit share at 2, 5, 10, 25 and 100 % of the trace's
  distinct pages, beside LRU and the offline farthest-next-use reference (`hicache trace
  --sweep` computes the same rows);
- `replay`: the trace replayed through a real HiCache whose host tier runs `--policy` at
  `--host-size`, every loaded byte checked (`wrong_bytes`), and its hit share beside the same
  policy's simulation;
- `match_us_per_page`: engine-thread CPU time of `match` per page (time.thread_time_ns) on the
  trace, and on a generated workload whose prompts all share one long head, for LRU (compiled
  books) and `--policy`;
- `second_trace`: the sweep on a generated trace of another shape (multi-turn conversations over
  a few popular system prompts, plus one-off prompts), so that no policy is judged on one trace.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
from pathlib import Path

from hicache.trace.replay import ReplaySetup, Workload, per_page, replay, run_hicache, sweep
from hicache.trace.report import plot
from hicache.trace.workload import TraceRequest, read_trace

FRACTIONS = (0.02, 0.05, 0.1, 0.25, 1.0)


def shared_head_requests(n: int = 400, head_blocks: int = 16, seed: int = 3) -> list[TraceRequest]:
    """`n` prompts that all start with the same `head_blocks` blocks, then 1-8 blocks of their
    own (a long system prompt in front of every request)."""
    rng = random.Random(seed)
    head = list(range(head_blocks))
    out, next_id = [], head_blocks
    for t in range(n):
        tail = list(range(next_id, next_id + rng.randint(1, 8)))
        next_id += len(tail)
        ids = head + tail
        out.append(TraceRequest(t, 512 * len(ids) - rng.randint(0, 511), 1, tuple(ids)))
    return out


def conversation_requests(n: int = 3000, seed: int = 11) -> list[TraceRequest]:
    """Multi-turn conversations over 200 system prompts of Zipf popularity, and one-off prompts:
    a shape unlike the Mooncake synthetic trace's (short turns, many conversations at once)."""
    rng = random.Random(seed)
    ids: dict[tuple[int, int], int] = {}
    systems = [[rng.randrange(10**9) for _ in range(rng.randint(2, 12))] for _ in range(200)]
    weights = [1 / (i + 1) for i in range(len(systems))]
    live: list[list[int]] = []
    out = []
    for t in range(n):
        roll = rng.random()
        if live and roll < 0.55:  # the next turn of a recent conversation
            conv = live[min(len(live) - 1, int(rng.expovariate(1 / 150)))]
            live.remove(conv)
        elif roll < 0.85:  # a new conversation
            conv = list(rng.choices(systems, weights)[0])
        else:  # a one-off prompt: a popular head, a long tail nobody sends again
            conv = list(rng.choices(systems, weights)[0])
            conv += [rng.randrange(10**9) for _ in range(rng.randint(4, 40))]
        conv = conv + [rng.randrange(10**9) for _ in range(rng.randint(1, 4))]
        if roll < 0.85:
            live.insert(0, conv)
            del live[2000:]
        hash_ids, parent = [], -1
        for content in conv:
            parent = ids.setdefault((parent, content), len(ids))
            hash_ids.append(parent)
        length = 512 * (len(conv) - 1) + rng.randint(1, 512)
        out.append(TraceRequest(t, length, 1, tuple(hash_ids)))
    return out


def match_cost(requests: list[TraceRequest], policy: str, fraction: float) -> dict[str, float]:
    """µs of engine-thread CPU per page of `match` over a replay of `requests`."""
    workload = Workload(requests, 128)
    setup = ReplaySetup(page_tokens=128, kv_bytes=64, policy=policy)
    run = run_hicache(workload, setup, max(1, round(fraction * workload.unique_pages)))
    if run.wrong_bytes:
        raise SystemExit(f"{run.wrong_bytes} wrong bytes loaded under {policy}")
    t = run.timings
    m, s = per_page(t.match_ns, t.match_pages), per_page(t.store_ns, t.store_pages)
    return {"match": m["total"], "match_median": m["median"], "store": s["total"]}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def commit() -> str:
    out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--machine", default="cpu", help="label of this machine in the file name")
    ap.add_argument("--policy", default="prefix", help="the policy replayed through hicache")
    ap.add_argument("--host-size", type=float, default=0.05, help="fraction of distinct pages")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()

    requests = read_trace(args.trace)
    workload = Workload(requests, 128)
    setup = ReplaySetup(page_tokens=128, kv_bytes=64, policy=args.policy)
    pages = max(1, round(args.host_size * workload.unique_pages))
    report = replay(workload, setup, pages, FRACTIONS, policies=None)
    report["sweep"] = sweep(workload, setup, FRACTIONS)
    report["trace"] = args.trace.name
    second = Workload(conversation_requests(), 128)
    result = {
        "commit": commit(),
        "machine": f"{args.machine}: {os.cpu_count()} CPUs ({platform.machine()}), {cpu_model()}",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "trace": args.trace.name,
        "requests": report["requests"],
        "unique_pages": report["unique_pages"],
        "page_tokens": report["page_tokens"],
        "default_policy": report["default_policy"],
        "sweep": report["sweep"],
        "replay": {
            k: report[k]
            for k in (
                "policy",
                "host_pages",
                "host_fraction",
                "hit_share",
                "policy_sim_share",
                "lru_share",
                "belady_share",
                "wrong_bytes",
                "match_us_per_page",
                "store_us_per_page",
            )
        },
        "match_us_per_page": {
            "trace": {p: match_cost(requests, p, args.host_size) for p in ("lru", args.policy)},
            "shared_head": {
                p: match_cost(shared_head_requests(), p, 0.5) for p in ("lru", args.policy)
            },
        },
        "second_trace": {
            "shape": conversation_requests.__doc__.split("\n")[0],
            "unique_pages": second.unique_pages,
            "sweep": sweep(second, setup, FRACTIONS),
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"trace_{args.machine}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    plot(report, args.out / f"trace_{args.machine}.png", f"{args.trace.name}: prefix hit share")
    print(json.dumps({k: result[k] for k in ("replay", "match_us_per_page")}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
