"""The worker half: owns the HiCache and does what the scheduler half asked.

Each TP rank's worker process has one HiCache over that rank's KV tensors (its own shard: the
rank is in the layout's fingerprint). Per step, vLLM binds the step's metadata (`bind_step`), calls
`start_load` before the forward (sync loads must precede it) and `save` once the forward is
enqueued (its `wait_for_save`); all run on the engine thread.
A question whose fetch is still running is asked again on the next step, and only then
answered. The one wait on a store tier is a load whose match must fetch (a hit the scheduler
granted from its own probe of a store tier, `hicache.integrations.vllm.probe`, or pages the
host tier lost since the answer): `start_load` fetches those groups into host slots (every such
load of the step at once) and waits for them, at most the policy's `fetch_max_wait_ms`, before
it loads them like a host hit; what did not come is a load error.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hicache.cache import HiCache
from hicache.config import HiCacheConfig, Layout
from hicache.core.identity import Identity, current_device_class
from hicache.core.keys import model_digest
from hicache.core.marks import mark
from hicache.core.request import Match
from hicache.core.weights import weights_digest
from hicache.errors import HiCacheError
from hicache.integrations.vllm.meta import (
    REPORTED,
    Answer,
    Answers,
    HiCacheStats,
    Load,
    Lookup,
    StepMeta,
    Store,
)
from hicache.integrations.vllm.ranks import Agree
from hicache.integrations.vllm.view import RankNews
from hicache.kernels import PagedBuffer
from hicache.kernels.completions import Completion, LayerLoad
from hicache.observability.events import KVEvent

log = logging.getLogger("hicache.vllm")

#: The counters of `HiCache.stats` reported to vLLM's connector stats, as increases.
FETCH_WAIT_MARGIN_S = 0.05
"""A load waits for its fetch at most the policy's `fetch_max_wait_ms` plus this (the fetch
gives up at its deadline by itself; this bounds the wait should a tier's thread stall)."""

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
    match stops being pending), unless the request is forgotten or its question closed first
    (`unused`); a `Load` loads at most what was granted, and the granted blocks it could not
    fill are reported through `load_errors` (vLLM recomputes them); the hicache request of an
    id is released after each load and store, when its question is closed unused, and when it
    is forgotten.

    Pins: an answered hit stays pinned until its load, its `unused` or its `forget`, as long as
    the answers' pins stay within `pin_share` of the host tier; an answer past that share is
    given unpinned and matched again when it loads (a page evicted meanwhile is then recomputed,
    not served). No store takes a block whose load failed in its step, nor any page after it:
    the request's stores stop before that page for the rest of its life (`_bad_from`).

    With several TP ranks, a load fails on every rank where it failed on one (its shard spoils
    every rank's forward): `agree` (`hicache.integrations.vllm.ranks`) gives the least each
    rank filled of each of the step's loads, once every rank has made them, before the forward;
    every rank then reports the same failed blocks and stores none of them.
    """

    def __init__(
        self,
        config: HiCacheConfig,
        layout: dict[str, Any],
        pin_share: float = 0.5,
        agree: Agree | None = None,
    ) -> None:
        self.config = config
        self._layout = layout
        self._pin_share = pin_share
        self._agree = agree
        self.layout: Layout | None = None
        self.cache: HiCache | None = None
        self._asking: dict[str, Lookup] = {}
        # answered, not yet loaded: the match holding its pins, or None (given unpinned)
        self._matched: dict[str, tuple[Match | None, Lookup]] = {}
        self._tokens: dict[str, list[int]] = {}
        self._answers: list[Answer] = []
        self._resync: list[str] = []
        self._load_errors: set[int] = set()
        self._failed_blocks: set[int] = set()  # this step's blocks whose load failed
        self._bad_from: dict[str, int] = {}  # request -> its first page not to store
        self._kinds: dict[str, str] = {}
        self._reported: dict[str, int] = {}
        self._clock: PrefillClock | None = None
        self._news: RankNews | None = None  # what the tiers gained and lost since last sent
        self._layer_of: dict[str, int] = {}  # vLLM's layer name -> its index, for layered loads
        self._loading: list[Completion] = []  # this step's loads, arriving layer by layer
        self._told = False  # whether the scheduler has had news from this rank yet
        self._woken = threading.Event()  # a store tier's thread has posted a result

    @property
    def rank(self) -> int:
        """This worker's TP rank."""
        return self._layout["tp_rank"]

    def register(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        """Build the layout and the HiCache over vLLM's KV tensors (`num_blocks` blocks each),
        and wait (at most READY_TIMEOUT_S) until its pools are allocated and its tiers answer."""
        pool, note = kv_pool(kv_caches, num_blocks)
        fields = {**self._layout, "model": f"{self._layout['model']}|kv{note}"}
        self.layout = Layout(**fields, segments=pool.seg_bytes)
        log.info("hicache: %d segments a page, %s", len(pool.segments), self.layout.model)
        # loads layer by layer where each layer has a tensor of its own (not shared KV)
        distinct = len({t.data_ptr() for t in kv_caches.values()}) == len(kv_caches)
        if distinct:
            self._layer_of = {name: i for i, name in enumerate(kv_caches)}
        self.cache = HiCache(
            self.config, pool, layout=self.layout, events=self._on_event,
            layers=len(self._layer_of), wake=self._woken.set,
        )  # fmt: skip
        # vLLM is still starting: let the first requests find the pools and the tiers ready
        if not self.cache.wait_ready(READY_TIMEOUT_S):
            log.warning("hicache: a store tier does not answer yet; lookups skip it until it does")
        tiers = self.cache.store_tiers.values()
        unknown = any(t.shared or (t.persistent and not t.empty_at_start()) for t in tiers)
        self._news = RankNews(self.cache.fingerprint, unknown)  # sent with the first answers
        self._kinds = {
            name: "p2p" if tier.shared else "disk" for name, tier in self.cache.store_tiers.items()
        }
        self._clock = PrefillClock(self.cache.report_prefill, next(iter(kv_caches.values())))

    def _on_event(self, event: KVEvent) -> None:
        """hicache's KV events (on this thread), gathered for the scheduler's view."""
        if self._news is None:
            return  # before register has made the news: the tiers are empty
        if event.tier == "host":
            books = self._news.stored if event.kind == "stored" else self._news.removed
            books.extend(event.keys)
        elif event.kind == "stored":
            self._news.lower.extend(event.keys)

    def bind_step(self, step: StepMeta) -> None:
        """vLLM bound this step's metadata (`bind_connector_metadata`), before its forward: time
        its prefill."""
        if self._clock is not None and step.prefill_tokens >= self._layout["page_tokens"]:
            self._clock.begin(step.prefill_tokens)

    # -- one step -------------------------------------------------------------------------------

    def start_load(self, step: StepMeta) -> None:
        """Before the forward (vLLM's `start_load_kv`): forget, let unused answers go, load what
        was granted, and answer the questions whose matches are no longer pending."""
        cache = self._cache()
        cache.poll()
        if self._clock is not None:
            self._clock.poll()
        for rid in step.forget:
            self._tokens.pop(rid, None)
            self._bad_from.pop(rid, None)
            self._close(rid)
        for rid in step.unused:  # a question closed without a load, answered or not
            self._close(rid)
        loading = [self._rematch(load) for load in step.loads]
        self._await_fetches(loading)
        filled = [self._load(one) for one in loading]
        if self._agree is not None and loading:  # every rank's step has these loads, in order
            own, filled = filled, self._agree(filled)
            if filled != own:
                mark("tp.load-failed-on-another-rank")
        for load, upto in zip(step.loads, filled):
            self._failed(load, upto)
        for lookup in step.lookups:
            self._matched.pop(lookup.request_id, None)
            self._asking[lookup.request_id] = lookup
        for rid, lookup in list(self._asking.items()):
            m = self._match(lookup, len(lookup.tokens))
            if m is None or not m.pending:
                del self._asking[rid]
                self._answers.append(self._answer(lookup, m))
                if m is not None:
                    self._hold(lookup, m)

    def _close(self, rid: str) -> None:
        """End `rid`'s question, answered or not: forget its match and let its pins go."""
        self._asking.pop(rid, None)
        self._matched.pop(rid, None)
        self._cache().release(rid)

    def _hold(self, lookup: Lookup, m: Match) -> None:
        """Keep the answered hit's pins while the answers' pins stay within their share of
        the host tier; past it, let them go (the load matches again)."""
        held = sum(h.load_pages for h, _ in self._matched.values() if h is not None and h is not m)
        budget = int(self._pin_share * self._cache().host.page_slots.capacity)
        if m.load_pages and held + m.load_pages > budget:
            self._cache().release(lookup.request_id)
            self._matched[lookup.request_id] = (None, lookup)

    def wait_layer(self, name: str) -> None:
        """vLLM's attention is about to compute layer `name`: make the model's stream wait for
        that layer of this step's loads (on the device; the host thread never waits)."""
        i = self._layer_of.get(name)
        if i is not None:
            for loading in self._loading:
                loading.wait_layer(i)

    def save(self, step: StepMeta) -> None:
        """After the forward is enqueued (vLLM's `wait_for_save`): store the pages this step
        completed. The model's stream first waits for every layer of this step's loads, whether
        or not the forward asked for each (the blocks must be whole before any later kernel
        reads them)."""
        for loading in self._loading:
            if isinstance(loading, LayerLoad) and loading.layers:
                loading.wait_layer(loading.layers - 1)  # one copy stream: the last is all
        self._loading = []
        for store in step.stores:
            self._store(store)
        self._failed_blocks = set()
        self._cache().poll()

    def answers(self) -> Answers | None:
        """This step's answers and resyncs, for the scheduler half (None when there are none).
        vLLM asks for them once the step's forward is done (enqueued, on an accelerator)."""
        if self._clock is not None:
            self._clock.end()
        rank, news = self._layout["tp_rank"], self._news
        if news is not None and (news.stored or news.removed or news.lower or not self._told):
            self._news, self._told = RankNews(news.fingerprint, news.lower_unknown), True
        else:
            news = None
        if not self._answers and not self._resync and news is None:
            return None
        out = Answers({rank: self._answers} if self._answers else {}, self._resync)
        if news is not None:
            out.news[rank] = news
        self._answers, self._resync = [], []
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

    def _rematch(self, load: Load) -> _Loading:
        """The match `load` copies from: the answer's own, or, where it was given unpinned,
        another rank holds less, it answers another question or the scheduler granted the hit
        without asking (its view or its probe of a store tier), a new match, no further than
        granted (pending while it fetches groups from a store tier)."""
        cache, rid = self._cache(), load.request_id
        m, lookup = self._matched.pop(rid, (None, None))
        if load.tokens is not None:  # granted by the scheduler itself
            lookup = Lookup(rid, load.tokens, load.computed, load.salt)
        stale = m is None or m.hit_tokens > load.hit or m.computed_tokens != load.computed
        upto = load.hit + self.config.policy.min_recompute_tokens
        if lookup is not None and stale:
            cache.release(rid)
            m = self._match(lookup, upto)
            self._matched.pop(rid, None)
        return _Loading(load, m, lookup, upto)

    def _await_fetches(self, loading: list[_Loading]) -> None:
        """Wait until no load's match is pending (their fetches run side by side), at most the
        policy's `fetch_max_wait_ms` (and a margin): the fetch ends at its deadline by itself,
        and the match then answers what the host tier holds."""
        waiting = [one for one in loading if one.m is not None and one.m.pending]
        if not waiting:
            return
        deadline = time.monotonic() + self.config.policy.fetch_max_wait_ms / 1e3
        deadline += FETCH_WAIT_MARGIN_S
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._woken.wait(min(left, 0.01))  # and a look now and then: deadlines pass silently
            self._woken.clear()
            for one in waiting:
                one.m = self._match(one.lookup, one.upto)  # type: ignore[arg-type]
                self._matched.pop(one.load.request_id, None)
            waiting = [one for one in waiting if one.m is not None and one.m.pending]

    def _load(self, one: _Loading) -> int:
        """Copy the granted hit into its blocks, or as much of its head as hicache still holds;
        the tokens filled (from the load's `computed` on; see `_failed`). Never serves more
        than granted."""
        cache, load, m = self._cache(), one.load, one.m
        filled = load.computed
        usable = m is not None and not m.pending and m.computed_tokens == load.computed
        if m is not None and usable and m.hit_tokens <= load.hit:
            try:
                blocks = load.block_ids[m.first_page : m.first_page + m.load_pages]
                self._loading.append(cache.load(m, blocks, by_layer=bool(self._layer_of)))
                filled = m.hit_tokens
            except (ValueError, HiCacheError) as err:
                log.warning("hicache: load of request %s: %s", load.request_id, err)
        cache.release(load.request_id)
        return filled

    def _failed(self, load: Load, filled: int) -> None:
        """`load` was filled up to `filled` tokens (the least of every rank's): report the
        granted blocks after it so that vLLM recomputes them, and keep every store of the
        request short of them (in this step, and for the rest of its life)."""
        if filled < load.hit:
            P, rid = self._layout["page_tokens"], load.request_id
            failed = load.block_ids[filled // P : load.hit // P]
            self._load_errors.update(failed)
            self._failed_blocks.update(failed)
            self._bad_from[rid] = min(filled // P, self._bad_from.get(rid, filled // P))

    def _store(self, store: Store) -> None:
        """Store the pages of the request's first `upto` tokens that hicache lacks, short of
        any block whose load failed (in this step, or earlier for this request)."""
        rid = store.request_id
        tokens = self._tokens.get(rid)
        if store.sent_before == 0:  # the first store, or a resent one: from the first token
            tokens = self._tokens[rid] = []
        elif tokens is None or len(tokens) != store.sent_before:
            # a store not seen (a lost step): no store until the scheduler resends the tokens
            self._tokens.pop(rid, None)
            if rid not in self._resync:
                log.warning("hicache: store of request %s: tokens out of step, resyncing", rid)
                self._resync.append(rid)
            return
        tokens.extend(store.new_tokens)
        P = self._layout["page_tokens"]
        for i, block in enumerate(store.block_ids[: store.upto // P]):
            if block in self._failed_blocks:
                self._bad_from[rid] = min(i, self._bad_from.get(rid, i))
                break
        upto = min(store.upto, self._bad_from.get(rid, store.upto // P) * P)
        if rid in self._asking or rid in self._matched or not upto:
            return  # its question is open (not scheduled, or preempted): store later
        cache = self._cache()
        try:
            tail = store.tail and upto == store.upto
            cache.store(rid, tokens[:upto], store.block_ids, salt=store.salt, tail=tail)
        except (ValueError, HiCacheError) as err:
            log.warning("hicache: store of request %s: %s", rid, err)
        finally:
            cache.release(rid)


@dataclass
class _Loading:
    """A load of this step: the match it copies from and the question it was matched for."""

    load: Load
    m: Match | None
    lookup: Lookup | None
    upto: int
    """The prompt tokens matched (the grant plus the engine's minimum recompute)."""


class PrefillClock:
    """Times the steps that compute prompt tokens and feeds the speed to hicache's cost model
    (`report`: `HiCache.report_prefill`). On an accelerator, with events on the model's stream
    read once they have completed (never waited for); on the CPU, where vLLM's forward is
    synchronous, with the wall clock. A step's time counts its decodes too: the speed it gives
    errs on the slow side, so hicache fetches a little more than it would otherwise."""

    def __init__(self, report: Callable[[int, float], None], like: torch.Tensor) -> None:
        self._report = report
        self._cuda = like.is_cuda
        self._open: tuple[int, Any] | None = None
        self._timed: list[tuple[int, Any, Any]] = []

    def _mark(self) -> Any:
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def begin(self, tokens: int) -> None:
        self._open = (tokens, self._mark())

    def end(self) -> None:
        if self._open is not None:
            tokens, start = self._open
            self._timed.append((tokens, start, self._mark()))
            self._open = None
        self.poll()

    def poll(self) -> None:
        """Report the timed steps that have completed."""
        while self._timed:
            tokens, start, end = self._timed[0]
            if self._cuda:
                if not end.query():
                    return
                seconds = start.elapsed_time(end) / 1000
            else:
                seconds = end - start
            self._timed.pop(0)
            if seconds > 0:
                self._report(tokens, seconds)


def layout_fields(
    vllm_config: Any,
    kv_cache_config: Any,
    model_id: str | None,
    tp_rank: int,
    tp_size: int,
    weights_version: str = "",
) -> dict:
    """hicache's layout from vLLM's configs, all but the segment sizes (those come from the
    tensors vLLM registers): the identity of the pages (`vllm_identity`; `model_id` names the
    weights only), the KV tensors' dtype, the block size and the TP rank (`tp_rank` of
    `tp_size`). Refuses what hicache cannot key safely."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, FullAttentionSpec):
        kinds = [type(g.kv_cache_spec).__name__ for g in groups]
        raise ValueError(f"hicache: only full-attention models are supported, got {kinds}")
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        raise ValueError("hicache: pipeline parallelism is not supported")
    spec = groups[0].kv_cache_spec
    shard = f"tp{tp_rank}/{tp_size}" if not isinstance(spec, MLAAttentionSpec) else ""
    identity = vllm_identity(vllm_config, spec, model_id, shard, weights_version)
    return {
        "model": identity.name(),
        "kv_dtype": _dtype(spec),
        "page_tokens": spec.block_size,
        "tp_rank": tp_rank,
        "tp_size": tp_size,
        "kv_head_sharded": not isinstance(spec, MLAAttentionSpec),
    }


def vllm_identity(
    vllm_config: Any, spec: Any, model_id: str | None, shard: str = "", weights_version: str = ""
) -> Identity:
    """The identity of the pages of vLLM's model (`vllm_config`) in blocks of `spec` (its
    KV cache spec): the weights (`model_id` or vLLM's model name; the weight files by content,
    `weights_version`), the model's config as vLLM loaded it (`hf_config` with
    `--hf-overrides` applied), the dtype it computes in, the KV cache format (`kv_format`), its
    quantization, the attention's kind and geometry, the RoPE settings (also in the config),
    this rank's `shard` ('' where every rank holds the same KV: MLA) and the arithmetic
    (vLLM's batch-invariant mode, ``VLLM_BATCH_INVARIANT``, and the device class)."""
    import vllm.envs

    mc = vllm_config.model_config
    hf = mc.hf_config.to_dict() if mc.hf_config is not None else None
    if hf is not None:  # where the config was read from is not the model (`weights` names it)
        hf.pop("_name_or_path", None)
    return Identity(
        weights=model_id or mc.model,
        weights_digest=weights_digest(_weights_folder(mc.model, mc.revision)),
        weights_version=weights_version,
        config={
            "hf": hf,
            "revision": mc.revision,
            "code_revision": mc.code_revision,
            "disable_sliding_window": mc.disable_sliding_window,
        },
        compute_dtype=str(mc.dtype).removeprefix("torch."),
        kv_format=kv_format(vllm_config, _dtype(spec)),
        quantization=str(mc.quantization),
        attention={
            "kind": type(spec).__name__,
            "kv_heads": spec.num_kv_heads,
            "head_size": spec.head_size,
        },
        position={k: hf.get(k) for k in ROPE_FIELDS} if hf is not None else {},
        shard=shard,
        arithmetic=f"batch_invariant={vllm.envs.VLLM_BATCH_INVARIANT}|{current_device_class()}",
    )


ROPE_FIELDS = ("rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor")
"""The fields of a model's config that set its position encoding."""


def _dtype(spec: Any) -> str:
    return str(spec.dtype).removeprefix("torch.")


def kv_format(vllm_config: Any, tensor_dtype: str) -> str:
    """What of vLLM's config beyond the model (and beyond the KV tensors' dtype,
    `tensor_dtype`) decides a block's bytes, for the page keys:

    - the KV cache dtype as configured (`--kv-cache-dtype`; ``auto`` resolved as vLLM does, to
      the checkpoint's KV quantization or else the tensors' dtype): fp8, fp8_e4m3 and fp8_e5m2
      all lie in uint8 tensors;
    - the layers it leaves unquantized (`--kv-cache-dtype-skip-layers`);
    - a speculative drafter whose attention layers keep KV in the same blocks (EAGLE, MTP, a
      draft model: `uses_draft_kv_cache`): its method and its `model_identity`.

    KV scales are the checkpoint's in vLLM 0.32 (or 1.0): its quantization config and weights
    are in `model_identity` already."""
    from vllm.utils.torch_utils import resolve_kv_cache_dtype_string

    cache = vllm_config.cache_config
    fmt = resolve_kv_cache_dtype_string(cache.cache_dtype, vllm_config.model_config)
    parts = [f"kv-cache={tensor_dtype if fmt == 'auto' else fmt}"]
    if cache.kv_cache_dtype_skip_layers:
        parts.append(f"unquantized={','.join(sorted(cache.kv_cache_dtype_skip_layers))}")
    spec = vllm_config.speculative_config
    if spec is not None and spec.uses_draft_kv_cache():
        parts.append(f"drafter={spec.method}:{model_identity(spec.draft_model_config)}")
    return "|".join(parts)


def model_identity(model_config: Any) -> str:
    """A drafter's model in the page keys (`kv_format`), from vLLM's `ModelConfig`: its name
    and revision, and a digest of its config as vLLM loaded it (`--hf-overrides` applied), its
    dtype, quantization, code revision, sliding window and its weight files' bytes."""
    mc = model_config
    digest = model_digest({
        "hf": mc.hf_config.to_dict(),
        "dtype": str(mc.dtype).removeprefix("torch."),
        "quantization": mc.quantization,
        "revision": mc.revision,
        "code_revision": mc.code_revision,
        "disable_sliding_window": mc.disable_sliding_window,
        "weights": weights_digest(_weights_folder(mc.model, mc.revision)),
    })  # fmt: skip
    return f"{mc.model}@{mc.revision or 'main'}:{digest}"


def _weights_folder(model: str, revision: str | None) -> str:
    """The folder vLLM loads `model`'s weights from: the path itself, or the snapshot of a hub
    model in the local Hugging Face cache ('' when it is not there)."""
    if Path(model).is_dir():
        return model
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(model, "config.json", revision=revision)
    except (ImportError, ValueError, OSError):
        return ""
    return str(Path(found).parent) if isinstance(found, str) else ""
