"""Isolated eviction (`hicache.core.shares`): the hit rate a tenant replaying agentic sessions
keeps while another floods the cache with unique prompts, through the real `HiCache`.

    python bench/tenants.py --machine <name> [--requests 3000] [--host-pages 8192]
    python bench/tenants.py --machine <name> --tier disk --host-pages 1024 --disk-pages 8192

Tenant "sessions" replays the first `--requests` requests of the agentic coding sessions
(/work/shared/traces/agentic_sessions.jsonl.gz, or `--trace`), in order; each 512-token block
of the trace is one page of `PAGE_TOKENS` tokens made from its hash id (equal ids, equal
pages; a page's key chains its prefix, as the trace's ids do). Tenant "flood" sends, after each
of them, `--flood` prompts of as many pages that never repeat. Every request is a real
`match`, `load`, `store` and `release` on a `HiCache` whose host tier holds `--host-pages`
pages (CPU), so the eviction measured is the cache's own. With ``--tier host`` there is no
store tier and the terms are the host tier's; with ``--tier disk`` a disk tier of
`--disk-pages` pages (in records of `GROUP` pages) sits below a host tier that keeps no terms,
and the terms are the disk tier's (each request waits for the disk and its puts, so the counts
do not depend on timing). Four runs:

- ``alone``: the sessions only, no tenants' terms in the configuration (host: the compiled LRU
  books; disk: the plain LRU book);
- ``alone_shares``: the same with the tenants' terms;
- ``flood_lru``: sessions and flood, no tenants' terms: one LRU for both;
- ``flood_shares``: sessions and flood, the sessions' tenant guaranteed `--share` of the tier,
  the flood held to `--flood-quota` of it.

The figure is the sessions' hit rate: tokens `match` answered from the cache over the prompt
tokens asked (an engine always recomputes a prompt's last token, so 100 % is out of reach).
The runs are deterministic: the same arguments give the same counts on any machine. Writes
bench/results/tenants_<machine>.json (``tenants_disk_<machine>.json`` with ``--tier disk``)
unless `--out` says otherwise.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import command, commit, cpu_model, write_result
from hicache import HiCache, PagedBuffer, load_config

PAGE_TOKENS = 4
PAGE_BYTES = 16
GROUP = 4
"""Pages of a disk record (`group_pages`)."""
RECORD = 4096 + GROUP * PAGE_BYTES
"""A disk record's bytes: its header block, then its pages."""
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


def cache_config(args: argparse.Namespace, shares: bool, disk: Path | None) -> dict:
    """The bench's configuration: its terms on the host tier, or on the disk tier at `disk`."""
    host = args.host_pages * PAGE_BYTES
    tiers: list[dict] = [{"type": "host", "size": host, "pin": "no"}]
    size, tier = host, "host"
    if disk is not None:
        size, tier = args.disk_pages // GROUP * RECORD, "disk"
        tiers.append({"type": "disk", "path": str(disk), "size": size, "group_pages": GROUP,
                      "sync": False})  # fmt: skip
    unit = RECORD if disk is not None else PAGE_BYTES
    tenants: list[dict] = [{"name": "sessions"}, {"name": "flood"}]
    if shares:
        tenants[0]["share"] = {tier: int(args.share * size) // unit * unit}
        tenants[1]["quota"] = {tier: int(args.flood_quota * size) // unit * unit}
    return {
        "layout": {"model": "bench", "kv_dtype": "bfloat16", "page_tokens": PAGE_TOKENS,
                   "page_bytes": PAGE_BYTES},
        "tiers": tiers,
        # with a disk: every page it holds is read (pages this small make reading them look
        # slow to the cost model, whose choice is not what is measured here)
        "policy": {"prefix_memo": 0, "fetch_max_wait_ms": 600_000.0,
                   **({"prefill_tokens_per_s": 1e-6} if disk is not None else {})},
        "tenants": tenants,
    }  # fmt: skip


def settle(cache: HiCache) -> None:
    """Wait until no store tier has work queued or running."""
    while not cache.tiers_idle:
        cache.poll()
        time.sleep(0.0005)
    cache.poll()


def run(args, prompts: list[np.ndarray], flood: int, shares: bool) -> dict:
    """One run: every prompt of the sessions' tenant (each followed by `flood` unique prompts of
    the flood's tenant); the sessions' hit and asked tokens, and the flood's."""
    disk = Path(tempfile.mkdtemp(prefix="hicache-tenants-")) if args.tier == "disk" else None
    cfg = load_config(cache_config(args, shares, disk), env={})
    blocks = max(len(p) for p in prompts) // PAGE_TOKENS + 1
    pool = torch.zeros(blocks, PAGE_BYTES, dtype=torch.uint8)
    cache = HiCache(cfg, PagedBuffer.page_first(pool))
    if not cache.wait_ready(600):
        raise RuntimeError("the host tier was not allocated")
    ids = list(range(blocks))
    rng = np.random.default_rng(0)
    counts = {"sessions": [0, 0, 0], "flood": [0, 0, 0]}  # hit, asked, from the disk
    start = time.perf_counter()

    def request(rid: str, tokens: np.ndarray, salt: str) -> None:
        m = cache.match(rid, tokens, salt=salt)
        while m.pending:  # the disk tier's answer
            cache.poll()
            m = cache.match(rid, tokens, salt=salt)
        n = -(-len(tokens) // PAGE_TOKENS)
        cache.load(m, ids[:n])
        cache.store(rid, tokens, ids[:n])
        cache.poll()
        cache.release(rid)
        if disk is not None:
            settle(cache)
        counts[salt][0] += m.hit_tokens
        counts[salt][1] += len(tokens)
        counts[salt][2] += sum(n for tier, n in m.tier_tokens if tier == "disk")

    for i, tokens in enumerate(prompts):
        request(f"s{i}", tokens, "sessions")
        for j in range(flood):  # as many pages, never seen before (ids past the trace's)
            unique = rng.integers(1 << 30, 1 << 31, len(tokens), dtype=np.int64)
            request(f"f{i}-{j}", unique.astype(np.int32), "flood")
    seconds = time.perf_counter() - start
    stats = cache.stats()
    cache.close()
    if disk is not None:
        shutil.rmtree(disk)
    hit, asked, from_disk = counts["sessions"]
    return {
        "sessions_hit_tokens": hit,
        "sessions_tokens": asked,
        "sessions_hit_rate": round(hit / asked, 4),
        "sessions_disk_hit_tokens": from_disk,
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
    ap.add_argument("--tier", choices=("host", "disk"), default="host", help="whose terms")
    ap.add_argument("--host-pages", type=int, default=8192)
    ap.add_argument("--disk-pages", type=int, default=8192, help="with --tier disk")
    ap.add_argument("--flood", type=int, default=1, help="flood prompts per session request")
    ap.add_argument("--share", type=float, default=0.9, help="the sessions' share of the tier")
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
        "tier": args.tier,
        "host_pages": args.host_pages,
        **(
            {"disk_pages": args.disk_pages, "disk_record_pages": GROUP}
            if args.tier == "disk"
            else {}
        ),
        "sessions_share": args.share,
        "flood_quota": args.flood_quota,
        "flood_prompts_per_request": args.flood,
        "runs": runs,
        "points_lost_vs_alone": {
            name: round(100 * (alone - r["sessions_hit_rate"]), 2) for name, r in runs.items()
        },
    }
    name = "tenants" if args.tier == "host" else "tenants_disk"
    write_result(result, name, args.machine, args.out)


if __name__ == "__main__":
    main()
