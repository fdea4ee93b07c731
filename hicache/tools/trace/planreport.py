"""The planner's output: a table, and the plot of hit share and TTFT against the host size."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from hicache.tools.trace.planner import TierPlan, TtftModel, plan
from hicache.tools.trace.workload import Workload

HOST_SCALES = (0.125, 0.25, 0.5, 1.0, 2.0, 4.0)
"""The plot's host sizes, as multiples of the planned one."""


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


def table(r: dict[str, Any]) -> str:
    """The planner's report (`planner.plan`) as aligned lines of text."""
    lines = [
        f"requests {r['requests']:,}, prompt tokens {r['prompt_tokens']:,}, page {r['page_tokens']}"
        f" tokens = {_size(r['page_bytes'])}, distinct pages {r['unique_pages']:,}",
        "",
        f"{'tier':<10} {'capacity':>12} {'pages':>10} {'served':>8} {'read':>11} {'peak/s':>11}"
        f" {'written':>11} {'peak/s':>11}",
    ]
    for t in r["tiers"]:
        lines.append(
            f"{t['name']:<10} {_size(t['capacity_pages'] * r['page_bytes']):>12} "
            f"{t['capacity_pages']:>10,} {t['hit_share']:>8.2%} {_size(t['read_bytes']):>11} "
            f"{_size(t['read_bytes_peak_per_s']):>11} {_size(t['write_bytes']):>11} "
            f"{_size(t['write_bytes_peak_per_s']):>11}"
        )
    e = r["ttft_estimate_s"]
    lines += [
        f"{'all':<10} {'':>12} {'':>10} {r['hit_share']:>8.2%}",
        "",
        "estimated time to first token      p50        p90        p99",
        f"  with these tiers           {e['p50']:9.3f} s {e['p90']:9.3f} s {e['p99']:9.3f} s",
        f"  no cache                   {e['no_cache_p50']:9.3f} s {e['no_cache_p90']:9.3f} s "
        f"{e['no_cache_p99']:9.3f} s",
    ]
    return "\n".join(lines)


def host_sweep(
    workload: Workload,
    tiers: Sequence[TierPlan],
    page_bytes: int,
    run: Callable[[Workload, list[TierPlan], int], dict[str, Any]],
    scales: Sequence[float] = HOST_SCALES,
) -> list[dict[str, Any]]:
    """Rows {host_bytes, with_stores, hit_share, ttft_p50_s, ttft_p90_s}: the plan at each
    host size (`scales` of the planned one), with the store tiers and with the host alone."""
    rows = []
    variants = (
        [(True, list(tiers)), (False, [tiers[0]])] if len(tiers) > 1 else [(False, [tiers[0]])]
    )
    for with_stores, chain in variants:
        for scale in scales:
            host = replace(chain[0], size=max(page_bytes, int(chain[0].size * scale)))
            r = run(workload, [host, *chain[1:]], page_bytes)
            rows.append(
                {
                    "host_bytes": host.size,
                    "with_stores": with_stores,
                    "hit_share": r["hit_share"],
                    "ttft_p50_s": r["ttft_estimate_s"]["p50"],
                    "ttft_p90_s": r["ttft_estimate_s"]["p90"],
                    "no_cache_p50_s": r["ttft_estimate_s"]["no_cache_p50"],
                }
            )
    return rows


def runner(
    model: TtftModel, floor: int, verdict: float, progress: Callable[[int], None] | None
) -> Callable[[Workload, list[TierPlan], int], dict[str, Any]]:
    """`plan` with these settings, for `host_sweep`."""

    def run(workload: Workload, tiers: list[TierPlan], page_bytes: int) -> dict[str, Any]:
        return plan(workload, tiers, page_bytes, model, floor, verdict, progress)

    return run


def plot(rows: list[dict[str, Any]], stores: str, path: str | Path, title: str = "") -> None:
    """Hit share and p50/p90 TTFT against the host size, with `stores` and without. Needs
    matplotlib (the CLI checks first)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (share, ttft) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=120)
    for with_stores, style in ((True, "o-"), (False, "s--")):
        mine = [row for row in rows if row["with_stores"] == with_stores]
        if not mine:
            continue
        x = [row["host_bytes"] / 2**30 for row in mine]
        label = f"host + {stores}" if with_stores else "host alone"
        share.plot(x, [row["hit_share"] * 100 for row in mine], style, ms=4, label=label)
        ttft.plot(x, [row["ttft_p50_s"] for row in mine], style, ms=4, label=f"{label}, p50")
        ttft.plot(x, [row["ttft_p90_s"] for row in mine], style, ms=3, alpha=0.5,
                  label=f"{label}, p90")  # fmt: skip
    ttft.axhline(rows[0]["no_cache_p50_s"], color="gray", ls=":", label="no cache, p50")
    for ax in (share, ttft):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("host tier, GiB (log)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    share.set_ylabel("prompt tokens served from cache, %")
    share.set_ylim(0, 100)
    ttft.set_ylabel("estimated TTFT, s")
    ttft.set_yscale("log")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
