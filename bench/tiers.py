"""Engine-thread cost of the tier chain: `match`, `store` and `poll` with host + disk + Mooncake
against host only, in the same run.

    python bench/tiers.py --out bench/results/tiers_<machine>.json

Each configuration replays the same requests through a fresh `HiCache` on the CPU: `--prompts`
distinct prompts of `--pages` pages, twice over. The host tier holds a quarter of them, so in
the second pass a prompt is gone from the host: with the chain it is fetched from the disk tier
(it holds them all); host only, it is recomputed and stored again. The engine loop is an
engine's: match (asking again, one poll apart, while the answer is pending), load, store,
release. Every call the engine thread makes to hicache is timed, by its thread CPU time and by
the wall clock; the configurations take turns `--rounds` times so that both see the same
machine. A third configuration, host + Mooncake, gives one store tier's share. Rows give p50
and p99 in µs per call kind and configuration, and each chain's figures less host-only's (what
the chain adds on the engine thread, for one store tier and for two).

Needs Mooncake (a master is started on loopback for the run). Prints JSON; with --out also
writes it.
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
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests")]

from mooncake_master import MooncakeMaster  # noqa: E402

from hicache import HiCache, PagedBuffer, load_config  # noqa: E402

PAGE_TOKENS = 16
PAGE_BYTES = 16 << 10
KINDS = ("match_first", "match_again", "store", "poll")


def config(tiers: list[dict], host_pages: int) -> dict:
    return {
        "layout": {
            "model": "bench-tiers",
            "kv_dtype": "bfloat16",
            "page_tokens": PAGE_TOKENS,
            "page_bytes": PAGE_BYTES,
        },
        "tiers": [{"type": "host", "size": host_pages * PAGE_BYTES}, *tiers],
        "policy": {"fetch_max_wait_ms": 5000},
    }


def replay(cfg: dict, prompts: list[np.ndarray], pages: int) -> dict[str, list[tuple[int, int]]]:
    """Run every prompt twice through a fresh cache; per call kind, (thread ns, wall ns)."""
    samples: dict[str, list[tuple[int, int]]] = {k: [] for k in KINDS}
    gpu = torch.zeros(pages + 1, PAGE_BYTES, dtype=torch.uint8)
    cache = HiCache(load_config(cfg, env={}), PagedBuffer.page_first(gpu))
    if not cache.wait_ready(60):
        raise RuntimeError("hicache was not ready in 60 s")
    blocks = list(range(pages + 1))

    def timed(kind: str, call: Callable[..., object], *args: object) -> object:
        t0, w0 = time.thread_time_ns(), time.perf_counter_ns()
        out = call(*args)
        samples[kind].append((time.thread_time_ns() - t0, time.perf_counter_ns() - w0))
        return out

    try:
        for i, tokens in enumerate(prompts + prompts):
            rid = f"r{i}"
            timed("poll", cache.poll)
            m = timed("match_first", cache.match, rid, tokens)
            deadline = time.monotonic() + 10
            while m.pending:  # type: ignore[attr-defined]
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{rid}: pending for 10 s")
                time.sleep(0.0002)
                timed("poll", cache.poll)
                m = timed("match_again", cache.match, rid, tokens)
            cache.load(m, blocks)  # type: ignore[arg-type]
            timed("store", cache.store, rid, tokens, blocks)
            cache.release(rid)
        deadline = time.monotonic() + 30
        while not cache.tiers_idle and time.monotonic() < deadline:
            cache.poll()
            time.sleep(0.001)
        stats = cache.stats()
    finally:
        cache.close()
    fetched = sum(
        v for k, v in stats.items() if k.startswith("hit_tokens_") and k != "hit_tokens_host"
    )
    samples["_stats"] = [(fetched, stats["hit_tokens_host"])]
    return samples


def pct(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    n_tokens = args.pages * PAGE_TOKENS + 1
    host_pages = args.prompts * args.pages // 4
    results: dict[str, dict[str, list[tuple[int, int]]]] = {}
    hits: dict[str, list[tuple[int, int]]] = {}
    with MooncakeMaster() as master, tempfile.TemporaryDirectory() as tmp:
        segment = 2 * args.prompts * args.pages * PAGE_BYTES
        moon = {
            **master.tier_config,
            "type": "mooncake",
            "global_segment_size": max(segment, 16 << 20),
        }
        for r in range(args.rounds):
            base = 1_000_000 * r  # fresh prompts every round: nothing is held from the last
            prompts = [
                rng.integers(base, base + 50_000, n_tokens).astype(np.int32)
                for _ in range(args.prompts)
            ]
            disk = {"type": "disk", "path": f"{tmp}/d{r}", "size": 2 * segment}
            prefix = f"bench{os.getpid()}r{r}"
            configs = {
                "host_only": config([], host_pages),
                "host_mooncake": config([{**moon, "key_prefix": f"{prefix}m"}], host_pages),
                "host_disk_mooncake": config(
                    [disk, {**moon, "key_prefix": f"{prefix}dm"}], host_pages
                ),
            }
            for name, cfg in configs.items():
                got = replay(cfg, prompts, args.pages)
                hits.setdefault(name, []).extend(got.pop("_stats"))
                for kind, values in got.items():
                    results.setdefault(name, {}).setdefault(kind, []).extend(values)

    rows = []
    for kind in KINDS:
        row: dict[str, object] = {"call": kind}
        for name, by_kind in results.items():
            values = by_kind[kind]
            if not values:
                continue
            cpu, wall = [v[0] for v in values], [v[1] for v in values]
            row[name] = {
                "calls": len(values),
                "cpu_p50_us": round(pct(cpu, 0.5), 1),
                "cpu_p99_us": round(pct(cpu, 0.99), 1),
                "wall_p50_us": round(pct(wall, 0.5), 1),
                "wall_p99_us": round(pct(wall, 0.99), 1),
                "cpu_mean_us": round(statistics.fmean(cpu) / 1e3, 1),
            }
        base = row.get("host_only")
        for name in ("host_mooncake", "host_disk_mooncake"):
            if isinstance(base, dict) and isinstance(row.get(name), dict):
                for q in ("p50", "p99"):
                    added = row[name][f"cpu_{q}_us"] - base[f"cpu_{q}_us"]  # type: ignore[index]
                    row[f"{name}_adds_cpu_{q}_us"] = round(added, 1)
        rows.append(row)
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    out = {
        "bench": "tiers",
        "commit": commit,
        "machine": f"{os.cpu_count()} CPUs ({platform.machine()}), CPU only, loopback TCP",
        "command": "python " + " ".join([f"bench/{Path(sys.argv[0]).name}", *sys.argv[1:]]),
        "workload": {
            "prompts": args.prompts,
            "pages": args.pages,
            "page_bytes": PAGE_BYTES,
            "host_pages": host_pages,
            "rounds": args.rounds,
            "passes": 2,
        },
        "hit_tokens_fetched_host": {k: [sum(x) for x in zip(*v)] for k, v in hits.items()},
        "rows": rows,
    }
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
