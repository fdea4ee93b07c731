"""The scheduler: FCFS admission, chunked prefill, greedy decoding, continuous batching.

One `Engine.step()`:

1. ``cache.poll()`` (when a cache is embedded);
2. admit waiting requests in arrival order: look the prompt up in the engine's own GPU prefix
   cache (`hicache.tools.refengine.prefix`, when it has one), ask the cache for a hit past that
   (``match`` with ``computed_tokens``), take blocks for the rest of the request (prompt +
   max_new_tokens; the prefix cache's unpinned pages are evicted for them when the pool runs
   short) and a state slot, promote the hit (``load``). A
   request the cache defers (``pending``) is skipped this step without holding up the ones behind
   it; when blocks run out, admission stops until some are freed. With a `planner`, a hit is
   split: the engine prefills its head [0, k) itself and loads [k, hit) once the head is done
   and ``fetch_ready(request)`` holds (a partial fetch, see ``hicache.core.plan``). With `partial`,
   the cache plans k itself (``match(..., partial=True)``, ``Match.head_tokens``): the request
   is admitted on its pending answer, prefills the head while the cache's tiers send the tail,
   and asks again, once the head is done, until the answer is in;
3. build the batch: one token for every decoding request, then prefill chunks of prefilling
   requests in arrival order up to ``chunk_tokens`` prompt tokens in all (a head stops at k);
4. run the model, take the argmax of each finished prompt's or decoded token's logits; with
   ``by_layer`` the pages of a hit are loaded layer by layer beside the model, and the model
   waits for layer i's pages (``wait_layer``) just before it computes layer i;
5. the step's prompt tokens and time go to the cache's cost model (``report_prefill``); a
   request whose prompt is fully computed is stored (``store``); a request that has its
   ``max_new_tokens`` is stored with ``prompt + output[:-1]`` (the tokens whose KV it holds),
   released, its full pages kept by the GPU prefix cache and its other blocks and slot freed.

The cache is duck-typed (hicache's `HiCache`, or any object with the same methods), so this module
does not import hicache.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hicache.tools.refengine.memory import KVMemory
from hicache.tools.refengine.model import Item, Transformer
from hicache.tools.refengine.prefix import PrefixCache, PrefixHit


@dataclass
class Request:
    """A prompt to complete greedily; the engine fills in the runtime fields."""

    rid: str
    prompt: list[int]
    max_new_tokens: int
    salt: str | None = None
    output: list[int] = field(default_factory=list)
    arrival: float = 0.0
    admitted: float | None = None  # when it got its blocks (TTFT less this: its queueing)
    first_token_time: float | None = None
    finish_time: float | None = None
    hit_tokens: int = 0  # prompt tokens the cache supplied
    gpu_hit_tokens: int = 0  # prompt tokens found in the engine's own GPU prefix cache
    l3_tokens: int = 0  # of which promoted from the store tiers below the host
    # runtime
    blocks: list[int] = field(default_factory=list)
    table: torch.Tensor | None = None
    slot: int | None = None
    computed: int = 0
    match: Any = None
    head_end: int | None = None  # a partial fetch: prefill up to here, then load the rest
    loading: Any = None  # the load the next chunk's layers wait for (``wait_layer``)
    prefix_hit: PrefixHit | None = None  # pages shared from the GPU prefix cache, pinned

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError(f"request {self.rid}: empty prompt")
        if self.max_new_tokens < 1:
            raise ValueError(f"request {self.rid}: max_new_tokens must be at least 1")

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.prompt)


class Engine:
    """Runs requests on one `Transformer` with one `KVMemory`; optionally embeds a cache."""

    def __init__(
        self,
        model: Transformer,
        memory: KVMemory,
        chunk_tokens: int = 512,
        cache: Any = None,
        clock: Callable[[], float] = time.perf_counter,
        idle_sleep_s: float = 0.001,
        by_layer: bool = False,
        planner: Callable[[Request, Any], int] | None = None,
        fetch_ready: Callable[[Request], bool] | None = None,
        partial: bool = False,
        prefix: PrefixCache | None = None,
    ) -> None:
        """`by_layer`: load hits layer by layer (the cache's ``load(..., by_layer=True)``).
        `planner(request, match)` returns k, a page boundary in [computed_tokens, hit_tokens]:
        the engine prefills [computed_tokens, k) and loads the hit's pages from k on (k =
        computed_tokens: all of them; without a planner, all of them at admission).
        `fetch_ready(request)` says whether the pages from k on may be loaded now (a slow
        tier's transfer done); default: always. `partial`: ask the cache for its own plan
        (``match(..., partial=True)``); a hit it plans (``head_tokens``) is split at its k, not
        the planner's. `prefix`: the engine's GPU prefix cache (None: none; a model with
        sliding-window layers cannot have one)."""
        if chunk_tokens < 1:
            raise ValueError("chunk_tokens must be at least 1")
        self.model = model
        self.memory = memory
        self.chunk_tokens = chunk_tokens
        self.cache = cache
        self.clock = clock
        self.idle_sleep_s = idle_sleep_s
        self.by_layer = by_layer
        self.planner = planner
        self.fetch_ready = fetch_ready
        self.partial = partial
        self.needs_slot = memory.rings is not None
        if prefix is not None and self.needs_slot:
            raise ValueError("a GPU prefix cache needs a model without sliding-window layers")
        if prefix is not None and prefix.page_tokens != memory.page_tokens:
            raise ValueError("the prefix cache's page_tokens differ from the pool's")
        self.prefix = prefix
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.steps = 0

    # -- public -------------------------------------------------------------------------------

    def add(self, req: Request) -> None:
        """Queue a request; its TTFT counts from now."""
        pages = -(-(len(req.prompt) + req.max_new_tokens) // self.memory.page_tokens)
        if pages > self.memory.num_blocks:
            raise ValueError(
                f"request {req.rid} needs {pages} blocks, the pool has {self.memory.num_blocks}"
            )
        req.arrival = self.clock()
        self.waiting.append(req)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def run(self, requests: list[Request] | None = None) -> list[Request]:
        """Add `requests`, step until nothing is left, return them (finished) in order."""
        for r in requests or []:
            self.add(r)
        while self.busy:
            self.step()
        return list(requests or [])

    def step(self) -> list[Request]:
        """One engine step (see the module docstring). Returns the requests that finished."""
        self.steps += 1
        if self.cache is not None:
            self.cache.poll()
        self._admit()
        self._load_tails()
        items, owners = self._batch()
        done: list[Request] = []
        if items:
            start = self.clock()
            logits = self.model.forward(items, self.memory)
            next_tokens = logits.argmax(-1).tolist()  # waits for the step's work on the device
            now = self.clock()
            self._report_prefill(owners, now - start)
            for (req, n), tok in zip(owners, next_tokens):
                was_prefill = req.prefilling
                req.computed += n
                if req.prefilling:
                    continue  # a middle chunk: its logits are not used
                if was_prefill:
                    req.first_token_time = now
                    if self.cache is not None:
                        self.cache.store(req.rid, req.prompt, req.blocks, state_slot=req.slot)
                req.output.append(int(tok))
                if len(req.output) >= req.max_new_tokens:
                    req.finish_time = now
                    done.append(req)
        elif self.waiting or self.running:
            time.sleep(self.idle_sleep_s)  # only deferred requests: do not spin while they wait
        for req in done:
            self._finish(req)
        return done

    # -- internals ----------------------------------------------------------------------------

    def _report_prefill(self, owners: list[tuple[Request, int]], seconds: float) -> None:
        """Feed the step's prompt tokens and time to the cache's cost model (``report_prefill``,
        where the cache has it). The time counts the step's decodes and layer loads too, so the
        speed errs on the slow side, as vLLM's connector measures it."""
        report = getattr(self.cache, "report_prefill", None)
        if report is None:
            return
        tokens = sum(n for req, n in owners if req.prefilling)
        if tokens:
            report(tokens, seconds)

    def alloc_blocks(self, n: int) -> list[int] | None:
        """`n` free blocks of the pool, evicting unpinned prefix-cache pages if need be; None
        (nothing taken) when even that leaves too few."""
        short = n - self.memory.free_blocks
        if short > 0 and self.prefix is not None:
            self.memory.free(self.prefix.evict(short))
        return self.memory.alloc_blocks(n)

    def _admit(self) -> None:
        for req in list(self.waiting):
            hit = PrefixHit() if self.prefix is None else self.prefix.lookup(req.prompt, req.salt)
            gpu_tokens = len(hit.pages) * self.memory.page_tokens
            if self.cache is not None and (
                req.match is None or getattr(req.match, "computed_tokens", 0) != gpu_tokens
            ):
                m = self._match(req, gpu_tokens)
                if getattr(m, "pending", False) and not getattr(m, "head_tokens", 0):
                    self._unpin(hit)
                    continue  # the cache asks us to come back; others may go ahead
                req.match = m
            pages = -(-(len(req.prompt) + req.max_new_tokens) // self.memory.page_tokens)
            blocks = self.alloc_blocks(pages - len(hit.pages))
            if blocks is None:
                self._unpin(hit)
                break  # FCFS: wait for blocks to be freed
            slot = None
            if self.needs_slot:
                slot = self.memory.alloc_slot()
                if slot is None:
                    self.memory.free(blocks)
                    break
            req.blocks, req.slot, req.prefix_hit = hit.blocks + blocks, slot, hit
            req.table = torch.tensor(req.blocks, dtype=torch.int64, device=self.memory.device)
            req.computed = req.gpu_hit_tokens = gpu_tokens
            req.admitted = self.clock()
            self.waiting.remove(req)
            self.running.append(req)
            m = req.match
            if m is not None and getattr(m, "head_tokens", 0):  # the cache's plan
                req.computed, req.head_end = m.computed_tokens, m.head_tokens
            elif m is not None and m.hit_tokens > 0:
                if self.planner is None:
                    self._load(req, m)
                else:  # loaded by `_load_tails` once the head is computed and the tier ready
                    req.computed, req.head_end = m.computed_tokens, self.planner(req, m)

    def _unpin(self, hit: PrefixHit) -> None:
        if self.prefix is not None:
            self.prefix.unpin(hit)

    def _match(self, req: Request, computed_tokens: int | None = None) -> Any:
        computed = req.computed if computed_tokens is None else computed_tokens
        kwargs: dict[str, Any] = {"salt": req.salt}
        if computed:
            kwargs["computed_tokens"] = computed
        if self.partial:
            kwargs["partial"] = True
        return self.cache.match(req.rid, req.prompt, **kwargs)

    def _load_tails(self) -> None:
        """Load the tail of every split hit whose head is computed, once its tier is ready (for
        the cache's own plan: once its answer is no longer pending)."""
        for req in self.running:
            if req.head_end is None or req.computed < req.head_end:
                continue
            if getattr(req.match, "pending", False):
                req.match = self._match(req, req.match.computed_tokens)
                if req.match.pending:
                    continue
            if self.fetch_ready is None or self.fetch_ready(req):
                self._load(req, req.match, from_token=req.head_end)
                req.head_end = None

    def _load(self, req: Request, m: Any, from_token: int | None = None) -> None:
        """Promote the hit into the request's blocks (block ``first_page + k`` gets page k);
        from `from_token` on only, when the engine computed the head itself."""
        kwargs: dict[str, Any] = {}
        if self.by_layer:
            kwargs["by_layer"] = True
        if from_token is not None:
            kwargs["from_token"] = from_token
        try:
            # Copies go on the engine's stream (or, by layer, beside it): the prefill enqueued
            # after them sees the pages (by layer: once it has waited for each layer's).
            loading = self.cache.load(m, req.blocks[m.first_page :], state_slot=req.slot, **kwargs)
        except RuntimeError:
            # a failed promotion (hicache's errors are RuntimeErrors) is recomputed, never a hit
            req.computed = m.computed_tokens
            if req.slot is not None:
                self.memory.slot_len[req.slot] = m.computed_tokens
            return
        req.loading = loading if self.by_layer else None
        req.computed = m.hit_tokens
        req.hit_tokens = m.hit_tokens - m.computed_tokens
        req.l3_tokens = getattr(m, "fetched_tokens", 0)

    def _batch(self) -> tuple[list[Item], list[tuple[Request, int]]]:
        items: list[Item] = []
        owners: list[tuple[Request, int]] = []
        for req in self.running:
            if not req.prefilling:
                pos = len(req.prompt) + len(req.output) - 1
                items.append(Item([req.output[-1]], pos, self._table(req), req.slot))
                owners.append((req, 1))
        budget = self.chunk_tokens
        for req in self.running:
            if budget <= 0:
                break
            if not req.prefilling:
                continue
            end = len(req.prompt) if req.head_end is None else req.head_end
            n = min(budget, end - req.computed)
            if n <= 0:
                continue  # a computed head waiting for its tail
            toks = req.prompt[req.computed : req.computed + n]
            items.append(Item(toks, req.computed, self._table(req), req.slot, req.loading))
            req.loading = None  # this chunk's layers wait for the pages; later chunks follow it
            owners.append((req, n))
            budget -= n
        return items, owners

    @staticmethod
    def _table(req: Request) -> torch.Tensor:
        if req.table is None:
            raise RuntimeError(f"request {req.rid} runs without blocks")
        return req.table

    def _finish(self, req: Request) -> None:
        kv_tokens = req.prompt + req.output[:-1]
        if self.cache is not None:
            self.cache.store(req.rid, kv_tokens, req.blocks, state_slot=req.slot)
            self.cache.release(req.rid)
        if self.prefix is None:
            self.memory.free(req.blocks)
        else:
            hit = req.prefix_hit or PrefixHit()
            self.memory.free(self.prefix.finish(kv_tokens, req.blocks, hit, req.salt))
            req.prefix_hit = None
        if req.slot is not None:
            self.memory.free_slot(req.slot)
        req.blocks, req.table, req.slot = [], None, None
        self.running.remove(req)
        self.finished.append(req)
