"""Engines behind a router on a session trace: `hicache trace --instances` over the engine counts.

    python bench/cluster.py ../shared/traces/agentic_sessions.jsonl.gz --machine cpu

Runs the sweep a user runs (`hicache trace TRACE --instances 1,2,...,64`: every router, each
engine's host tier 2 % of the trace's distinct pages, an unbounded shared store, KV events
1 s late), then the cache-aware router at other event delays, and the sweep again with a
shared store bounded to 10 % of the distinct pages. Writes bench/results/cluster_<machine>.json
(the rows, with commit, machine and command) and the first sweep's plot as cluster_<machine>.png.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, command, commit, cpu_model

from hicache.tools.trace.cli import main as trace_main

COUNTS = "1,2,4,8,16,32,64"


def sweep(trace: Path, *extra: str, plot: Path | None = None) -> tuple[list[dict], float]:
    """The cluster rows of one `hicache trace` run, and its wall time."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "c.json"
        args = [str(trace), "--instances", COUNTS, "--json", str(out), *extra]
        if plot is not None:
            args += ["--plot", str(plot)]
        start = time.perf_counter()
        if trace_main(args) != 0:
            raise SystemExit(f"hicache trace {' '.join(args)} failed")
        return json.loads(out.read_text())["cluster"], time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--machine", default="cpu")
    args = ap.parse_args()
    results = ROOT / "bench" / "results"
    png = results / f"cluster_{args.machine}.png"
    main_rows, main_s = sweep(args.trace, "--host-size", "2%", plot=png)
    delays = {}
    for delay in ("0", "10", "60"):
        rows, _ = sweep(
            args.trace, "--host-size", "2%", "--router", "cache-aware", "--event-delay", delay
        )
        delays[delay] = rows
    bounded, _ = sweep(args.trace, "--host-size", "2%", "--store-size", "10%")
    out = {
        "commit": commit(),
        "machine": cpu_model(),
        "command": command(),
        "trace": str(args.trace),
        "sweep_wall_s": round(main_s, 1),
        "cluster": main_rows,
        "cache_aware_by_event_delay_s": delays,
        "store_10pct": bounded,
    }
    (results / f"cluster_{args.machine}.json").write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
