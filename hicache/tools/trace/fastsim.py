"""One simulated configuration (a policy at a capacity) over a whole trace, fast.

`simulate` runs the compiled simulation (``hicache/tools/trace/tiersim.c``) where it can be built,
and `PolicySim` (or the offline reference) otherwise, or where ``HICACHE_NO_NATIVE=1``. Both
give the same numbers: the C file restates `PolicySim`'s placement rules and the policies of
`hicache.core.eviction` (LRU, ARC, S3-FIFO; ``prefix`` is ARC when every page weighs the same, as in
a trace) and `FarthestNextUse` with their tie-breaks, and tests compare them on every policy.
A policy the C file does not know runs in Python.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

import numpy as np

from hicache.core import native
from hicache.tools.trace.chainsim import ChainSim, Objects, StoreSim
from hicache.tools.trace.simulate import FarthestNextUse, PolicySim, SimResult
from hicache.tools.trace.workload import Workload

OFFLINE = "offline"
"""The name `simulate` takes for the offline reference (farthest next use)."""

_CODES = {"lru": 0, "arc": 1, "prefix": 1, "s3fifo": 2, OFFLINE: 3}


_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "hicache_tiersim": (_INT, [_INT, _I64, _I64, _I64, _I64, _I64, _P, _P, _P, _I64, _P, _P, _P]),
    "hicache_next_uses": (None, [_I64, _P, _P, _I64, _P, _I64, _P]),
    "hicache_chainsim": (
        _INT,
        [_I64, _I64, _I64, _INT, _P, _I64, _P, _P, _P, _I64, _P, _P, _P, _P, _P],
    ),
}


@cache
def _build(source: str) -> ctypes.CDLL | None:
    """The compiled simulation `source` (a C file beside this module, built by
    `hicache.core.native.build`) with its functions' signatures declared; its calls drop the
    GIL. None where it cannot be built."""
    lib = native.build((source,), release_gil=True, directory=Path(__file__).parent)
    if lib is None:
        return None
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.restype, fn.argtypes = restype, argtypes
    return lib


def _library() -> ctypes.CDLL | None:
    return _build("tiersim.c")


def _chain_library() -> ctypes.CDLL | None:
    return _build("chainsim.c")


def compiled() -> bool:
    """Whether `simulate` runs compiled (else every configuration runs in Python)."""
    return _library() is not None


def small_fifo(capacity: int) -> int:
    """S3-FIFO's small queue for `capacity` keys, as `hicache.core.eviction` sizes it."""
    return max(1, round(0.1 * capacity))


def simulate(
    workload: Workload,
    policy: str,
    capacity: int,
    min_recompute_tokens: int = 1,
    python: bool = False,
) -> SimResult:
    """`policy` (a registered name, or `OFFLINE`) at `capacity` pages over `workload`, with
    `PolicySim`'s rules. `python`: take the Python path even where the C one is built."""
    lib = None if python else _library()
    code = _CODES.get(policy)
    if lib is None or code is None:
        if policy == OFFLINE:
            return workload.offline(capacity, min_recompute_tokens)
        sim = PolicySim(capacity, workload.page_tokens, min_recompute_tokens, policy)
        return workload.simulate(sim)
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0 pages, got {capacity}")
    dense, n_ids = workload.dense
    next_use = _next_uses(lib, workload) if code == _CODES[OFFLINE] else None
    out = np.zeros(4, np.int64)
    rc = lib.hicache_tiersim(
        code,
        capacity,
        small_fifo(capacity),
        workload.page_tokens,
        min_recompute_tokens,
        len(workload.requests),
        workload.starts.ctypes.data,
        dense.ctypes.data,
        workload.tokens.ctypes.data,
        n_ids,
        None if next_use is None else next_use.ctypes.data,
        None,
        out.ctypes.data,
    )
    if rc != 0:
        raise MemoryError("the compiled trace simulation ran out of memory")
    hit, limited, evicted, dropped = (int(v) for v in out)
    return SimResult(workload.prompt_tokens, hit, limited, evicted, dropped)


def _next_uses(lib: ctypes.CDLL, workload: Workload) -> np.ndarray:
    """For every page visit, the index of the next request holding that page (NEVER if none)."""
    cached = getattr(workload, "_next_use_array", None)
    if cached is not None:
        return cached
    dense, n_ids = workload.dense
    out = np.empty(len(dense), np.int64)
    scratch = np.empty(max(1, n_ids), np.int64)
    lib.hicache_next_uses(
        len(workload.requests),
        workload.starts.ctypes.data,
        dense.ctypes.data,
        FarthestNextUse.NEVER,
        scratch.ctypes.data,
        n_ids,
        out.ctypes.data,
    )
    workload._next_use_array = out  # type: ignore[attr-defined]
    return out


@dataclass
class ChainRun:
    """What the tier chain served over a trace, per request (T = 1 + store tiers, the host
    first): `hit` pages, `tier_pages` [n, T] pages served by each tier, `reads` [n, T - 1]
    pages read from each store tier, `written` [n, T] pages copied into the host / put to each
    store tier; and the totals."""

    hit: np.ndarray
    tier_pages: np.ndarray
    reads: np.ndarray
    written: np.ndarray
    host_evicted: int
    dropped: int
    fetches: list[int]


def run_chain(
    workload: Workload,
    host_pages: int,
    stores: list[StoreSim],
    policy: str = "lru",
    min_recompute_tokens: int = 1,
    python: bool = False,
    progress: Callable[[int], None] | None = None,
) -> ChainRun:
    """`ChainSim` over `workload`: compiled (``chainsim.c``) for an LRU host tier where
    it can be built, else in Python. `stores` are templates: they are not changed."""
    n, S = len(workload.requests), len(stores)
    hit = np.zeros(n, np.int32)
    tier_pages = np.zeros((n, S + 1), np.int64)
    reads = np.zeros((n, S), np.int64)
    written = np.zeros((n, S + 1), np.int64)
    lib = None if python or policy != "lru" else _chain_library()
    if lib is not None:
        dense, n_ids = workload.dense
        spec = np.array(
            [
                [s.capacity, s.group_pages, s.write == "behind", s.worth, s.overhead, s.page_cost]
                for s in stores
            ]
            or [[0] * 6],
            np.int64,
        )
        out = np.zeros(2 + S, np.int64)
        rc = lib.hicache_chainsim(
            host_pages, workload.page_tokens, min_recompute_tokens, S, spec.ctypes.data, n,
            workload.starts.ctypes.data, dense.ctypes.data, workload.tokens.ctypes.data, n_ids,
            hit.ctypes.data, tier_pages.ctypes.data, reads.ctypes.data, written.ctypes.data,
            out.ctypes.data,
        )  # fmt: skip
        if rc != 0:
            raise MemoryError("the compiled chain simulation ran out of memory")
        if progress is not None:
            progress(n)
        return ChainRun(hit, tier_pages, reads, written, int(out[0]), int(out[1]), out[2:].tolist())
    mine = [
        replace(s, objects=Objects(), known=set(), skipped=0, fetches=0, read_pages=0,
                written_pages=0)
        for s in stores
    ]  # fmt: skip
    sim = ChainSim(host_pages, workload.page_tokens, mine, policy, min_recompute_tokens)
    pages, tokens = workload.pages, workload.tokens.tolist()
    for i in range(n):
        before = [sim.host.written, *(s.written_pages for s in mine)]
        served = sim.request(pages[i], tokens[i])
        hit[i] = served.hit_pages
        tier_pages[i] = served.tier_pages
        reads[i] = served.read_pages
        written[i] = [
            sim.host.written - before[0],
            *(s.written_pages - b for s, b in zip(mine, before[1:])),
        ]
        if progress is not None and i % 256 == 255:
            progress(256)
    if progress is not None:
        progress(n % 256)
    return ChainRun(
        hit, tier_pages, reads, written, sim.host.evicted, sim.dropped, [s.fetches for s in mine]
    )
