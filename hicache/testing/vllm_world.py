"""The simulated world with vLLM's side: the real connector pair (`SchedulerBooks` with its
`TierView`, `WorkerCache` with its HiCache) called the way vLLM's scheduler and worker call them,
one engine step at a time (`op_step`), over vLLM's own `Request` objects.

The scheduler here is a small one: each step it asks the connector about its waiting requests
(with its own prefix cache's hit), allocates blocks for those answered, schedules their prefill
and one token for each decoding request, builds the connector's metadata, and runs the worker's
start (loads), the forward (kernels on the simulated device: reads of the loaded blocks, writes
of the computed ones) and the worker's after (stores). A failed load is recovered from as vLLM
0.32 does it with `kv_load_failure_policy="recompute"` (`Scheduler._update_requests_with_invalid_
blocks`, run in `update_from_output`, after the step's forward and its `wait_for_save`): the
step's forward runs as scheduled, over the failed blocks' stale contents (what their previous
owner left), so the pages it computes after the first failed one are wrong too (a page's KV
depends on every page before it); the step's stores see all that; only then does the scheduler
roll the request's computed tokens back to its first failed block, and the next step recomputes
from there.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.v1.request import Request

from hicache.core.keys import namespace
from hicache.core.marks import mark
from hicache.integrations.vllm.probe import StoreProbe
from hicache.integrations.vllm.scheduler import SchedulerBooks
from hicache.integrations.vllm.worker import WorkerCache, layout_fields
from hicache.testing.device import SimDevice
from hicache.testing.faults import POISON, SimTier
from hicache.testing.oracle import Content, Violation, expand
from hicache.testing.workload import call_fault, content_of
from hicache.testing.world import FETCH_MAX_WAIT_S, Node, World

LORAS = (None, ("alpha", "/adapters/alpha"), ("beta", "/adapters/beta"))
SALTS = (
    None,
    "tenant-a",
    namespace(lora=LORAS[1][0], lora_path=LORAS[1][1]).decode(),  # an adapter's, as a salt
)
IMAGES = (("cat", 5), ("dog", 3), ("sim-img-49257", 1), ("sim-img-78664", 1))
"""Each image's content hash and its number of placeholder tokens (an image that does not fit
in the prompt is left out). The last two give a page of one token that holds the one
placeholder of either the same 31-bit word when folded (`hicache.core.keys.fold_features`, as
the connector names an image: ``image:<hash>``): only the rest of their hashes tells them
apart."""
PLACEHOLDER = 0
"""The token id of every image placeholder (the image's content hash tells images apart)."""


@dataclass
class VReq:
    request: Any  # vllm.v1.request.Request
    own: int  # pages vLLM's own prefix cache holds of it
    blocks: list[int] = field(default_factory=list)
    running: bool = False
    decode: int = 0  # tokens still to sample
    hit: tuple[int, int] | None = None  # (computed, hit) loaded in the current step
    kv_pages: int = 0
    stale: int | None = None  # its first page whose load failed in the current step


def request_content(r: Any) -> Content:
    """The truth of a vLLM request's pages: its tokens and every input that names them."""
    lora = r.lora_request
    images = tuple(
        (f.identifier, f.mm_position.offset, f.mm_position.length) for f in r.mm_features or ()
    )
    return Content(
        tuple(r.all_token_ids),
        r.cache_salt,
        None if lora is None else repr((lora.lora_name, lora.lora_path)),
        images,
    )


class StoreWhileWaiting:
    """What the worker waits on while a granted load's fetch is pending (in step): the
    simulation serves the store meanwhile, as a real store answers while the engine waits. Each
    wait lets the first parked call through (in the gate's order; with a call fault, drawn as
    the `call` operations draw theirs, from a generator of the world's own seed), else runs the
    device's next work, else lets time pass; a wait that serves nothing for `IDLE_WAITS` rounds
    is a fetch that never ends (a hang in the cache). A faulty answer fails the load after its
    grant, which vLLM then recovers from (see the module docstring). Now and then
    (`STALL_SHARE` of the waits) the store stalls instead: it answers nothing while the fetch's
    deadline passes (on this rank: the ranks wait one after another)."""

    IDLE_WAITS = 100
    TIME_STEP_S = 60.0
    """Simulated seconds a wait with nothing to serve lets pass (the fetch deadline is the
    world's `fetch_max_wait_ms`, in simulated time)."""
    STALL_SHARE = 0.2

    def __init__(self, world: VllmWorld, node: Node) -> None:
        self.world, self.node = world, node
        self.idle = 0  # waits in a row that served nothing
        self.rng = random.Random(f"{world.name}/{node.index}")

    def wait(self, _timeout: float) -> bool:
        world = self.world
        world.settle()
        if self.rng.random() < self.STALL_SHARE:
            world.now += FETCH_MAX_WAIT_S
            return True
        calls = world.space.gate.sorted()
        fault = call_fault(self.rng, world.setup, calls[0].op if calls else "")
        if world.space.gate.release(0, fault) is None and not self.node.device.advance(1):
            world.now += self.TIME_STEP_S
            self.idle += 1
            if self.idle > self.IDLE_WAITS:
                raise Violation("the worker waits in step for a fetch that never ends")
        else:
            self.idle = 0
        world.settle()
        return True

    def set(self) -> None:
        pass

    def clear(self) -> None:
        pass


class Agreement:
    """vLLM's TP group for the workers' agreement on their loads (an all-reduce taking the
    least of each value over the ranks, `hicache.integrations.vllm.ranks`), run as the
    simulation runs everything: one thread at a time, in rank order. `start_loads` runs each
    rank's `start_load` on a thread of its own, one after another, each up to the all-reduce
    (or its end); then, the least taken, lets them go on, one after another."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self._given: list[list[int] | None] = [None] * ranks
        self._least: list[int] = []
        self._arrived = [threading.Event() for _ in range(ranks)]
        self._go = [threading.Event() for _ in range(ranks)]

    def agree(self, rank: int) -> Callable[[list[int]], list[int]]:
        """Rank `rank`'s side of the all-reduce (blocks its thread until every rank gave)."""

        def least(values: list[int]) -> list[int]:
            self._given[rank] = list(values)
            self._arrived[rank].set()
            self._go[rank].wait()
            return list(self._least)

        return least

    def start_loads(self, workers: list[Any], meta: Any) -> None:
        """Every rank's `start_load(meta)`, as described above; raises what a rank raised."""
        if len(workers) == 1:
            workers[0].start_load(meta)
            return
        done = [threading.Event() for _ in workers]
        errors: list[BaseException] = []

        def run(r: int) -> None:
            try:
                workers[r].start_load(meta)
            except BaseException as err:  # re-raised on the simulation's thread
                errors.append(err)
            finally:
                done[r].set()

        self._given = [None] * self.ranks
        for e in (*self._arrived, *self._go):
            e.clear()
        threads = [
            threading.Thread(target=run, args=(r,), name=f"sim-rank-{r}") for r in range(self.ranks)
        ]
        for r, t in enumerate(threads):
            t.start()
            while not (self._arrived[r].wait(0.001) or done[r].is_set()):
                pass
        given = [g for g in self._given if g is not None]
        if given and not errors:
            if len(given) != self.ranks:
                errors.append(Violation("the TP ranks disagree on whether the step has loads"))
            else:
                self._least = [min(vs) for vs in zip(*given, strict=True)]
        for r, t in enumerate(threads):
            self._go[r].set()
            t.join()
        if errors:
            raise errors[0]


PROBE_WAIT_S = 60.0
"""How long the scheduler waits for its store probe (which answers at once here: never a
deadline the machine's speed decides)."""
SERVED_SHARE = 0.95
"""The share of engine steps in which the store answers the calls parked (the others leave
them to the `call` operations: late, out of order)."""
SERVED_ROUNDS = 3
"""Round trips to the store in a step that it answers (the workers poll between them)."""


@dataclass
class Instance:
    """One vLLM engine of the world: its scheduler's connector books, its TP ranks (a `Node`
    each: a `WorkerCache` with its HiCache over the rank's shard of the KV), its requests and
    its block pool (one block table serves every rank)."""

    index: int
    kv_format: str
    agreement: Agreement
    books: Any = None  # SchedulerBooks
    ranks: list[Node] = field(default_factory=list)
    workers: list[Any] = field(default_factory=list)  # WorkerCache, one per rank
    vreqs: dict[str, VReq] = field(default_factory=dict)
    free_blocks: list[int] = field(default_factory=list)


class VllmWorld(World):
    """A `World` whose engines are vLLM's scheduler and workers with the hicache connector,
    `Setup.instances` engines of `Setup.tp` ranks each, on the same stores at the same time."""

    def _build(self) -> None:
        s = self.setup
        self.instances: list[Instance] = []
        for i, (codec, fmt) in enumerate(zip(s.codecs, s.kv_formats, strict=True)):
            inst = Instance(i, fmt, Agreement(s.tp))
            for r in range(s.tp):
                node = Node(self, len(self.nodes), f"{fmt}/rank{r}", codec)
                self.nodes.append(node)
                inst.ranks.append(node)
            self.instances.append(inst)
            self._open_instance(inst)

    def _open_instance(self, inst: Instance) -> None:
        """Start (or restart) the instance: a worker per rank, registered over fresh KV
        tensors, and the scheduler's books."""
        s, P = self.setup, self.setup.page_tokens
        self.space.gate.auto = False
        dtype = torch.float32 if inst.kv_format == "auto" else torch.uint8
        inst.workers = []
        for r, node in enumerate(inst.ranks):
            node.device = SimDevice()
            fields = _layout_fields(inst.kv_format, dtype, P, s.heads, r, s.tp)
            agree = inst.agreement.agree(r) if s.tp > 1 else None
            worker = WorkerCache(node.config, fields, s.pin_share, agree)
            kv = {f"layer.{i}": torch.zeros(2, s.blocks, P, s.heads, dtype=dtype) for i in range(2)}
            worker.register(kv, s.blocks)
            cache = worker.cache
            assert cache is not None
            node.layout, node.gpu, node.states = cache.layout, cache.gpu._pages, None
            node.closer = worker.close
            worker._clock = None  # the prefill speed it measures is the wall clock's, not a seed's
            node.attach(cache)
            worker._woken = StoreWhileWaiting(self, node)  # type: ignore[assignment]
            inst.workers.append(worker)
        inst.books = SchedulerBooks(P, ranks=s.tp, in_step=s.in_step, probe=self._probe(inst))
        inst.vreqs = {}
        inst.free_blocks = list(range(s.blocks - 1, -1, -1))

    def _probe(self, inst: Instance) -> StoreProbe | None:
        """The scheduler's own client of the store (as it keeps one of Mooncake's), where the
        instance's one store tier is the shared one: it answers at once, past the gate (the
        scheduler's probe is not a worker's call), with no fault."""
        tiers = inst.ranks[0].config.tiers[1:]
        if len(tiers) != 1 or tiers[0].space != self.name or tiers[0].mooncake is not None:
            return None
        if tiers[0].disk is not None:  # each rank's own directory: no process asks another's
            return None
        probe = SimTier(tiers[0].model_copy(update={"probe": True, "node": -1}))
        return StoreProbe(probe, tiers[0], PROBE_WAIT_S)

    def content_of_store(self, node: Node, rid: str, tokens: Any) -> Content:
        vr = self._vreq(rid)
        if vr is None:
            raise Violation(f"a store for request {rid}, which the engine does not know")
        truth = request_content(vr.request)
        return Content(
            truth.tokens[: len(tokens)], truth.salt, truth.lora, truth.images, node.identity
        )

    def content_of_match(self, node: Node, rid: str, tokens: Any) -> Content | None:
        return self.content_of_store(node, rid, tokens) if self._vreq(rid) else None

    def _vreq(self, rid: str) -> VReq | None:
        inst = self._instance_of(rid)
        return None if inst is None else inst.vreqs[rid]

    def _instance_of(self, rid: str) -> Instance | None:
        return next((inst for inst in self.instances if rid in inst.vreqs), None)

    def _owner(self, node: Node) -> Instance:
        return next(inst for inst in self.instances if node in inst.ranks)

    def live(self, node: Node) -> set[str]:
        """The engine's requests, and those whose end the workers learn in the next step."""
        inst = self._owner(node)
        step = inst.books._step
        return set(inst.vreqs) | set(step.forget) | set(step.unused)

    # -- operations ---------------------------------------------------------------------------

    def op_ask(self, rid: str, spec: tuple, own: int, _partial: bool, inst: int = 0) -> None:
        """A new request (or `rid` asked again with another prompt: a new vLLM request)."""
        if self._instance_of(rid) is not None:
            self.op_release(rid)
        salt, lora, image = spec[5], spec[6], spec[7]
        if salt == 2 and "alias-salt" not in self.setup.features:
            salt = 1
        tokens = list(content_of((0, *spec[1:5])).tokens)
        features = []
        if image is not None and image[1] + IMAGES[image[0]][1] <= len(tokens):
            (name, length), offset = IMAGES[image[0]], image[1]
            tokens[offset : offset + length] = [PLACEHOLDER] * length
            features = [
                MultiModalFeatureSpec(
                    None, "image", name, PlaceholderRange(offset=offset, length=length)
                )
            ]
        adapter = None
        if LORAS[lora] is not None:
            name, path = LORAS[lora]  # type: ignore[misc]
            adapter = LoRARequest(name, lora, path)
        request = Request(
            rid, tokens, SamplingParams(max_tokens=64), None,
            mm_features=features, lora_request=adapter, cache_salt=SALTS[salt],
        )  # fmt: skip
        self.instances[inst % len(self.instances)].vreqs[rid] = VReq(request, own)

    def op_grow(self, rid: str, pages: int) -> None:
        """vLLM's own prefix cache came to hold `pages` more pages of a waiting request."""
        vr = self._vreq(rid)
        if vr is not None and not vr.running:
            vr.own += pages

    def op_decode(self, rid: str, tokens: int) -> None:
        vr = self._vreq(rid)
        if vr is not None:
            r = vr.request
            room = self.setup.decode_max - (r.num_tokens - r.num_prompt_tokens) - vr.decode
            vr.decode += max(0, min(tokens, room))

    def op_preempt(self, rid: str) -> None:
        inst = self._instance_of(rid)
        vr = None if inst is None else inst.vreqs[rid]
        if inst is None or vr is None or not vr.running:
            return
        vr.request.num_computed_tokens = 0
        self._free_blocks(inst, vr)
        vr.running, vr.own = False, 0

    def op_release(self, rid: str) -> None:
        inst = self._instance_of(rid)
        if inst is not None:
            vr = inst.vreqs.pop(rid)
            inst.books.finished(vr.request)
            self._free_blocks(inst, vr)

    @staticmethod
    def _free_blocks(inst: Instance, vr: VReq) -> None:
        inst.free_blocks += reversed(vr.blocks)
        vr.blocks, vr.kv_pages = [], 0

    def op_step(self, index: int = 0) -> None:
        """One engine step of instance `index` (see the module docstring). Every rank loads;
        a block whose load failed on any rank is stale on every rank (the forward's attention
        reduces over the ranks), so the pages computed after it are wrong on all of them."""
        inst = self.instances[index % len(self.instances)]
        P, books = self.setup.page_tokens, inst.books
        if self.rng.random() < SERVED_SHARE:  # the store answers while the step runs, round
            for _ in range(SERVED_ROUNDS):  # trips much shorter than a step
                self.serve()
                for node in inst.ranks:
                    node._cache().poll()
                self.settle()
        scheduled: dict[str, int] = {}
        for rid, vr in inst.vreqs.items():
            r = vr.request
            if vr.running:
                if r.num_computed_tokens < r.num_tokens:  # rolled back after a failed load
                    scheduled[rid] = r.num_tokens - r.num_computed_tokens
                elif vr.decode:
                    r.append_output_token_ids([7 + vr.decode])
                    vr.decode -= 1
                    scheduled[rid] = 1
                continue
            computed = min(vr.own, (r.num_tokens - 1) // P) * P
            n, _ = books.matched_tokens(r, computed)
            if n is None or not self._allocate(inst, vr):
                continue
            books.allocated(r, n)
            self._compute(inst, vr, 0, computed // P)  # vLLM's own prefix cache holds these
            r.num_computed_tokens = computed + n
            vr.hit, vr.running = (computed, computed + n), True
            scheduled[rid] = r.num_tokens - r.num_computed_tokens
        tables = {rid: vr.blocks for rid, vr in inst.vreqs.items() if vr.running}
        out = SimpleNamespace(
            kv_connector_block_state=SimpleNamespace(
                get_block_ids=lambda rid: (tables[rid],) if rid in tables else None
            ),
            num_scheduled_tokens=scheduled,
            scheduled_spec_decode_tokens={},
        )
        meta = books.build(out)
        for w in inst.workers:
            w.bind_step(meta)
        inst.agreement.start_loads(inst.workers, meta)
        failed: set[int] = set()
        for node, w in zip(inst.ranks, inst.workers, strict=True):
            lost = w.load_errors()
            self._poison(node, lost)
            failed |= lost
        for rid, count in scheduled.items():
            vr = inst.vreqs[rid]
            r = vr.request
            if vr.hit is not None:
                lo, hi = vr.hit[0] // P, vr.hit[1] // P
                bad = [i for i in range(lo, hi) if vr.blocks[i] in failed]
                self._check_blocks(inst, rid, vr, [i for i in range(lo, hi) if i not in bad])
                vr.stale, vr.hit = (bad[0] if bad else None), None
            end = (r.num_computed_tokens + count) // P
            self._compute(inst, vr, max(vr.kv_pages, r.num_computed_tokens // P), end)
            r.num_computed_tokens += count
        answers = None
        for w in inst.workers:
            w.save(meta)
            got = w.answers()
            answers = got if answers is None or got is None else answers.aggregate(got)
        for vr in inst.vreqs.values():  # vLLM's update_from_output: recompute from the failed
            if vr.stale is not None:
                vr.request.num_computed_tokens = vr.stale * P
                vr.kv_pages, vr.stale = vr.stale, None
        books.answered(SimpleNamespace(kv_connector_worker_meta=answers))

    def _allocate(self, inst: Instance, vr: VReq) -> bool:
        need = -(-(vr.request.num_tokens + self.setup.decode_max) // self.setup.page_tokens)
        if need > len(inst.free_blocks):
            return False
        vr.blocks = [inst.free_blocks.pop() for _ in range(need)]
        return True

    def _compute(self, inst: Instance, vr: VReq, lo: int, hi: int) -> None:  # type: ignore[override]
        """The forward's pages [lo, hi) of `vr` on every rank: the oracle's bytes, or, past a
        page whose load failed in this step (stale), bytes that are no page's (computed over
        the wrong KV)."""
        lo = max(lo, vr.kv_pages)
        if hi <= lo:
            return
        truth, P, stale = request_content(vr.request), self.setup.page_tokens, vr.stale
        for node in inst.ranks:
            content = self._mine(node, truth)
            pages = [
                (
                    vr.blocks[i],
                    self.oracle.page(content, (i + 1) * P)
                    if stale is None or i < stale
                    else expand(content.digest((i + 1) * P), self.oracle.page_bytes, b"stale"),
                )
                for i in range(lo, hi)
            ]
            node.device.run_later(_writer(node, pages))
        vr.kv_pages = max(vr.kv_pages, hi)

    def _poison(self, node: Node, blocks: set[int]) -> None:
        """The loads of `blocks` failed on `node`'s rank: they hold poison (what a copy that
        failed part way leaves), from the forward on."""
        if blocks:
            mark("sim.poisoned-load", len(blocks))
            poison = np.full(self.oracle.page_bytes, POISON, dtype=np.uint8)
            node.device.run_later(_writer(node, [(b, poison) for b in sorted(blocks)]))

    def _check_blocks(self, inst: Instance, rid: str, vr: VReq, pages: list[int]) -> None:
        truth, P = request_content(vr.request), self.setup.page_tokens
        for node in inst.ranks:
            content = self._mine(node, truth)
            wanted = [(i, vr.blocks[i], self.oracle.page(content, (i + 1) * P)) for i in pages]
            node.device.run_later(_reader(node, rid, wanted))
        for i in pages:
            vr.kv_pages = max(vr.kv_pages, i + 1)

    def check(self) -> None:
        """The world's invariants, and the two halves' books agree: every question a worker
        holds (asked, or answered and pinned) is one the scheduler still has open, or is about
        to close (`unused`, `forget`)."""
        super().check()
        for inst in self.instances:
            for worker in inst.workers:
                self._check_questions(inst.books, worker)

    def _check_questions(self, books: Any, worker: WorkerCache) -> None:
        step = books._step
        sent = {r for r in (*books._granted, *books._loads) if r not in books._claims}
        open_ = sent | set(books._asked) | {q.request_id for q in step.lookups}
        closing = set(step.unused) | set(step.forget)
        asked = _open_questions(books)
        held = {rid: pair[1] for rid, pair in worker._matched.items()}
        for rid, lookup in (*held.items(), *worker._asking.items()):
            if rid in closing:
                continue
            if rid not in open_:
                raise Violation(
                    f"request {rid}: the worker holds a question the scheduler closed without "
                    "telling it"
                )
            if lookup is not None and asked.get(rid, lookup.computed) != lookup.computed:
                raise Violation(
                    f"request {rid}: the worker holds a question from {lookup.computed} tokens, "
                    f"which the scheduler replaced (from {asked[rid]}) without telling it"
                )

    # the direct engine's operations have no meaning here
    def op_load(self, *_: Any) -> None:
        self.op_step()

    def op_store(self, rid: str, decode: int) -> None:
        self.op_decode(rid, decode)

    def op_poll(self, inst: int = 0) -> None:
        self.op_step(inst)

    def processes(self) -> list[list[Node]]:
        return [inst.ranks for inst in self.instances]

    def release_all(self, i: int) -> None:
        for rid in list(self.instances[i].vreqs):
            self.op_release(rid)

    def reopen(self, i: int) -> None:
        self._open_instance(self.instances[i])


def _layout_fields(
    kv_format: str, dtype: torch.dtype, page_tokens: int, heads: int, rank: int, ranks: int
) -> dict[str, Any]:
    """The layout vLLM's connector makes (`layout_fields`, the real one) for rank `rank` of
    `ranks` whose KV cache dtype is `kv_format` (``--kv-cache-dtype``) in tensors of `dtype`."""
    from vllm.config import CacheConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(page_tokens, num_kv_heads=1, head_size=heads, dtype=dtype)
    vllm_config = SimpleNamespace(
        cache_config=CacheConfig(cache_dtype=kv_format),
        model_config=SimpleNamespace(
            model="sim-model",
            revision=None,
            hf_config=None,
            code_revision=None,
            dtype=dtype,
            disable_sliding_window=False,
            quantization=None,
        ),
        parallel_config=SimpleNamespace(pipeline_parallel_size=1),
        speculative_config=None,
    )
    groups = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec)])
    return layout_fields(vllm_config, groups, "sim-model", rank, ranks)


def _open_questions(books: Any) -> dict[str, int]:
    """The computed tokens of each request's open question on the scheduler's side (the
    newest: asked this step, asked, or answered and granted)."""
    out = {rid: a.computed for rid, a in books._loads.items()}
    out.update((rid, a.computed) for rid, a in books._granted.items())
    out.update(books._asked)
    out.update((q.request_id, q.computed) for q in books._step.lookups)
    return {rid: c for rid, c in out.items() if rid not in books._claims}


def _writer(node: Node, pages: list[tuple[int, Any]]) -> Any:
    """A kernel on `node`'s device that writes `pages` (block, bytes) into its pool."""

    def write() -> None:
        for block, data in pages:
            node.write_block(block, data)

    return write


def _reader(node: Node, rid: str, wanted: list[tuple[int, int, Any]]) -> Any:
    """A kernel on `node`'s device that reads loaded pages and checks them."""

    def read() -> None:
        for i, block, want in wanted:
            if not (node.block(block) == want).all():
                raise Violation(f"request {rid}: page {i} loaded wrong bytes")

    return read
