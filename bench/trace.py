"""Eviction policies against the offline reference, and what `match` costs, on request traces.

    python bench/trace.py sweep ../shared/traces/synthetic_trace.jsonl --machine cpu
    python bench/trace.py match-latency [--tokens 131072] [--page-tokens 128] [--runs 200] [--out F]

``sweep`` writes bench/results/trace_<machine>.json and trace_<machine>.png:

- `sweep`: every policy's simulated prefix hit share at 2, 5, 10, 25 and 100 % of the trace's
  distinct pages, beside LRU and the offline farthest-next-use reference (`hicache trace
  --sweep` computes the same rows);
- `replay`: the trace replayed through a real HiCache whose host tier runs `--policy` at
  `--host-size`, every loaded byte checked (`wrong_bytes`), and its hit share beside the same
  policy's simulation;
- `match_us_per_page`: engine-thread CPU time of `match` per page (time.thread_time_ns) on the
  trace, and on a generated workload whose prompts all share one long head, for every policy
  (LRU in compiled books, the others in Python);
- `second_trace`: the sweep on a generated trace of another shape (multi-turn conversations over
  a few popular system prompts, plus one-off prompts), so that no policy is judged on one trace.

``match-latency``: how long `match` takes on a long prompt held in the host tier, hashing included.
Every timed call is a new request, released outside the timed region. `match_*` rows run with the
prefix memo off, so every call hashes the whole prompt; `match_next_turn_memo` runs with it on and a
prompt that extends the previous request's by 512 tokens (a conversation's next turn), so only the
new pages are hashed. Also times, in the same run, the straightforward design (blake2b per page in a
Python loop plus a dict walk) and hicache's pure-Python key chain, so the ratios are measured on the
same machine at the same time. Prints JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import command, commit, cpu_model

from hicache import HiCache, PagedBuffer, load_config
from hicache.core import native
from hicache.core.eviction import policy_names
from hicache.core.keys import _page_keys_python, chain_seed
from hicache.tools.trace.replay import ReplaySetup, Workload, per_page, replay, run_hicache, sweep
from hicache.tools.trace.report import plot
from hicache.tools.trace.workload import TraceRequest, read_trace

# -- sweep: eviction policies, a replay through hicache and match's cost on a trace ---------

FRACTIONS = (0.02, 0.05, 0.1, 0.25, 1.0)


def shared_head_requests(n: int = 400, head_blocks: int = 16, seed: int = 3) -> list[TraceRequest]:
    """`n` prompts that all start with the same `head_blocks` blocks, then 1-8 blocks of their
    own (a long system prompt in front of every request)."""
    rng = random.Random(seed)
    head = list(range(head_blocks))
    out, next_id = [], head_blocks
    for t in range(n):
        tail = list(range(next_id, next_id + rng.randint(1, 8)))
        next_id += len(tail)
        ids = head + tail
        out.append(TraceRequest(t, 512 * len(ids) - rng.randint(0, 511), 1, tuple(ids)))
    return out


def conversation_requests(n: int = 3000, seed: int = 11) -> list[TraceRequest]:
    """Multi-turn conversations over 200 system prompts of Zipf popularity, and one-off prompts:
    a shape unlike the Mooncake synthetic trace's (short turns, many conversations at once)."""
    rng = random.Random(seed)
    ids: dict[tuple[int, int], int] = {}
    systems = [[rng.randrange(10**9) for _ in range(rng.randint(2, 12))] for _ in range(200)]
    weights = [1 / (i + 1) for i in range(len(systems))]
    live: list[list[int]] = []
    out = []
    for t in range(n):
        roll = rng.random()
        if live and roll < 0.55:  # the next turn of a recent conversation
            conv = live[min(len(live) - 1, int(rng.expovariate(1 / 150)))]
            live.remove(conv)
        elif roll < 0.85:  # a new conversation
            conv = list(rng.choices(systems, weights)[0])
        else:  # a one-off prompt: a popular head, a long tail nobody sends again
            conv = list(rng.choices(systems, weights)[0])
            conv += [rng.randrange(10**9) for _ in range(rng.randint(4, 40))]
        conv = conv + [rng.randrange(10**9) for _ in range(rng.randint(1, 4))]
        if roll < 0.85:
            live.insert(0, conv)
            del live[2000:]
        hash_ids, parent = [], -1
        for content in conv:
            parent = ids.setdefault((parent, content), len(ids))
            hash_ids.append(parent)
        length = 512 * (len(conv) - 1) + rng.randint(1, 512)
        out.append(TraceRequest(t, length, 1, tuple(hash_ids)))
    return out


def match_cost(requests: list[TraceRequest], policy: str, fraction: float) -> dict[str, float]:
    """µs of engine-thread CPU per page of `match` over a replay of `requests`."""
    workload = Workload(requests, 128)
    setup = ReplaySetup(page_tokens=128, kv_bytes=64, policy=policy)
    run = run_hicache(workload, setup, max(1, round(fraction * workload.unique_pages)))
    if run.wrong_bytes:
        raise SystemExit(f"{run.wrong_bytes} wrong bytes loaded under {policy}")
    t = run.timings
    m, s = per_page(t.match_ns, t.match_pages), per_page(t.store_ns, t.store_pages)
    return {"match": m["total"], "match_median": m["median"], "store": s["total"]}


def sweep_trace(args: argparse.Namespace) -> None:
    """The policies' sweep, a replay through hicache and match's cost on one trace."""
    requests = read_trace(args.trace)
    workload = Workload(requests, 128)
    setup = ReplaySetup(page_tokens=128, kv_bytes=64, policy=args.policy)
    pages = max(1, round(args.host_size * workload.unique_pages))
    report = replay(workload, setup, pages, FRACTIONS, policies=None)
    report["sweep"] = sweep(workload, setup, FRACTIONS)
    report["trace"] = args.trace.name
    second = Workload(conversation_requests(), 128)
    result = {
        "commit": commit(),
        "machine": f"{args.machine}: {os.cpu_count()} CPUs ({platform.machine()}), {cpu_model()}",
        "command": command(),
        "trace": args.trace.name,
        "requests": report["requests"],
        "unique_pages": report["unique_pages"],
        "page_tokens": report["page_tokens"],
        "default_policy": report["default_policy"],
        "sweep": report["sweep"],
        "replay": {
            k: report[k]
            for k in (
                "policy",
                "host_pages",
                "host_fraction",
                "hit_share",
                "policy_sim_share",
                "lru_share",
                "belady_share",
                "wrong_bytes",
                "match_us_per_page",
                "store_us_per_page",
            )
        },
        "match_us_per_page": {
            "trace": {p: match_cost(requests, p, args.host_size) for p in policy_names()},
            "shared_head": {p: match_cost(shared_head_requests(), p, 0.5) for p in policy_names()},
        },
        "second_trace": {
            "shape": conversation_requests.__doc__.split("\n")[0],
            "unique_pages": second.unique_pages,
            "sweep": sweep(second, setup, FRACTIONS),
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"trace_{args.machine}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    plot(report, args.out / f"trace_{args.machine}.png", f"{args.trace.name}: prefix hit share")
    print(json.dumps({k: result[k] for k in ("replay", "match_us_per_page")}, indent=2))
    print(f"wrote {path}")


# -- match-latency --------------------------------------------------------------------------


def _median_us(fn, runs: int, after=None) -> tuple[float, float]:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
        if after is not None:
            after()
    times.sort()
    return statistics.median(times), times[int(0.9 * (len(times) - 1))]


def match_latency(args: argparse.Namespace) -> None:
    """How long `match` takes on a long prompt held in the host tier, hashing included."""
    P, n_pages = args.page_tokens, args.tokens // args.page_tokens
    page_bytes = 64  # match never touches page bytes; keep the pool small
    cfg = load_config(
        {
            "layout": {
                "model": "bench",
                "kv_dtype": "bfloat16",
                "page_tokens": P,
                "page_bytes": page_bytes,
            },
            "tiers": [{"type": "host", "size": (n_pages + 8) * page_bytes}],
            "policy": {"prefix_memo": 0},
        },
        env={},
    )
    pool = torch.zeros(n_pages + 8, page_bytes, dtype=torch.uint8)
    cache = HiCache(cfg, PagedBuffer.page_first(pool))
    cache.wait_ready()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 150_000, size=args.tokens + 1, dtype=np.int32)
    cache.store("warm", tokens, list(range(n_pages)))
    cache.release("warm")
    as_list = tokens.tolist()

    def one(toks) -> None:
        m = cache.match("timed", toks)
        if m.load_pages != n_pages:
            raise SystemExit(f"expected a full hit of {n_pages} pages, got {m.load_pages}")

    def release() -> None:  # outside the timed region: the next call is a new request again
        cache.release("timed")

    memo_cfg = cfg.model_copy(update={"policy": cfg.policy.model_copy(update={"prefix_memo": 256})})
    memo_cache = HiCache(memo_cfg, PagedBuffer.page_first(pool))
    memo_cache.wait_ready()
    half = args.tokens // 2
    turn: list[np.ndarray] = []

    def new_conversation() -> None:  # a fresh random half-length prompt, stored (not timed)
        first = rng.integers(0, 150_000, size=half + 1, dtype=np.int32)
        memo_cache.store("first", first, list(range(half // P)))
        memo_cache.release("first")
        turn[:] = [first]

    def next_turn() -> None:  # the previous prompt and 512 new tokens, stored
        grown = np.concatenate([turn[0], rng.integers(0, 150_000, 512, dtype=np.int32)])
        m = memo_cache.match("turn", grown)
        if m.load_pages != len(turn[0]) // P:
            raise SystemExit(f"expected the previous turn's pages to hit, got {m.load_pages}")
        turn[0] = grown

    def end_turn() -> None:  # not timed: store the turn, release, maybe start over
        memo_cache.store("turn", turn[0], list(range(len(turn[0]) // P)))
        memo_cache.release("turn")
        if len(turn[0]) + 512 > args.tokens:
            new_conversation()

    new_conversation()

    seed = chain_seed(cache.fingerprint)
    pages = tokens[: n_pages * P].reshape(n_pages, P)
    index = dict.fromkeys(_page_keys_python(seed, pages), 0)

    def straightforward() -> None:
        prev, data = seed, tokens.tobytes()
        for i in range(n_pages):
            prev = hashlib.blake2b(
                prev + data[i * P * 4 : (i + 1) * P * 4], digest_size=16
            ).digest()
            if prev not in index:
                index.get(prev)

    rows = {}
    for name, fn, after in (
        ("match_int32_array", lambda: one(tokens), release),
        ("match_python_list", lambda: one(as_list), release),
        ("release", lambda: cache.release("timed"), lambda: one(tokens)),
        ("match_next_turn_memo", next_turn, end_turn),
        ("hash_only_native", lambda: native.chain_keys(seed, pages), None),
        ("hash_only_python", lambda: _page_keys_python(seed, pages), None),
        ("straightforward_blake2b_loop", straightforward, None),
    ):
        fn()
        if after is not None:
            after()
        med, p90 = _median_us(fn, args.runs, after)
        rows[name] = {
            "median_us": round(med, 1),
            "p90_us": round(p90, 1),
            "us_per_page": round(med / n_pages, 3),
        }
    text = json.dumps(
        {
            "bench": "match_latency",
            "commit": commit(),
            "command": command(),
            "machine": f"{platform.machine()} {platform.processor() or ''} "
            f"({torch.get_num_threads()} threads), CPU only",
            "tokens": args.tokens,
            "page_tokens": P,
            "pages": n_pages,
            "runs": args.runs,
            "native_hash": native.available(),
            "target_us": 500,
            "results": rows,
            "ratio_straightforward_over_match": round(
                rows["straightforward_blake2b_loop"]["median_us"]
                / rows["match_int32_array"]["median_us"],
                2,
            ),
        },
        indent=2,
    )
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="run", required=True)
    sw = sub.add_parser("sweep", help="policy sweep, replay and match cost on a trace")
    sw.add_argument("trace", type=Path)
    sw.add_argument("--machine", default="cpu", help="label of this machine in the file name")
    sw.add_argument("--policy", default="prefix", help="the policy replayed through hicache")
    sw.add_argument("--host-size", type=float, default=0.05, help="fraction of distinct pages")
    sw.add_argument("--out", type=Path, default=Path("bench/results"))
    sw.set_defaults(func=sweep_trace)
    ml = sub.add_parser("match-latency", help="match of one long prompt held in the host tier")
    ml.add_argument("--tokens", type=int, default=131072)
    ml.add_argument("--page-tokens", type=int, default=128)
    ml.add_argument("--runs", type=int, default=200)
    ml.add_argument("--out")
    ml.set_defaults(func=match_latency)
    args = ap.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
