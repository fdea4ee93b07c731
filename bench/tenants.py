"""Isolated eviction (`hicache.core.shares`): the hit rate a tenant replaying agentic sessions
keeps while another floods the host tier with unique prompts, through the real `HiCache`.

    python bench/tenants.py --machine <name> [--requests 3000] [--host-pages 8192]

Tenant "sessions" replays the first `--requests` requests of the agentic coding sessions
(/work/shared/traces/agentic_sessions.jsonl.gz, or `--trace`), in order; each 512-token block
of the trace is one page of `PAGE_TOKENS` tokens made from its hash id (equal ids, equal
pages; a page's key chains its prefix, as the trace's ids do). Tenant "flood" sends, after each
of them, `--flood` prompts of as many pages that never repeat. Every request is a real
`match`, `load`, `store` and `release` on a `HiCache` whose host tier holds `--host-pages`
pages (CPU, no store tier), so the eviction measured is the cache's own. Four runs:

- ``alone``: the sessions only, no tenants in the configuration (the compiled LRU books);
- ``alone_shares``: the same with the tenants' terms (`TenantBooks`);
- ``flood_lru``: sessions and flood, no tenants' terms: one LRU for both;
- ``flood_shares``: sessions and flood, the sessions' tenant guaranteed `--share` of the host
  tier, the flood held to `--flood-quota` of it.

The figure is the sessions' hit rate: tokens `match` answered from the host tier over the
prompt tokens asked (an engine always recomputes a prompt's last token, so 100 % is out of
reach). The runs are deterministic: the same arguments give the same counts on any machine.
Writes bench/results/tenants_<machine>.json unless `--out` says otherwise.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import command, commit, cpu_model, write_result
from hicache import HiCache, PagedBuffer, load_config

PAGE_TOKENS = 4
PAGE_BYTES = 16
TRACE = Path("/work/shared/traces/agentic_sessions.jsonl.gz")


def sessions(path: Path, n: int) -> list[np.ndarray]:
    """The first `n` requests' prompts as tokens: `PAGE_TOKENS` tokens per hash id."""
    out = []
    with gzip.open(path, "rt") as f:
        for line in f:
            ids = np.asarray(json.loads(line)["hash_ids"], dtype=np.int64)
            tokens = (ids[:, None] * PAGE_TOKENS + np.arange(PAGE_TOKENS)) % (1 << 31)
            out.append(tokens.reshape(-1).astype(np.int32))
            if len(out) == n:
                break
    return out


def cache_config(host_pages: int, shares: bool, share: float, quota: float) -> dict:
    host = host_pages * PAGE_BYTES
    tenants: list[dict] = [{"name": "sessions"}, {"name": "flood"}]
    if shares:
        tenants[0]["share"] = {"host": int(share * host) // PAGE_BYTES * PAGE_BYTES}
        tenants[1]["quota"] = {"host": int(quota * host) // PAGE_BYTES * PAGE_BYTES}
    return {
        "layout": {"model": "bench", "kv_dtype": "bfloat16", "page_tokens": PAGE_TOKENS,
                   "page_bytes": PAGE_BYTES},
        "tiers": [{"type": "host", "size": host, "pin": "no"}],
        "policy": {"prefix_memo": 0},
        "tenants": tenants,
    }  # fmt: skip


def run(args, prompts: list[np.ndarray], flood: int, shares: bool) -> dict:
    """One run: every prompt of the sessions' tenant (each followed by `flood` unique prompts of
    the flood's tenant); the sessions' hit and asked tokens, and the flood's."""
    cfg = load_config(cache_config(args.host_pages, shares, args.share, args.flood_quota), env={})
    blocks = max(len(p) for p in prompts) // PAGE_TOKENS + 1
    pool = torch.zeros(blocks, PAGE_BYTES, dtype=torch.uint8)
    cache = HiCache(cfg, PagedBuffer.page_first(pool))
    if not cache.wait_ready(600):
        raise RuntimeError("the host tier was not allocated")
    ids = list(range(blocks))
    rng = np.random.default_rng(0)
    counts = {"sessions": [0, 0], "flood": [0, 0]}
    start = time.perf_counter()

    def request(rid: str, tokens: np.ndarray, salt: str) -> None:
        m = cache.match(rid, tokens, salt=salt)
        n = -(-len(tokens) // PAGE_TOKENS)
        cache.load(m, ids[:n])
        cache.store(rid, tokens, ids[:n])
        cache.poll()
        cache.release(rid)
        counts[salt][0] += m.hit_tokens
        counts[salt][1] += len(tokens)

    for i, tokens in enumerate(prompts):
        request(f"s{i}", tokens, "sessions")
        for j in range(flood):  # as many pages, never seen before (ids past the trace's)
            unique = rng.integers(1 << 30, 1 << 31, len(tokens), dtype=np.int64)
            request(f"f{i}-{j}", unique.astype(np.int32), "flood")
    seconds = time.perf_counter() - start
    stats = cache.stats()
    cache.close()
    hit, asked = counts["sessions"]
    return {
        "sessions_hit_tokens": hit,
        "sessions_tokens": asked,
        "sessions_hit_rate": round(hit / asked, 4),
        "flood_hit_tokens": counts["flood"][0],
        "flood_tokens": counts["flood"][1],
        "host_pages_evicted": stats["pages_evicted"],
        "tenant_stats": {k: v for k, v in stats.items() if k.startswith("tenant_")},
        "seconds": round(seconds, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--machine", required=True)
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--host-pages", type=int, default=8192)
    ap.add_argument("--flood", type=int, default=1, help="flood prompts per session request")
    ap.add_argument("--share", type=float, default=0.9, help="the sessions' share of the host")
    ap.add_argument("--flood-quota", type=float, default=0.1, help="the flood's quota of it")
    ap.add_argument("--out")
    args = ap.parse_args()
    prompts = sessions(args.trace, args.requests)
    runs = {}
    for name, flood, shares in (
        ("alone", 0, False),
        ("alone_shares", 0, True),
        ("flood_lru", args.flood, False),
        ("flood_shares", args.flood, True),
    ):
        runs[name] = run(args, prompts, flood, shares)
        print(name, json.dumps(runs[name]), flush=True)
    alone = runs["alone"]["sessions_hit_rate"]
    result = {
        "commit": commit(),
        "machine": f"{args.machine}: {cpu_model()}, {os.cpu_count()} CPUs",
        "command": command(),
        "trace": f"{args.trace.name}: first {args.requests} requests, a page per 512-token block",
        "host_pages": args.host_pages,
        "sessions_share": args.share,
        "flood_quota": args.flood_quota,
        "flood_prompts_per_request": args.flood,
        "runs": runs,
        "points_lost_vs_alone": {
            name: round(100 * (alone - r["sessions_hit_rate"]), 2) for name, r in runs.items()
        },
    }
    write_result(result, "tenants", args.machine, args.out)


if __name__ == "__main__":
    main()
