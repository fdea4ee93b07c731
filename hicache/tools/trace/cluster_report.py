"""`hicache trace TRACE --instances N,...`: the cluster sweep's options, table and plot.

Every router of `--router` runs at every engine count of `--instances`
(`hicache.tools.trace.cluster`); each engine's host (and disk) tier has the same size at every
count, the store is shared.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hicache.tools.trace.cluster import DEFAULT_INSTANCES, ROUTERS, ClusterSetup, simulate_cluster
from hicache.tools.trace.planner import bytes_per_token
from hicache.tools.trace.progress import Progress
from hicache.tools.trace.workload import Workload, read_trace

DEFAULT_MODEL = "llama-8b"
"""The model shape whose page bytes the store's traffic is counted in without --model or
--bytes-per-token (the planner's options)."""

SizeParser = Callable[[str, int, int | None], int]

DEFAULT_HOST_SIZE = "2%"
"""Each engine's host tier when --host-size is not given: 2 % of the trace's distinct pages."""


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of engine counts: {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("engine counts must be >= 1")
    return values


def _routers(text: str) -> tuple[str, ...]:
    names = tuple(v.strip() for v in text.split(",") if v.strip())
    unknown = [n for n in names if n not in ROUTERS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown router {', '.join(unknown) or text!r}; known: {', '.join(ROUTERS)}"
        )
    return names


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The cluster options of `hicache trace`."""
    g = p.add_argument_group(
        "cluster",
        "simulate N engines behind a router, each with its own host (and disk) tier of "
        f"--host-size (default here: {DEFAULT_HOST_SIZE}) and --disk-size, one store shared by "
        f"all; bytes counted in pages of --model or --bytes-per-token (default: {DEFAULT_MODEL})",
    )
    g.add_argument(
        "--instances",
        type=_ints,
        help="engine counts, comma-separated (e.g. 1,2,4,8,16,32,64); turns on the cluster "
        f"sweep (default counts in docs: {','.join(map(str, DEFAULT_INSTANCES))})",
    )
    g.add_argument(
        "--router",
        type=_routers,
        default=tuple(ROUTERS),
        help="routers, comma-separated (default: all of %(default)s)",
    )
    g.add_argument(
        "--event-delay",
        type=float,
        default=1.0,
        help="seconds before a KV event reaches the cache-aware router (default: %(default)s)",
    )
    g.add_argument("--disk-size", help="each engine's disk tier, as --host-size (default: none)")
    g.add_argument(
        "--store-size", help="the shared store, as --host-size (default: unbounded; 0: none)"
    )


def run(args: argparse.Namespace, parse_size: SizeParser) -> int:
    """The cluster sweep of `hicache trace` (`args` from its parser, with `add_arguments`);
    `parse_size(spec, distinct pages, page bytes)` reads --host-size and the like."""
    try:
        page_tokens = args.page_tokens or args.block_tokens
        if args.tier:
            raise ValueError(
                "--instances sizes the tiers by --host-size, --disk-size and "
                "--store-size, not --tier"
            )
        if args.model and args.bytes_per_token:
            raise ValueError("give --model or --bytes-per-token, not both")
        if args.bytes_per_token is not None and args.bytes_per_token <= 0:
            raise ValueError(f"--bytes-per-token must be positive, got {args.bytes_per_token}")
        if not args.event_delay >= 0:
            raise ValueError(f"--event-delay must be >= 0 s, got {args.event_delay}")
        per_token = args.bytes_per_token or bytes_per_token(args.model or DEFAULT_MODEL)
        page_bytes = per_token * page_tokens
        requests = read_trace(args.trace, args.limit, args.block_tokens)
        if not requests:
            raise ValueError(f"{args.trace}: no requests")
        w = Workload(requests, page_tokens, args.block_tokens)
        unique = w.unique_pages

        def size(option: str, spec: str) -> int:
            try:
                return parse_size(spec, unique, page_bytes)
            except ValueError as err:
                raise ValueError(str(err).replace("--host-size", option)) from None

        host = size("--host-size", args.host_size or DEFAULT_HOST_SIZE)
        disk = size("--disk-size", args.disk_size) if args.disk_size else 0
        store = None
        if args.store_size is not None:
            store = 0 if args.store_size.strip() == "0" else size("--store-size", args.store_size)
        setups = [
            ClusterSetup(n, router, host, page_tokens, page_bytes, disk, store, args.event_delay)
            for router in args.router
            for n in args.instances
        ]
    except (ValueError, OSError) as err:
        print(f"hicache trace: {err}", file=sys.stderr)
        return 2
    rows = []
    with Progress(len(requests) * len(setups), show=args.progress or sys.stderr.isatty()) as bar:
        for setup in setups:
            rows.append(simulate_cluster(w.requests, w.pages, setup, bar.advance).row(setup))
    result = {
        "trace": str(args.trace),
        "requests": len(requests),
        "prompt_tokens": w.prompt_tokens,
        "page_tokens": page_tokens,
        "unique_pages": unique,
        "page_bytes": page_bytes,
        "cluster": rows,
    }
    print(table(result))
    if args.json_out:
        from hicache.tools.trace.report import write_json

        write_json(result, args.json_out)
    if args.plot:
        plot(result, args.plot, title=f"{Path(args.trace).name}: engines behind a router")
    return 0


def _store_size(pages: int | None) -> str:
    return "unbounded" if pages is None else f"{pages:,} pages"


def table(result: dict[str, Any]) -> str:
    """The cluster rows as aligned lines of text."""
    rows = result["cluster"]
    first = rows[0]
    lines = [
        f"requests {result['requests']}, prompt tokens {result['prompt_tokens']:,}, "
        f"page_tokens {result['page_tokens']}, distinct pages {result['unique_pages']:,}",
        f"per engine: host {first['host_pages']:,} pages, disk {first['disk_pages']:,} pages; "
        f"shared store {_store_size(first['store_pages'])}; "
        f"KV events reach the router after {first['event_delay_s']:g} s",
        "",
        f"{'router':<12} {'engines':>7} {'hit':>7} {'host':>7} {'disk':>7} {'store':>7} "
        f"{'max/mean req':>12} {'store read':>12} {'store write':>12}",
    ]
    pct = "{:7.2%}".format
    for r in rows:
        lines.append(
            f"{r['router']:<12} {r['instances']:>7} {pct(r['hit_share'])} {pct(r['host_share'])} "
            f"{pct(r['disk_share'])} {pct(r['store_share'])} {r['max_over_mean_requests']:12.2f} "
            f"{_bytes(r['store_read_bytes']):>12} {_bytes(r['store_write_bytes']):>12}"
        )
    return "\n".join(lines)


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1000
    return ""  # unreachable


def plot(result: dict[str, Any], path: str | Path, title: str = "") -> None:
    """Against the engine count, per router: the host tier's share (solid) and the whole
    hit share (dashed), the store's reads, and the busiest engine's requests over the mean.
    Needs matplotlib (the CLI checks first)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["cluster"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4), dpi=120)
    for i, name in enumerate(dict.fromkeys(r["router"] for r in rows)):
        mine = [r for r in rows if r["router"] == name]
        x = [r["instances"] for r in mine]
        color = f"C{i}"
        axes[0].plot(x, [r["host_share"] * 100 for r in mine], "o-", c=color, ms=4, label=name)
        axes[0].plot(x, [r["hit_share"] * 100 for r in mine], "--", c=color, lw=1)
        axes[1].plot(x, [r["store_read_bytes"] / 1e12 for r in mine], "o-", c=color, ms=4)
        axes[2].plot(x, [r["max_over_mean_requests"] for r in mine], "o-", c=color, ms=4)
    labels = (
        "prompt tokens from the host tier, % (dashed: all tiers)",
        "bytes read from the shared store, TB",
        "requests of the busiest engine / mean",
    )
    counts = sorted({r["instances"] for r in rows})
    for ax, label in zip(axes, labels):
        ax.set_xscale("log", base=2)
        ax.set_xticks(counts, [str(n) for n in counts])
        ax.minorticks_off()
        ax.set_xlabel("engines")
        ax.set_ylabel(label, fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].set_ylim(0, 100)
    if any(r["store_read_bytes"] for r in rows):
        axes[1].set_yscale("log")
    axes[0].legend(fontsize=8)
    first = rows[0]
    fig.suptitle(
        f"{title}  (host {first['host_pages']:,} pages per engine, store "
        f"{_store_size(first['store_pages'])})",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
