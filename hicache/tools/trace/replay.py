"""Replay a trace through hicache and the reference caches; sweep the host capacity.

`replay` runs one capacity through a real `HiCache` (via `ReplayEngine`, its host tier evicting
by the chosen policy) and through the simulations of that policy, of LRU, of the offline
reference and of the infinite cache; `sweep` runs the simulations of several policies at several
capacities. Shares are hit tokens over prompt tokens.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Any

from hicache import HiCacheConfig, Layout, load_config
from hicache.backends.host import HostTierConfig
from hicache.config import MetricsConfig
from hicache.core.eviction import DEFAULT_POLICY, make_policy, policy_names
from hicache.tools.trace.engine import ReplayEngine, Timings
from hicache.tools.trace.fastsim import OFFLINE, simulate
from hicache.tools.trace.simulate import OracleSim, block_ceiling
from hicache.tools.trace.workload import BLOCK_TOKENS, DEFAULT_FRACTIONS, Workload, prompt_tokens

__all__ = ["DEFAULT_FRACTIONS", "ReplaySetup", "Workload", "replay", "run_hicache", "sweep"]


@dataclass(frozen=True)
class ReplaySetup:
    """What the replayed cache looks like: its layout, tiers below host, and policy."""

    page_tokens: int = 128
    kv_bytes: int = 128
    """Synthetic bytes per page (a multiple of 16): small, so checking every load is cheap."""
    base: HiCacheConfig | None = None
    """Tiers and policy to replay (the host tier's size is replaced); None: a host tier alone."""
    block_tokens: int = BLOCK_TOKENS
    policy: str | None = None
    """The host tier's eviction policy; None: the base config's, else the default."""
    settle: bool = False
    """Wait for the store tiers' writes after each request (`ReplayEngine`'s `settle`)."""

    def __post_init__(self) -> None:
        make_policy(self.eviction, 0)  # a ValueError naming the known ones
        if self.page_tokens <= 0:
            raise ValueError(f"page_tokens must be positive, got {self.page_tokens}")
        if self.kv_bytes <= 0 or self.kv_bytes % 16:
            raise ValueError(f"kv_bytes must be a positive multiple of 16, got {self.kv_bytes}")

    @property
    def layout(self) -> Layout:
        return Layout(
            model="trace-replay",
            kv_dtype="synthetic-uint8",
            page_tokens=self.page_tokens,
            page_bytes=self.kv_bytes,
        )

    @property
    def eviction(self) -> str:
        """The policy the replayed host tier evicts by."""
        if self.policy is not None:
            return self.policy
        host = self.base.tier("host") if self.base else None
        return host.policy if isinstance(host, HostTierConfig) else DEFAULT_POLICY

    @property
    def min_recompute_tokens(self) -> int:
        return self.base.policy.min_recompute_tokens if self.base else 1

    def config(self, host_pages: int) -> HiCacheConfig:
        """The replay's configuration with a host tier of `host_pages` synthetic pages."""
        if host_pages <= 0:
            raise ValueError(f"the host tier needs at least one page, got {host_pages}")
        size = host_pages * self.kv_bytes
        if self.base is None:
            host = {"type": "host", "size": size, "policy": self.eviction}
            return load_config({"tiers": [host]}, env={})
        tiers = [
            t.model_copy(update={"size": size, "policy": self.eviction})
            if isinstance(t, HostTierConfig)
            else t
            for t in self.base.tiers
        ]
        # the base's tiers and policy (and the file they came from), no layout or metrics
        return self.base.model_copy(
            update={"tiers": tuple(tiers), "layout": None, "metrics": MetricsConfig()}
        )


@dataclass
class HiCacheRun:
    """What hicache served over a trace at one host capacity."""

    host_pages: int
    prompt_tokens: int = 0
    hit_tokens: dict[str, int] = field(default_factory=dict)
    """Tokens skipped, per tier they came from ("host", then each store tier by name)."""
    limited_tokens: int = 0
    wrong_bytes: int = 0
    timeouts: int = 0
    stats: dict[str, int] = field(default_factory=dict)
    timings: Timings = field(default_factory=Timings)
    seconds: float = 0.0

    @property
    def share(self) -> float:
        return sum(self.hit_tokens.values()) / self.prompt_tokens if self.prompt_tokens else 0.0


def run_hicache(
    workload: Workload,
    setup: ReplaySetup,
    host_pages: int,
    progress: Callable[[int], None] | None = None,
) -> HiCacheRun:
    """Replay every request of `workload` through a fresh HiCache with `host_pages` slots."""
    engine = ReplayEngine(
        setup.config(host_pages), setup.layout, workload.max_blocks, settle=setup.settle
    )
    run = HiCacheRun(host_pages=host_pages, hit_tokens={"host": 0})
    start = time.perf_counter()
    try:
        for req in workload.requests:
            out = engine.run(prompt_tokens(req, setup.block_tokens))
            run.prompt_tokens += out.prompt_tokens
            tiers = out.match.tier_tokens if out.hit_tokens else ()
            for name, tokens in tiers:
                run.hit_tokens[name] = run.hit_tokens.get(name, 0) + tokens
            run.hit_tokens["host"] += out.hit_tokens - sum(tokens for _, tokens in tiers)
            run.limited_tokens += out.match.limited_tokens
            if progress is not None:
                progress(1)
        run.stats = engine.cache.stats()
    finally:
        engine.close()
    run.seconds = time.perf_counter() - start
    run.wrong_bytes = engine.wrong_bytes
    run.timeouts = engine.timeouts
    run.timings = engine.timings
    return run


def per_page(ns: Sequence[int], pages: Sequence[int]) -> dict[str, float]:
    """µs per page over calls: the total (all time / all pages) and the median of calls."""
    total_pages = sum(pages)
    ratios = [n / p / 1000 for n, p in zip(ns, pages) if p]
    return {
        "total": sum(ns) / total_pages / 1000 if total_pages else 0.0,
        "median": statistics.median(ratios) if ratios else 0.0,
        "calls": len(ns),
        "pages": total_pages,
    }


def sweep(
    workload: Workload,
    setup: ReplaySetup,
    fractions: Sequence[float] = DEFAULT_FRACTIONS,
    policies: Sequence[str] | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[dict[str, Any]]:
    """Rows {policy, host_fraction, capacity_pages, hit_share, lru_share, belady_share}: each
    policy's simulated hit share at each capacity (fractions of the distinct pages), beside
    LRU's and the offline reference's at that capacity. `policies`: all registered ones."""
    unique, floor = workload.unique_pages, setup.min_recompute_tokens
    names = list(policies) if policies is not None else policy_names()
    runs = [
        (max(1, round(frac * unique)), name)
        for frac in fractions
        for name in dict.fromkeys(["lru", *names, OFFLINE])
    ]
    shares: dict[tuple[int, str], float] = {}
    # the compiled simulations drop the GIL: one per core at a time
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        jobs = {
            pool.submit(simulate, workload, name, pages, floor): (pages, name)
            for pages, name in runs
        }
        for job in as_completed(jobs):
            shares[jobs[job]] = job.result().share
            if progress is not None:
                progress(1)
    rows = []
    for frac in fractions:
        pages = max(1, round(frac * unique))
        for name in names:
            rows.append(
                {
                    "policy": name,
                    "host_fraction": frac,
                    "host_pages": pages,
                    "capacity_pages": pages,
                    "hit_share": shares[pages, name],
                    "lru_share": shares[pages, "lru"],
                    "belady_share": shares[pages, OFFLINE],
                }
            )
    return rows


def sweep_steps(fractions: Sequence[float], policies: Sequence[str]) -> int:
    """How many simulations `sweep` runs (for a progress bar)."""
    return len(fractions) * len(dict.fromkeys(["lru", *policies, OFFLINE]))


def simulated(
    workload: Workload,
    setup: ReplaySetup,
    fractions: Sequence[float] = DEFAULT_FRACTIONS,
    policies: Sequence[str] | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """The sweep without the real cache (`policies`: all registered ones): the trace's figures,
    the infinite cache, and the `sweep` rows."""
    P, floor = setup.page_tokens, setup.min_recompute_tokens
    return {
        "requests": len(workload.requests),
        "prompt_tokens": workload.prompt_tokens,
        "page_tokens": P,
        "page_visits": workload.visits,
        "min_recompute_tokens": floor,
        "unique_pages": workload.unique_pages,
        "default_policy": DEFAULT_POLICY,
        "oracle_share": workload.simulate(OracleSim(P, floor)).share,
        "block_ceiling": block_ceiling(workload.requests, setup.block_tokens),
        "sweep": sweep(workload, setup, fractions, policies, progress),
    }


def replay(
    workload: Workload,
    setup: ReplaySetup,
    host_pages: int,
    fractions: Sequence[float] = DEFAULT_FRACTIONS,
    policies: Sequence[str] | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """The whole report as a JSON-ready dict (docs/eviction.md lists the fields). `policies`:
    those the sweep runs (None: only the host tier's)."""
    P, floor = setup.page_tokens, setup.min_recompute_tokens
    run = run_hicache(workload, setup, host_pages, progress)
    lru = simulate(workload, "lru", host_pages, floor)
    same = simulate(workload, setup.eviction, host_pages, floor)
    belady = simulate(workload, OFFLINE, host_pages, floor)
    oracle = workload.simulate(OracleSim(P, floor))
    total = workload.prompt_tokens
    t = run.timings
    match, store, load = (
        per_page(t.match_ns, t.match_pages),
        per_page(t.store_ns, t.store_pages),
        per_page(t.load_ns, t.load_pages),
    )
    unique = workload.unique_pages
    return {
        "requests": len(workload.requests),
        "prompt_tokens": total,
        "page_tokens": P,
        "kv_bytes": setup.kv_bytes,
        "min_recompute_tokens": floor,
        "unique_pages": unique,
        "host_pages": host_pages,
        "host_fraction": host_pages / unique if unique else 0.0,
        "hit_share": run.share,
        "hit_share_by_tier": {k: v / total for k, v in run.hit_tokens.items()},
        "policy": setup.eviction,
        "policy_sim_share": same.share,
        "default_policy": DEFAULT_POLICY,
        "lru_share": lru.share,
        "belady_share": belady.share,
        "oracle_share": oracle.share,
        "block_ceiling": block_ceiling(workload.requests, setup.block_tokens),
        "limited_share": run.limited_tokens / total,
        "lru_limited_share": lru.limited_tokens / total,
        "oracle_limited_share": oracle.limited_tokens / total,
        "lru_evicted_pages": lru.evicted_pages,
        "wrong_bytes": run.wrong_bytes,
        "pending_timeouts": run.timeouts,
        "match_us_per_page": match["total"],
        "match_us_per_page_median": match["median"],
        "store_us_per_page": store["total"],
        "store_us_per_page_median": store["median"],
        "load_us_per_page": load["total"],
        "load_us_per_page_median": load["median"],
        "calls": {"match": match, "store": store, "load": load},
        "replay_seconds": run.seconds,
        "stats": run.stats,
        "sweep": sweep(
            workload,
            setup,
            fractions,
            [setup.eviction] if policies is None else policies,
            progress=progress,
        ),
    }
