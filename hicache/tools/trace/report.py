"""The replay's report: a readable table, the JSON file, and the capacity-sweep plot."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def table(result: dict[str, Any]) -> str:
    """The report of `hicache.tools.trace.replay.replay` as aligned lines of text."""
    r = result
    pct = "{:6.2%}".format
    lines = [
        f"requests {r['requests']}, prompt tokens {r['prompt_tokens']:,}, "
        f"page_tokens {r['page_tokens']}, distinct pages {r['unique_pages']:,}",
        f"host capacity {r['host_pages']:,} pages ({r['host_fraction']:.0%} of distinct pages)",
        "",
        "prompt tokens served from cache",
    ]
    for tier, share in r["hit_share_by_tier"].items():
        lines.append(f"  hicache, {tier:<16} {pct(share)}")
    lines += [
        f"  hicache, all tiers       {pct(r['hit_share'])}  (host tier policy: {r['policy']})",
        f"  {r['policy']} simulated{'':<{14 - len(r['policy'])}} {pct(r['policy_sim_share'])}  "
        f"(hicache - simulation: {_points(r['hit_share'] - r['policy_sim_share'])} points)",
        f"  exact LRU, same capacity {pct(r['lru_share'])}",
        f"  offline farthest-next-use {pct(r['belady_share'])}",
        f"  infinite cache           {pct(r['oracle_share'])}",
        f"  trace ceiling per block  {pct(r['block_ceiling'])}  "
        "(512-token blocks, partial blocks counted, no cap)",
        f"  held but capped          {pct(r['limited_share'])}  "
        f"(min_recompute_tokens={r['min_recompute_tokens']})",
        "",
        f"wrong bytes in loaded pages: {r['wrong_bytes']}"
        + (
            f"; matches still pending (recomputed): {r['pending_timeouts']}"
            if r["pending_timeouts"]
            else ""
        ),
        "",
        "engine-thread CPU time per page   total   median of calls",
    ]
    for name in ("match", "store", "load"):
        c = r["calls"][name]
        lines.append(
            f"  {name:<18} {c['total']:9.3f} µs {c['median']:9.3f} µs   "
            f"({c['calls']:,} calls, {c['pages']:,} pages)"
        )
    lines += ["", *sweep_lines(r)]
    return "\n".join(lines)


def sweep_lines(r: dict[str, Any]) -> list[str]:
    """The capacity sweep of a report (its `sweep` rows and `oracle_share`) as lines."""
    pct = "{:6.2%}".format
    lines = ["capacity sweep (fraction of distinct pages: simulated hit share)"]
    names = list(dict.fromkeys(row["policy"] for row in r["sweep"]))
    lines.append("  capacity " + "".join(f"{n:>9}" for n in names) + "  offline")
    for frac in dict.fromkeys(row["host_fraction"] for row in r["sweep"]):
        rows = {row["policy"]: row for row in r["sweep"] if row["host_fraction"] == frac}
        cells = "".join(f"{pct(rows[n]['hit_share']):>9}" for n in names)
        belady = next(iter(rows.values()))["belady_share"]
        lines.append(f"  {frac:7.0%}  {cells}  {pct(belady)}")
    lines.append(f"  infinite cache: {pct(r['oracle_share'])}")
    return lines


def write_problem(path: str | Path | None, what: str) -> str | None:
    """Why `path` (an output file) cannot be written, checked before any work; None if it can
    (or no path is given)."""
    if path is None:
        return None
    folder = Path(path).resolve().parent
    if not folder.is_dir():
        return f"{what} {path}: the folder {folder} does not exist"
    if not os.access(folder, os.W_OK):
        return f"{what} {path}: the folder {folder} is not writable"
    return None


def _points(diff: float) -> str:
    text = f"{diff * 100:+.2f}"
    return "+0.00" if text == "-0.00" else text


def write_json(result: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")


def plot(result: dict[str, Any], path: str | Path, title: str = "") -> None:
    """Hit share against host capacity: each simulated policy, the offline reference, the
    replayed hicache point and the infinite cache. Needs matplotlib (the CLI checks first)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["sweep"]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for name in dict.fromkeys(row["policy"] for row in rows):
        mine = [row for row in rows if row["policy"] == name]
        x = [row["host_fraction"] * 100 for row in mine]
        ax.plot(x, [row["hit_share"] * 100 for row in mine], "o-", ms=4, label=name)
    first = list(dict.fromkeys(row["host_fraction"] for row in rows))
    offline = {row["host_fraction"]: row["belady_share"] for row in rows}
    ax.plot(
        [f * 100 for f in first],
        [offline[f] * 100 for f in first],
        "k^--",
        ms=4,
        label="offline (farthest next use)",
    )
    if "hit_share" in result:  # a replay, not the simulations alone
        ax.plot(
            [result["host_fraction"] * 100],
            [result["hit_share"] * 100],
            "x",
            markersize=9,
            mew=2,
            label=f"hicache replayed ({result['policy']})",
        )
    ax.axhline(result["oracle_share"] * 100, color="gray", ls=":", label="infinite cache")
    ax.set_xscale("log")
    ticks = sorted({f * 100 for f in first} | {result.get("host_fraction", first[0]) * 100})
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("host capacity, % of the trace's distinct pages (log)")
    ax.set_ylabel("prompt tokens served from cache, %")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3, which="both")
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(title or f"{result['requests']} requests, page_tokens {result['page_tokens']}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
