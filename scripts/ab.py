"""Compare the engine-thread cost of `match` and `store` in two source trees, interleaved.

    python scripts/ab.py BEFORE_TREE AFTER_TREE [--rounds 5] [--out FILE]

Each round runs, in both trees (the order alternating from round to round), that tree's own
`bench/trace.py match-latency --runs 200` and `bench/tiers.py engine-thread --rounds 1`, with
the tree first on `PYTHONPATH`. Per row it records the medians of the statistic over the
rounds for each tree, and the per-round ratio after / before (median and range): on a shared
machine only a ratio measured side by side means something. Writes JSON with the after tree's
commit (``commit``) and the before tree's (``commit_before``), the machine and this command.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MATCH_ROWS = ("match_int32_array", "match_next_turn_memo", "release")
TIER_CONFIGS = ("host_only", "host_mooncake", "host_disk_mooncake")


def commit(tree: Path) -> str:
    out = subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return out.stdout.strip() or "unknown"


def run_bench(tree: Path, args: list[str]) -> dict:
    """One bench script of `tree`, its JSON result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        env = {**os.environ, "PYTHONPATH": str(tree)}
        cmd = [sys.executable, *args, "--out", str(out)]
        subprocess.run(cmd, cwd=tree, env=env, check=True, capture_output=True)
        return json.loads(out.read_text())


def one_round(tree: Path) -> dict[str, float]:
    """Row name -> the statistic, for one run of both scripts in `tree`."""
    rows: dict[str, float] = {}
    match = run_bench(tree, ["bench/trace.py", "match-latency", "--runs", "200"])
    for name in MATCH_ROWS:
        rows[f"match-latency {name} median_us"] = match["results"][name]["median_us"]
    tiers = run_bench(tree, ["bench/tiers.py", "engine-thread", "--rounds", "1"])
    for row in tiers["rows"]:
        for config in TIER_CONFIGS:
            if config in row:
                rows[f"engine-thread {row['call']} {config} cpu_p50_us"] = row[config]["cpu_p50_us"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    seen: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for r in range(args.rounds):
        for side in ("before", "after") if r % 2 == 0 else ("after", "before"):
            seen[side].append(one_round(trees[side]))
            print(f"round {r + 1}/{args.rounds}: {side} done", file=sys.stderr)
    rows = []
    for name in seen["before"][0]:
        before = [rnd[name] for rnd in seen["before"]]
        after = [rnd[name] for rnd in seen["after"]]
        ratios = [a / b for a, b in zip(after, before) if b > 0]
        rows.append(
            {
                "row": name,
                "before": statistics.median(before),
                "after": statistics.median(after),
                "ratio_median": round(statistics.median(ratios), 3) if ratios else None,
                "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)] if ratios else None,
            }
        )
        print(f"{name:60s} {rows[-1]['before']:9.1f} {rows[-1]['after']:9.1f} "
              f"{rows[-1]['ratio_median']}  {rows[-1]['ratio_range']}")  # fmt: skip
    result = {
        "commit": commit(trees["after"]),
        "commit_before": commit(trees["before"]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, CPU only, shared with other jobs",
        "command": "python scripts/ab.py " + " ".join(sys.argv[1:]),
        "bench": "engine-thread cost of match and store, two trees interleaved",
        "note": "commit: the tree measured (after); commit_before: the tree it is compared with. "
        "ratio = after / before per round; median and range over the rounds",
        "rows": rows,
    }
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
