"""The slot books' engine-thread operations, timed one by one (µs a call).

    PYTHONPATH=<checkout> python bench/slot_ops.py

Uses only `SlotPool`'s public methods and the helpers of `hicache.core.native`, so the same
script times any two checkouts (run it once with each on the PYTHONPATH, taking turns).
Rows, for compiled books and for the Python ones (``compiled=False``):

- ``prefix64`` / ``split64``: 64 keys the pool holds;
- ``lease+release64`` / ``lease+release4``: pin 64 (4) published slots and release the lease;
- ``store64``: reserve 64 slots, publish 64 new keys, release (the pool full: each reserve
  evicts 64 slots);
- ``slot_of``: one key;

and for the compiled helpers: ``chain_keys8`` (8 pages of 16 tokens), ``bad_id64``,
``align_slots64``, ``common_tokens1024``, ``walk64`` (64 pages, all held). Each figure is the
best of 5 repeats; keys are 16-byte digests made before the timing.
"""

from __future__ import annotations

import hashlib
import timeit
from array import array
from collections.abc import Callable

import numpy as np

from hicache.core import native
from hicache.core.slots import SlotPool

PAGES = 64


def key(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


def best(fn: Callable[[], object], number: int) -> float:
    """µs a call: the best of 5 repeats of `number` calls."""
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def pool_ops(compiled: bool) -> dict[str, float]:
    pool = SlotPool(4096, compiled=compiled)
    held = [key(i) for i in range(PAGES)]
    lease = pool.reserve(PAGES)
    pool.publish(lease.slots, held)
    lease.release()
    slots = pool.prefix(held)
    keep = pool.lease(slots)  # never evicted by the stores below
    stores = 4000
    batches = iter(
        [[key(b * PAGES + i) for i in range(PAGES)] for b in range(1, 1 + 100 + 5 * stores)]
    )

    def store() -> None:
        got = pool.reserve(PAGES)
        pool.publish(got.slots, next(batches))
        got.release()

    for _ in range(100):  # fill the pool: from here on every reserve evicts
        store()
    rows = {
        "prefix64": best(lambda: pool.prefix(held), 20000),
        "split64": best(lambda: pool.split(held), 20000),
        "lease+release64": best(lambda: pool.lease(slots).release(), 20000),
        "lease+release4": best(lambda: pool.lease(slots[:4]).release(), 20000),
        "store64": best(store, stores),
        "slot_of": best(lambda: pool.slot_of(held[3]), 20000),
    }
    keep.release()
    return rows


def helper_ops() -> dict[str, float]:
    seed = bytes(16)
    pages = np.arange(8 * 16, dtype=np.int32).reshape(8, 16)
    ids = array("i", range(PAGES))
    blocks, fresh = np.arange(PAGES, dtype=np.int32), list(range(PAGES))
    a = np.arange(1024, dtype=np.int32)
    b = a.copy()
    pool = SlotPool(4096)
    walked = np.arange(PAGES * 16, dtype=np.int32).reshape(PAGES, 16)
    raw = native.chain_keys(seed, walked)
    if raw is None:
        raise SystemExit("the compiled helpers are not available here")
    lease = pool.reserve(PAGES)
    pool.publish(lease.slots, [raw[16 * i : 16 * i + 16] for i in range(PAGES)])
    lease.release()
    return {
        "chain_keys8": best(lambda: native.chain_keys(seed, pages), 20000),
        "bad_id64": best(lambda: native.bad_id(ids, 1000), 20000),
        "align_slots64": best(lambda: native.align_slots(blocks, fresh), 20000),
        "common_tokens1024": best(lambda: native.common_tokens(a, b), 20000),
        "walk64": best(lambda: pool.walk(seed, walked), 20000),
    }


def main() -> None:
    for kind, rows in (
        ("compiled", pool_ops(True)),
        ("python", pool_ops(False)),
        ("helpers", helper_ops()),
    ):
        for name, us in rows.items():
            print(f"{kind:9s} {name:20s} {us:8.2f}")


if __name__ == "__main__":
    main()
