"""How long `match` takes on a long prompt held in the host tier, hashing included.

    python bench/match_latency.py [--tokens 131072] [--page-tokens 128] [--runs 200] [--out F]

Every timed call is a new request, released outside the timed region. `match_*` rows run with
the prefix memo off, so every call hashes the whole prompt; `match_next_turn_memo` runs with it on
and a prompt that extends the previous request's by 512 tokens (a conversation's next turn), so
only the new pages are hashed. Also times, in the same run, the straightforward design (blake2b
per page in a Python loop plus a dict walk) and hicache's pure-Python key chain, so the ratios
are measured on the same machine at the same time. Prints JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import statistics
import time

import numpy as np
import torch

from hicache import HiCache, PagedBuffer, load_config, native
from hicache.keys import _page_keys_python, chain_seed


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--page-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--out")
    args = ap.parse_args()

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


if __name__ == "__main__":
    main()
