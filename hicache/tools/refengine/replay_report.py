"""What ``hicache replay`` prints and writes from its results: the table of the engine against
the engine + hicache, a line per extra measurement, and the plot and JSON files asked for."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

__all__ = ["report"]


def report(res: dict[str, Any], args: argparse.Namespace) -> None:
    """Print the table and a line per extra measurement in `res` on stdout, then write the files
    that ``--plot`` and ``--json`` ask for (each named in a line once written)."""
    print(_table(res))
    for line in _summary_lines(res):
        print(line)
    if args.plot:
        off, on, none = res["off"], res["on"], res.get("no_prefix_cache")
        _plot(
            args.plot,
            off["ttft_per_turn_s"],
            on["ttft_per_turn_s"],
            f"{args.model} on {args.device}: TTFT per turn",
            none["ttft_per_turn_s"] if none is not None else None,
        )
        print(f"plot: {args.plot}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2, default=str) + "\n")
        print(f"json: {args.json}")


def _summary_lines(res: dict[str, Any]) -> list[str]:
    """The lines under the table: the last turn, the load average the runs ran under, then each
    extra measurement that `res` holds (no prefix cache, second instance, data-parallel ranks,
    floor)."""
    off, on, none = res["off"], res["on"], res.get("no_prefix_cache")
    speedups = f"{res['last_turn_speedup']:.1f}x"
    if res.get("repeats", 1) > 1:
        lo, hi = res["range"]["last_turn_speedup"]
        speedups += f" [{lo:.1f}–{hi:.1f}x]; TTFT p50 {res['ttft_p50_speedup']:.1f}x"
        lo, hi = res["range"]["ttft_p50_speedup"]
        speedups += f" [{lo:.1f}–{hi:.1f}x]"
    lines = [
        f"last turn: TTFT {off['ttft_per_turn_s'][-1] * 1e3:.1f} ms (engine with its GPU prefix "
        f"cache), {on['ttft_per_turn_s'][-1] * 1e3:.1f} ms with hicache ({speedups})"
    ]
    load = res.get("load_average")
    if load is not None:
        before, after = (" ".join(f"{v:.2f}" for v in load[k]) for k in ("before", "after"))
        lines.append(
            f"load average (1, 5, 15 min): {before} before, {after} after; the runs took "
            f"turns, a turn of every conversation each"
        )
    if none is not None:
        lines.append(
            f"extra row, an engine with no prefix cache at all: last turn TTFT "
            f"{none['ttft_per_turn_s'][-1] * 1e3:.1f} ms, "
            f"TTFT p50 {none['ttft_p50_s'] * 1e3:.1f} ms"
        )
    second = res.get("second_instance")
    if second is not None:
        lines.append(
            f"second instance (empty host tier, same store, the first closed), last turns "
            f"again: {second['cached_tokens_store']} of {second['prompt_tokens']} prompt tokens "
            f"from the store tiers, "
            f"TTFT {second['ttft_p50_s'] * 1e3:.1f} ms (p50; engine alone: "
            f"{off['ttft_per_turn_s'][-1] * 1e3:.1f} ms), outputs identical: "
            f"{'yes' if second['identical'] else 'NO'}"
        )
    if "dp" in res:
        from hicache.tools.refengine.dp import dp_lines

        dp = dp_lines(res["dp"], on["later_turns_ttft_p50_s"], off["later_turns_ttft_p50_s"])
        lines.append("\n".join(dp))
    lines += [
        f"floor at {row['prompt_tokens']} tokens: {row['floor_s'] * 1e3:.1f} ms "
        f"(load {row['load_s_at_link'] * 1e3:.1f} + suffix {row['suffix_prefill_s'] * 1e3:.1f})"
        f", TTFT on {row['ttft_on_s'] * 1e3:.1f} ms, from admission "
        f"{row['service_s'] * 1e3:.1f} ms = {row['ratio_to_floor']:.2f}x floor"
        for row in res.get("floor", [])
    ]
    return lines


def _table(res: dict[str, Any]) -> str:
    """The engine alone against the engine + hicache, a row per figure; over repetitions, each
    timed figure is the median with its range in brackets, and a last line says so."""
    off, on = res["off"], res["on"]
    share = res["cached_token_share"]
    rng = res.get("range") if res.get("repeats", 1) > 1 else None

    def timed(key: str, value: float, scale: float, unit: str) -> str:
        text = f"{value * scale:.{1 if unit == 'ms' else 2}f} {unit}"
        if rng is None:
            return text
        lo, hi = (v * scale for v in rng[key])
        return f"{text} [{lo:.0f}–{hi:.0f}]"

    rows = [
        ("TTFT p50", timed("ttft_p50_off_s", off["ttft_p50_s"], 1e3, "ms"),
         timed("ttft_p50_on_s", on["ttft_p50_s"], 1e3, "ms")),
        ("TTFT p90", timed("ttft_p90_off_s", off["ttft_p90_s"], 1e3, "ms"),
         timed("ttft_p90_on_s", on["ttft_p90_s"], 1e3, "ms")),
        ("end-to-end", timed("e2e_off_s", off["e2e_s"], 1, "s"),
         timed("e2e_on_s", on["e2e_s"], 1, "s")),
        ("requests/hour", f"{off['requests_per_hour']:.0f}", f"{on['requests_per_hour']:.0f}"),
        ("prompt tokens", f"{off['prompt_tokens']:.0f}", f"{on['prompt_tokens']:.0f}"),
        ("from GPU prefix", f"{off['cached_tokens_gpu']:.0f}", f"{on['cached_tokens_gpu']:.0f}"),
        ("from host tier", "0", f"{on['cached_tokens_host']:.0f}"),
        *([("from store tiers", "0", f"{on['cached_tokens_store']:.0f}")] if res["store"] else []),
        ("cached share", f"{res['gpu_cached_share_off'] * 100:.1f}%", f"{share * 100:.1f}%"),
    ]  # fmt: skip
    width = max(16, *(len(c) + 2 for row in rows for c in row[1:]))
    lines = [f"{'':18}{'engine':>{width}}{'+ hicache':>{width}}"]
    lines += [f"{a:18}{b:>{width}}{c:>{width}}" for a, b, c in rows]
    same = "yes" if res["identical"] else "NO"
    if "repeats" in res:
        same += f" ({res['identical_requests']} of {res['requests']})"
    lines.append(f"{'outputs identical':18}{same:>{2 * width}}")
    if rng is not None:
        lines.append(f"median of {res['repeats']} repetitions [smallest–largest]")
    return "\n".join(lines)


def _plot(
    path: str, off: list[float], on: list[float], title: str, none: list[float] | None = None
) -> None:
    """A PNG at `path`: each run's median TTFT per turn (ms, log scale)."""
    import matplotlib  # there: checked before the run

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns = list(range(1, len(off) + 1))
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    if none is not None:
        ax.plot(turns, [t * 1e3 for t in none], "x:", label="engine, no prefix cache")
    ax.plot(turns, [t * 1e3 for t in off], "o-", label="engine with GPU prefix cache")
    ax.plot(turns, [t * 1e3 for t in on], "s-", label="same engine + hicache")
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT, median over conversations (ms)")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
