"""The capacity planner: what each tier of a chain serves on a trace, the bytes it moves, and
the time to first token it buys.

`plan` runs a trace through `ChainSim` (the chain as hicache runs it) for a chain of tiers
(`TierPlan`: the host tier first, then store tiers in walk order), with pages of a model's
shape, and reports per tier its capacity in pages, the share of prompt tokens it served, and the
bytes read from it and written to it (in total and the peak over one second of trace time).

Each request's time to first token is estimated from the cost model's figures (`TtftModel`):
the pages a store tier sends are read at its read rate while the request waits (hicache's
`fetch_pending: wait`), then every hit page goes host -> GPU at the link's rate, overlapped
layer by layer with the prefill of the rest (one layer's load is not hidden); a miss prefills
the whole prompt. The prefill takes ``hicache.core.plan.PrefillSpeed``'s time, which grows with the
context. The defaults are the H200 figures of bench/results/ttft_h200.json (llama-8b, bf16).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hicache.backends.codec import PLANNED_DECODE_GBPS as DECODE_GBPS
from hicache.backends.codec import PLANNED_RATIO as CODEC_RATIO
from hicache.backends.disk.records import HEADER as DISK_RECORD_HEADER
from hicache.config import HiCacheConfig, tier_name
from hicache.core.eviction import DEFAULT_POLICY
from hicache.core.plan import PrefillSpeed
from hicache.tools.trace.chainsim import StoreSim
from hicache.tools.trace.fastsim import run_chain
from hicache.tools.trace.workload import Workload

MODELS: dict[str, tuple[int, int, int]] = {
    "llama-8b": (32, 8, 128),
    "llama-70b": (80, 8, 128),
    "qwen3-8b": (36, 8, 128),
    "qwen3-32b": (64, 8, 128),
}
"""Model shapes: (layers, KV heads, head dim). ``llama-8b`` is the replay's (refengine)."""

DTYPE_BYTES = 2
"""bf16 KV."""

STORE_TYPES = ("disk", "mooncake")
"""The store tiers the planner knows, and the order they are walked in by default."""


def bytes_per_token(model: str) -> int:
    """KV bytes of one token of `model` (K and V, every layer, bf16)."""
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; known: {', '.join(MODELS)}")
    layers, heads, dim = MODELS[model]
    return 2 * layers * heads * dim * DTYPE_BYTES


@dataclass(frozen=True)
class TtftModel:
    """The figures a TTFT estimate takes (defaults: H200, llama-8b, bf16, bench/results)."""

    prefill: PrefillSpeed = field(default_factory=lambda: PrefillSpeed(39_354.0, 2.02e-9))
    """Fitted through the recompute of 16,896 tokens (0.718 s) and the prefill of 2,048 new
    tokens after 32,768 (0.192 s), ttft_h200.json."""
    link_bytes_per_s: float = 55e9
    """Host -> GPU (ttft_h200.json's link_gbps)."""
    layers: int = 32

    def no_cache(self, tokens: np.ndarray) -> np.ndarray:
        t = tokens.astype(np.float64)
        p = self.prefill
        return t / p.tokens_per_s + p.context_s_per_token2 * t * t / 2

    def cached(
        self,
        tokens: np.ndarray,
        hit_tokens: np.ndarray,
        load_bytes: np.ndarray,
        fetch_s: np.ndarray,
    ) -> np.ndarray:
        """Seconds for prompts of `tokens` with `hit_tokens` cached, `load_bytes` to copy to
        the GPU, after `fetch_s` of store tier reads."""
        t, h = tokens.astype(np.float64), hit_tokens.astype(np.float64)
        p = self.prefill
        rest = (t - h) / p.tokens_per_s + p.context_s_per_token2 * (t * t - h * h) / 2
        load = load_bytes / self.link_bytes_per_s
        return np.where(h > 0, fetch_s + np.maximum(load, rest) + load / self.layers, rest)


@dataclass(frozen=True)
class TierPlan:
    """One tier of a planned chain: its type and name, size in bytes, and (store tiers) the
    settings that decide what it holds and how fast it reads."""

    type: str
    size: int
    name: str = ""
    policy: str = DEFAULT_POLICY
    """The host tier's eviction policy."""
    group_pages: int = 4
    write: str = "behind"
    read_gbps: float = 4.0
    codec: str = "none"
    """none | lossless (`hicache.backends.codec`)."""
    codec_ratio: float = CODEC_RATIO
    """With codec: lossless, raw bytes per stored byte."""
    decode_gbps: float = DECODE_GBPS
    """With codec: lossless, raw bytes per second that the tier's codec threads decode."""

    @property
    def label(self) -> str:
        return self.name or self.type

    @property
    def ratio(self) -> float:
        """Raw bytes per stored byte (1 without a codec)."""
        return self.codec_ratio if self.codec == "lossless" else 1.0

    @property
    def raw_read_gbps(self) -> float:
        """KV (raw bytes) it delivers per second: its read rate times the ratio, at most what
        the codec decodes (reading and decoding overlap across objects)."""
        if self.codec != "lossless":
            return self.read_gbps
        return min(self.read_gbps * self.codec_ratio, self.decode_gbps)

    def capacity_pages(self, page_bytes: int) -> int:
        """Pages it holds: host slots, or whole objects of `group_pages` pages (a disk record
        has a header of its own; an encoded object takes 1/ratio of its bytes)."""
        if self.type == "host":
            return self.size // page_bytes
        record = self.overhead + self.group_pages * math.ceil(page_bytes / self.ratio)
        return self.size // record * self.group_pages

    @property
    def overhead(self) -> int:
        """Bytes an object takes beside its pages: a disk record's header."""
        return DISK_RECORD_HEADER if self.type == "disk" else 0


def chain_from_config(config: HiCacheConfig) -> list[TierPlan]:
    """The tiers of a hicache configuration as the planner sees them (a Mooncake tier's size is
    its `global_segment_size`: what this instance adds to the store)."""
    out = []
    for tier in config.tiers:
        if tier.type == "host":
            out.append(TierPlan("host", tier.size, policy=tier.policy))  # type: ignore[attr-defined]
            continue
        size = getattr(tier, "size", None) or getattr(tier, "global_segment_size", 0)
        out.append(
            TierPlan(
                tier.type,
                int(size),
                tier_name(tier),
                group_pages=tier.group_pages,  # type: ignore[attr-defined]
                write=tier.write,  # type: ignore[attr-defined]
                read_gbps=tier.read_gbps or 4.0,  # type: ignore[attr-defined]
                codec=tier.codec,  # type: ignore[attr-defined]
            )
        )
    return out


def _peak(seconds: np.ndarray, pages: np.ndarray) -> int:
    """The most pages in one second of trace time (requests by their arrival second)."""
    if not len(pages):
        return 0
    _, first = np.unique(seconds, return_index=True)
    return int(np.add.reduceat(pages, first).max())


def plan(
    workload: Workload,
    tiers: Sequence[TierPlan],
    page_bytes: int,
    model: TtftModel | None = None,
    min_recompute_tokens: int = 1,
    verdict_prefill_tokens_per_s: float = 20_000.0,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """The planner's report for `tiers` (the host first) over `workload` (see the module doc).

    A store tier is fetched from only where the cost model finds a page faster to read than to
    compute at `verdict_prefill_tokens_per_s` (hicache's `policy.prefill_tokens_per_s`)."""
    model = model or TtftModel()
    if not tiers or tiers[0].type != "host" or any(t.type == "host" for t in tiers[1:]):
        raise ValueError("the chain needs one host tier, first")
    for t in tiers[1:]:
        if t.write not in ("behind", "off"):
            raise ValueError(f"tier {t.label}: write: {t.write} is not planned (behind or off)")
    P = workload.page_tokens
    host, below = tiers[0], list(tiers[1:])
    stores = [
        StoreSim(
            t.label,
            t.size,
            t.group_pages,
            t.write,
            worth=page_bytes * verdict_prefill_tokens_per_s < P * t.raw_read_gbps * 1e9,
            overhead=t.overhead,
            page_cost=math.ceil(page_bytes / t.ratio),
        )
        for t in below
    ]
    host_pages = host.capacity_pages(page_bytes)
    run = run_chain(
        workload, host_pages, stores, host.policy, min_recompute_tokens, progress=progress
    )
    seconds = np.fromiter((int(r.timestamp // 1000) for r in workload.requests), np.int64)
    hit = run.hit.astype(np.int64)
    rates = np.array([t.raw_read_gbps * 1e9 for t in below]).reshape(1, -1)
    fetch_s = (run.reads * page_bytes / rates).sum(axis=1) if below else np.zeros(len(hit))
    host_read = hit  # every hit page goes host -> GPU
    reads = np.column_stack([host_read, run.reads])
    prompt = workload.prompt_tokens
    ttft = model.cached(workload.tokens, hit * P, hit * page_bytes, fetch_s)
    no_cache = model.no_cache(workload.tokens)
    pct = (50, 90, 99)
    p_on, p_off = np.percentile(ttft, pct), np.percentile(no_cache, pct)
    return {
        "requests": len(hit),
        "prompt_tokens": prompt,
        "page_tokens": P,
        "page_bytes": page_bytes,
        "unique_pages": workload.unique_pages,
        "hit_share": float(hit.sum() * P / prompt) if prompt else 0.0,
        "tiers": [
            {
                "name": t.label,
                "type": t.type,
                "capacity_pages": t.capacity_pages(page_bytes),
                **({"codec": t.codec, "codec_ratio": t.ratio} if k else {}),
                "hit_share": int(run.tier_pages[:, k].sum()) * P / prompt if prompt else 0.0,
                "hit_tokens": int(run.tier_pages[:, k].sum()) * P,
                "read_bytes": int(reads[:, k].sum()) * page_bytes,
                "write_bytes": int(run.written[:, k].sum()) * page_bytes,
                "read_bytes_peak_per_s": _peak(seconds, reads[:, k]) * page_bytes,
                "write_bytes_peak_per_s": _peak(seconds, run.written[:, k]) * page_bytes,
                **({"fetches": run.fetches[k - 1]} if k else {"pages_evicted": run.host_evicted}),
            }
            for k, t in enumerate(tiers)
        ],
        "ttft_estimate_s": {
            "p50": float(p_on[0]),
            "p90": float(p_on[1]),
            "p99": float(p_on[2]),
            "no_cache_p50": float(p_off[0]),
            "no_cache_p90": float(p_off[1]),
            "no_cache_p99": float(p_off[2]),
        },
        "ttft_model": {
            "prefill_tokens_per_s": model.prefill.tokens_per_s,
            "prefill_context_s_per_token2": model.prefill.context_s_per_token2,
            "link_bytes_per_s": model.link_bytes_per_s,
            "layers": model.layers,
            "verdict_prefill_tokens_per_s": verdict_prefill_tokens_per_s,
        },
    }
