"""Which hicache functions and modules one request runs on the engine thread, by a profiler.

    python scripts/request_path.py [--show]

Uses only the public API (`from hicache import ...`), so the same script measures any layout.
A cache with the host tier and a disk store tier (`write: behind`) serves, after two warm-up
requests (first calls build and load things once):

- ``miss+store+write-behind``: `match` of a new prompt (a miss; its look-ahead to the disk
  tier finds nothing), `store` of its pages, then `poll` until the write-behind's put has
  returned and been applied;
- ``host hit``: `match` of the same prompt again, `load`, `release`;
- ``lower-tier hit``: the host tier is filled with other prompts so the first is evicted, then
  `match` (the disk tier's fetch promotes the pages into the host tier; asked again after each
  `poll` until the answer is not pending), `load`, `release`.

Counted: distinct Python functions (``file:line name``) whose file lies in the `hicache`
package, called on the engine thread between the first and last call of the scenario
(`sys.setprofile`: the worker threads are not followed). Prints one line per scenario; with
`--show`, the functions too.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import hicache  # noqa: E402
from hicache import HiCache, PagedBuffer, load_config  # noqa: E402

PAGE_TOKENS, PAGE_BYTES, PAGES = 16, 4096, 8
PKG = str(Path(hicache.__file__).resolve().parent)
_paused = [False]  # set while the script itself asks whether the tiers settled


def traced(run: Callable[[], None]) -> set[tuple[str, int, str]]:
    """The hicache functions `run` calls on this thread: (module file, first line, name)."""
    seen: set[tuple[str, int, str]] = set()

    def hook(frame, event, arg):
        if event == "call" and not _paused[0]:
            code = frame.f_code
            if code.co_filename.startswith(PKG):
                seen.add((code.co_filename[len(PKG) + 1 :], code.co_firstlineno, code.co_name))

    sys.setprofile(hook)
    try:
        run()
    finally:
        sys.setprofile(None)
    return seen


def settle(cache: HiCache) -> None:
    """Poll until no store tier has work queued or running."""
    deadline = time.monotonic() + 60
    while True:
        _paused[0] = True  # `tiers_idle` is a tool's question, not the engine's path
        idle = cache.tiers_idle
        _paused[0] = False
        if idle:
            break
        if time.monotonic() > deadline:
            raise RuntimeError("the store tier did not settle in 60 s")
        cache.poll()
        time.sleep(0.001)
    cache.poll()


def answer(cache: HiCache, rid: str, tokens: np.ndarray) -> hicache.Match:
    """`match`, asked again after a `poll` while the answer is pending (an engine's loop)."""
    m = cache.match(rid, tokens)
    deadline = time.monotonic() + 60
    while m.pending:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{rid}: pending for 60 s")
        time.sleep(0.001)
        cache.poll()
        m = cache.match(rid, tokens)
    return m


def serve(cache: HiCache, rid: str, tokens: np.ndarray, blocks: list[int]) -> None:
    """An engine's request: match, load, store, release."""
    m = answer(cache, rid, tokens)
    cache.load(m, blocks[m.first_page :])
    cache.store(rid, tokens, blocks)
    cache.release(rid)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--show", action="store_true", help="list the functions too")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 50_000, PAGES * PAGE_TOKENS + 1).astype(np.int32) for _ in range(6)]
    blocks = list(range(PAGES + 1))
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(
            {
                "layout": {
                    "model": "request-path",
                    "kv_dtype": "bfloat16",
                    "page_tokens": PAGE_TOKENS,
                    "page_bytes": PAGE_BYTES,
                },
                "tiers": [
                    {"type": "host", "size": 2 * PAGES * PAGE_BYTES},
                    {"type": "disk", "path": f"{tmp}/disk", "size": 64 * PAGES * PAGE_BYTES},
                ],
                "policy": {"fetch_max_wait_ms": 60000},
            },
            env={},
        )
        gpu = torch.zeros(PAGES + 1, PAGE_BYTES, dtype=torch.uint8)
        cache = HiCache(cfg, PagedBuffer.page_first(gpu))
        try:
            if not cache.wait_ready(60):
                raise RuntimeError("hicache was not ready in 60 s")
            for i in (4, 5):  # warm-up: a miss with its store, and a host hit
                for _ in range(2):
                    serve(cache, f"warm{i}", prompts[i], blocks)
                    settle(cache)
            target = prompts[0]

            def miss_store_write_behind() -> None:
                m = answer(cache, "a", target)
                if m.hit_tokens:
                    raise RuntimeError(f"not a miss: {m}")
                cache.store("a", target, blocks)
                cache.release("a")
                settle(cache)

            def host_hit() -> None:
                m = cache.match("b", target)
                if m.pending or m.tier_tokens or not m.hit_tokens:
                    raise RuntimeError(f"not a host hit: {m}")
                cache.load(m, blocks[m.first_page :])
                cache.release("b")
                cache.poll()

            scenarios: dict[str, set] = {}
            scenarios["miss+store+write-behind"] = traced(miss_store_write_behind)
            scenarios["host hit"] = traced(host_hit)
            for i in (1, 2, 3):  # the host tier holds two prompts: the first is evicted
                serve(cache, f"fill{i}", prompts[i], blocks)
                settle(cache)

            def lower_tier_hit() -> None:
                m = answer(cache, "c", target)
                if not dict(m.tier_tokens).get("disk"):
                    raise RuntimeError(f"not a disk hit: {m}")
                cache.load(m, blocks[m.first_page :])
                cache.release("c")
                cache.poll()

            scenarios["lower-tier hit+promotion"] = traced(lower_tier_hit)
        finally:
            cache.close()
    for name, seen in scenarios.items():
        modules = sorted({f for f, _, _ in seen})
        print(f"{name}: {len(seen)} functions in {len(modules)} modules: {' '.join(modules)}")
        if args.show:
            for f, line, fn in sorted(seen):
                print(f"    {f}:{line} {fn}")


if __name__ == "__main__":
    main()
