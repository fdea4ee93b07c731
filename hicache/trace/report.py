"""The replay's report: a readable table, the JSON file, and the capacity-sweep plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def table(result: dict[str, Any]) -> str:
    """The report of `hicache.trace.replay.replay` as aligned lines of text."""
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
        f"  hicache, all tiers       {pct(r['hit_share'])}",
        f"  exact LRU, same capacity {pct(r['lru_share'])}  "
        f"(hicache - LRU: {_points(r['hit_share'] - r['lru_share'])} points)",
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
        "CPU time per page       total   median of calls",
    ]
    for name in ("match", "store", "load"):
        c = r["calls"][name]
        lines.append(
            f"  {name:<8} {c['total']:9.3f} µs {c['median']:9.3f} µs   "
            f"({c['calls']:,} calls, {c['pages']:,} pages)"
        )
    lines += ["", "capacity sweep (fraction of distinct pages: hit share)"]
    for p in r["sweep"]:
        row = f"  {p['fraction']:5.0%} {p['host_pages']:>9,} pages  LRU {pct(p['lru_share'])}"
        if "hicache_share" in p:
            row += f"  hicache {pct(p['hicache_share'])}"
        lines.append(row)
    lines.append(f"  infinite cache: {pct(r['oracle_share'])}")
    return "\n".join(lines)


def _points(diff: float) -> str:
    text = f"{diff * 100:+.2f}"
    return "+0.00" if text == "-0.00" else text


def write_json(result: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")


def plot(result: dict[str, Any], path: str | Path, title: str = "") -> None:
    """Hit share against host capacity: LRU simulation, hicache points, the infinite cache.

    Needs matplotlib (ImportError with a hint if it is missing).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError("--plot needs matplotlib: pip install matplotlib") from err
    pts = result["sweep"]
    x = [p["fraction"] * 100 for p in pts]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    ax.plot(x, [p["lru_share"] * 100 for p in pts], "o-", label="exact LRU (simulation)")
    hx = [p["fraction"] * 100 for p in pts if "hicache_share" in p]
    hy = [p["hicache_share"] * 100 for p in pts if "hicache_share" in p]
    if result.get("host_fraction") is not None:
        hx.append(result["host_fraction"] * 100)
        hy.append(result["hit_share"] * 100)
    ax.plot(hx, hy, "x", markersize=9, mew=2, label="hicache (replayed)")
    ax.axhline(result["oracle_share"] * 100, color="gray", ls="--", label="infinite cache")
    ax.set_xlabel("host capacity, % of the trace's distinct pages")
    ax.set_ylabel("prompt tokens served from cache, %")
    ax.set_ylim(0, 100)
    ax.set_xlim(0, max(x + hx + [100]) * 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title or f"{result['requests']} requests, page_tokens {result['page_tokens']}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
