"""The worker half: owns the HiCache and does what the scheduler half asked.

Each TP rank's worker process has one HiCache over that rank's KV tensors (its own shard: the
rank is in the layout's fingerprint). Per step, vLLM calls `start` before the forward (sync
loads must precede it) and `after` once the forward is enqueued; both run on the engine thread
and never wait for a store tier: a question whose fetch is still running is asked again on
the next step, and only then answered.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from hicache.cache import HiCache
from hicache.config import HiCacheConfig, Layout
from hicache.errors import HiCacheError
from hicache.integrations.vllm.meta import (
    Answer,
    Answers,
    HiCacheStats,
    Load,
    Lookup,
    StepMeta,
    Store,
)
from hicache.kernels import PagedBuffer
from hicache.request import Match

log = logging.getLogger("hicache.vllm")

#: The counters of `HiCache.stats` reported to vLLM's connector stats, as increases.
REPORTED = (
    "hit_tokens_host", "pages_loaded", "pages_stored", "pages_dropped", "pages_evicted",
)  # fmt: skip

READY_TIMEOUT_S = 10.0
"""How long vLLM's start waits for the host pools and the store tiers (see `register`)."""


def kv_pool(kv_caches: dict[str, torch.Tensor], num_blocks: int) -> tuple[PagedBuffer, str]:
    """vLLM's per-layer KV tensors (in the model's layer order) as one segmented pool, and a
    note of how a block's bytes lie in them (shape and stride order), which goes into the
    page keys: two attention backends may give blocks of one size in different byte orders.
    ``(2, num_blocks, ...)`` and ``(num_blocks, 2, ...)`` are K and V tensors (see
    `PagedBuffer.from_kv_tensors`); ``(num_blocks, ...)`` holds one latent per block (MLA)."""
    tensors = list(kv_caches.values())
    t = tensors[0]
    if t.dim() >= 3 and t.shape[0] == 2 and t.shape[1] == num_blocks:
        pool, block_dim = PagedBuffer.from_kv_tensors(tensors, kv_dim=0), 1
    elif t.dim() >= 3 and t.shape[0] == num_blocks and t.shape[1] == 2:
        pool, block_dim = PagedBuffer.from_kv_tensors(tensors, kv_dim=1), 0
    elif t.dim() >= 2 and t.shape[0] == num_blocks:
        pool, block_dim = PagedBuffer.layer_first(tensors), 0
    else:
        raise ValueError(
            f"hicache: a KV tensor of shape {tuple(t.shape)} has no block dimension of "
            f"{num_blocks} first or next to a K/V dimension of 2"
        )
    shape = ["N" if d == block_dim else str(n) for d, n in enumerate(t.shape)]
    order = sorted(range(t.dim()), key=lambda d: -t.stride(d))
    return pool, f"[{','.join(shape)}]@{order}".replace(" ", "")


class WorkerCache:
    """The connector's worker role over one HiCache (made when vLLM registers its KV tensors).

    Contract with the scheduler half: every `Lookup` is answered exactly once (in the step its
    match stops being pending), unless the request is forgotten first; a `Load` is made only as
    granted, else its blocks are reported through `load_errors` and vLLM recomputes them; the
    hicache request of an id is released after each load and store, and when it is forgotten.
    """

    def __init__(self, config: HiCacheConfig, layout: dict[str, Any]) -> None:
        self.config = config
        self._layout = layout
        self.layout: Layout | None = None
        self.cache: HiCache | None = None
        self._asking: dict[str, Lookup] = {}
        self._matched: dict[str, tuple[Match, Lookup]] = {}
        self._tokens: dict[str, list[int]] = {}
        self._answers: list[Answer] = []
        self._load_errors: set[int] = set()
        self._kinds: dict[str, str] = {}
        self._reported: dict[str, int] = {}

    def register(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        """Build the layout and the HiCache over vLLM's KV tensors (`num_blocks` blocks each),
        and wait (at most READY_TIMEOUT_S) until its pools are allocated and its tiers answer."""
        pool, note = kv_pool(kv_caches, num_blocks)
        fields = {**self._layout, "model": f"{self._layout['model']}|kv{note}"}
        self.layout = Layout(**fields, segments=pool.seg_bytes)
        log.info("hicache: %d segments a page, %s", len(pool.segments), self.layout.model)
        self.cache = HiCache(self.config, pool, layout=self.layout)
        # vLLM is still starting: let the first requests find the pools and the tiers ready
        if not self.cache.wait_ready(READY_TIMEOUT_S):
            log.warning("hicache: a store tier does not answer yet; lookups skip it until it does")
        self._kinds = {
            name: "p2p" if tier.shared else "disk" for name, tier in self.cache.store_tiers.items()
        }

    # -- one step -------------------------------------------------------------------------------

    def start(self, step: StepMeta) -> None:
        """Before the forward: forget, let unused answers go, load what was granted, and answer
        the questions whose matches are no longer pending."""
        cache = self._cache()
        cache.poll()
        for rid in step.forget:
            self._asking.pop(rid, None)
            self._matched.pop(rid, None)
            self._tokens.pop(rid, None)
            cache.release(rid)
        for rid in step.unused:
            if self._matched.pop(rid, None) is not None:
                cache.release(rid)
        for load in step.loads:
            self._load(load)
        for lookup in step.lookups:
            self._matched.pop(lookup.request_id, None)
            self._asking[lookup.request_id] = lookup
        for rid, lookup in list(self._asking.items()):
            m = self._match(lookup, len(lookup.tokens))
            if m is None or not m.pending:
                del self._asking[rid]
                self._answers.append(self._answer(lookup, m))

    def after(self, step: StepMeta) -> None:
        """After the forward is enqueued: store the pages this step completed."""
        for store in step.stores:
            self._store(store)
        self._cache().poll()

    def answers(self) -> Answers | None:
        """This step's answers, for the scheduler half (None when there are none)."""
        if not self._answers:
            return None
        out, self._answers = Answers({self._layout["tp_rank"]: self._answers}), []
        return out

    def load_errors(self) -> set[int]:
        """Blocks whose granted load was not made since the last call: vLLM recomputes them."""
        out, self._load_errors = self._load_errors, set()
        return out

    def stats(self) -> HiCacheStats | None:
        """What hicache's counters (`REPORTED`, and each store tier's hit tokens) gained since
        the last call, for vLLM's connector stats; None when nothing did."""
        now = self._cache().stats()
        names = [*REPORTED, *(f"hit_tokens_{tier}" for tier in self._kinds)]
        gained = {k: now.get(k, 0) - self._reported.get(k, 0) for k in names}
        self._reported.update({k: now.get(k, 0) for k in names})
        gained = {k: v for k, v in gained.items() if v}
        return HiCacheStats(gained) if gained else None

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()
            self.cache = None

    # -- the parts ------------------------------------------------------------------------------

    def _cache(self) -> HiCache:
        if self.cache is None:
            raise RuntimeError("hicache: vLLM has not registered its KV tensors yet")
        return self.cache

    def _match(self, lookup: Lookup, upto: int) -> Match | None:
        """Match the first `upto` tokens of the lookup's; None where hicache refused them."""
        try:
            m = self._cache().match(
                lookup.request_id, lookup.tokens[:upto], salt=lookup.salt,
                computed_tokens=lookup.computed,
            )  # fmt: skip
        except (ValueError, HiCacheError) as err:
            log.warning("hicache: lookup of request %s: %s", lookup.request_id, err)
            return None
        if not m.pending:
            self._matched[lookup.request_id] = (m, lookup)
        return m

    def _answer(self, lookup: Lookup, m: Match | None) -> Answer:
        if m is None or not m.load_pages:
            return Answer(lookup.request_id, lookup.computed, lookup.computed)
        sources: dict[str, int] = {"host": m.cached_tokens - m.fetched_tokens}
        for name, tokens in m.tier_tokens:
            kind = self._kinds.get(name, "external_unspecified")
            sources[kind] = sources.get(kind, 0) + tokens
        return Answer(lookup.request_id, lookup.computed, m.hit_tokens, tuple(sources.items()))

    def _load(self, load: Load) -> None:
        """Copy the granted hit into its blocks; where that cannot be done as granted, report
        the blocks so that vLLM recomputes them. Never serves more or less than granted."""
        cache, P = self._cache(), self._layout["page_tokens"]
        m, lookup = self._matched.pop(load.request_id, (None, None))
        if m is not None and lookup is not None and m.hit_tokens > load.hit:
            # another rank holds less: ask again for no more than the grant
            cache.release(load.request_id)
            m = self._match(lookup, load.hit + self.config.policy.min_recompute_tokens)
            self._matched.pop(load.request_id, None)
        loaded = False
        if m is not None and m.computed_tokens == load.computed and m.hit_tokens == load.hit:
            try:
                cache.load(m, load.block_ids[m.first_page : m.first_page + m.load_pages])
                loaded = True
            except (ValueError, HiCacheError) as err:
                log.warning("hicache: load of request %s: %s", load.request_id, err)
        if not loaded:
            self._load_errors.update(load.block_ids[load.computed // P : load.hit // P])
        cache.release(load.request_id)

    def _store(self, store: Store) -> None:
        """Store the pages of the request's first `upto` tokens that hicache lacks."""
        rid = store.request_id
        tokens = self._tokens.setdefault(rid, [])
        if len(tokens) != store.sent_before:  # cannot happen unless a step was lost: skip
            log.warning("hicache: store of request %s: tokens out of step", rid)
            self._tokens.pop(rid)
            return
        tokens.extend(store.new_tokens)
        if rid in self._asking or rid in self._matched:
            return  # its question is open (not scheduled, or preempted): store later
        cache = self._cache()
        try:
            cache.store(rid, tokens[: store.upto], store.block_ids, salt=store.salt)
        except (ValueError, HiCacheError) as err:
            log.warning("hicache: store of request %s: %s", rid, err)
        finally:
            cache.release(rid)


def layout_fields(vllm_config: Any, kv_cache_config: Any, extra: dict[str, Any]) -> dict:
    """hicache's layout from vLLM's configs, all but the segment sizes (those come from the
    tensors vLLM registers): the model (its name, revision and a digest of its config and
    quantization, or the extra config's `model_id`), the KV dtype, the block size and the TP
    rank. Refuses what hicache cannot key safely."""
    from vllm.distributed.parallel_state import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    from hicache.keys import model_digest

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, FullAttentionSpec):
        kinds = [type(g.kv_cache_spec).__name__ for g in groups]
        raise ValueError(f"hicache: only full-attention models are supported, got {kinds}")
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        raise ValueError("hicache: pipeline parallelism is not supported")
    spec = groups[0].kv_cache_spec
    mc = vllm_config.model_config
    digest = model_digest({"hf": mc.hf_config.to_dict(), "quantization": mc.quantization})
    return {
        "model": extra.get("model_id") or f"{mc.model}@{mc.revision or 'main'}:{digest}",
        "kv_dtype": str(spec.dtype).removeprefix("torch."),
        "page_tokens": spec.block_size,
        "tp_rank": get_tensor_model_parallel_rank(),
        "tp_size": get_tensor_model_parallel_world_size(),
        "kv_head_sharded": not isinstance(spec, MLAAttentionSpec),
    }
