"""The connector's two halves without a vLLM engine: the scheduler's questions, grants, loads
and stores step by step (vLLM's request and scheduler output reduced to the fields the
connector reads), and the worker's HiCache over CPU tensors shaped as vLLM's, byte for byte."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from types import SimpleNamespace
from typing import Literal

import pytest
import torch
from memory_tier import MISSING, MemoryConfig, MemoryTier
from test_vllm import require_vllm

pytestmark = pytest.mark.vllm
require_vllm()

from vllm import SamplingParams  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: E402
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from hicache import load_config  # noqa: E402
from hicache.config import ConfigError  # noqa: E402
from hicache.integrations.vllm.connector import (  # noqa: E402
    for_rank,
    in_one_line,
    node_index,
)
from hicache.integrations.vllm.inputs import refuse_unsupported  # noqa: E402
from hicache.integrations.vllm.meta import (  # noqa: E402
    Answer,
    Answers,
    HiCacheStats,
    Load,
    Lookup,
    StepMeta,
    Store,
)
from hicache.integrations.vllm.probe import StoreProbe  # noqa: E402
from hicache.integrations.vllm.scheduler import SchedulerBooks  # noqa: E402
from hicache.integrations.vllm.settings import probe_wait_s  # noqa: E402
from hicache.integrations.vllm.view import RankNews  # noqa: E402
from hicache.integrations.vllm.worker import WorkerCache  # noqa: E402
from hicache.registry import register_tier  # noqa: E402

P = 4  # tokens a block


def Req(
    rid: str,
    tokens: list[int],
    salt: str | None = None,
    lora: tuple[str, str] | None = None,
    images: tuple[tuple[str, int, int], ...] = (),
) -> Request:
    """vLLM's own Request: `lora` (name, path); `images` (content hash, offset, length)."""
    features = [
        MultiModalFeatureSpec(None, "image", h, PlaceholderRange(offset=o, length=n))
        for h, o, n in images
    ]
    adapter = LoRARequest(lora[0], len(lora[0]), lora[1]) if lora else None
    return Request(
        rid, list(tokens), SamplingParams(max_tokens=64), None,
        mm_features=features, lora_request=adapter, cache_salt=salt,
    )  # fmt: skip


def advance(r: Request, computed: int, tokens: int) -> None:
    """vLLM computed `computed` tokens of `r`, which has `tokens` (prompt and sampled) now."""
    r.num_computed_tokens = computed
    r.append_output_token_ids(list(range(r.num_tokens, tokens)))


def sched(scheduled=None, tables=None, spec=None) -> SimpleNamespace:
    tables = tables or {}
    state = SimpleNamespace(get_block_ids=lambda rid: (tables[rid],) if rid in tables else None)
    return SimpleNamespace(
        kv_connector_block_state=state,
        num_scheduled_tokens=scheduled or {},
        scheduled_spec_decode_tokens=spec or {},
    )


def answered(books: SchedulerBooks, rank: int, *answers: Answer) -> None:
    books.answered(SimpleNamespace(kv_connector_worker_meta=Answers({rank: list(answers)})))


def test_a_request_waits_for_every_rank_and_is_granted_the_smallest_hit():
    books, r = SchedulerBooks(P, ranks=2), Req("a", list(range(14)))
    assert books.matched_tokens(r, 0) == (None, False)
    assert books.matched_tokens(r, 0) == (None, False)  # asked once, not twice
    assert books.build(sched()).lookups == [Lookup("a", list(range(14)), 0)]
    answered(books, 0, Answer("a", 0, 12, (("host", 12),)))
    assert books.matched_tokens(r, 0) == (None, False)  # rank 1 has not answered
    answered(books, 1, Answer("a", 0, 8, (("host", 4), ("p2p", 4))))
    assert books.matched_tokens(r, 0) == (8, False)
    books.allocated(r, 8)
    assert books.hit_sources(r, 8) == {CacheHitSource.HOST: 4, CacheHitSource.P2P: 4}
    step = books.build(sched({"a": 6}, {"a": [5, 6, 7, 9]}))
    assert (step.lookups, step.loads) == ([], [Load("a", 0, 8, [5, 6, 7, 9])])


def test_vllms_own_hit_changing_asks_again_and_stale_answers_are_ignored():
    books, r = SchedulerBooks(P, ranks=1), Req("a", list(range(14)))
    assert books.matched_tokens(r, 0) == (None, False)
    books.build(sched())
    assert books.matched_tokens(r, 4) == (None, False)  # vLLM's prefix cache grew
    assert books.build(sched()).lookups == [Lookup("a", list(range(14)), 4)]
    answered(books, 0, Answer("a", 0, 12))  # the answer to the first question
    assert books.matched_tokens(r, 4) == (None, False)
    answered(books, 0, Answer("a", 4, 12))
    assert books.matched_tokens(r, 4) == (8, False)


def test_no_question_where_no_block_before_the_last_token_is_left():
    books = SchedulerBooks(P, ranks=1)
    assert books.matched_tokens(Req("short", [1, 2, 3, 4]), 0) == (0, False)
    assert books.matched_tokens(Req("held", list(range(9))), 8) == (0, False)
    assert books.build(sched()).lookups == []


def test_an_answer_not_taken_lets_its_pins_go_and_a_miss_asks_nothing_more():
    books, r, m = SchedulerBooks(P, ranks=1), Req("a", list(range(14))), Req("m", list(range(9)))
    books.matched_tokens(r, 0)
    books.matched_tokens(m, 0)
    books.build(sched())
    answered(books, 0, Answer("a", 0, 12), Answer("m", 0, 0))
    assert books.matched_tokens(m, 0) == (0, False)
    books.allocated(r, 0)  # vLLM took none of it (its blocks ran out, say)
    books.allocated(m, 0)
    step = books.build(sched())
    assert (step.unused, step.loads) == (["a", "m"], [])


def test_stores_follow_completed_pages_with_only_the_new_tokens():
    books, r = SchedulerBooks(P, ranks=1), Req("s", list(range(10)))
    books.matched_tokens(r, 0)
    table = {"s": [3, 1, 4, 2]}
    step = books.build(sched({"s": 10}, table))  # the prefill writes blocks 3 and 1
    # whole pages; the prompt's whole pages end here: its tail goes to the store tiers too
    assert step.stores == [Store("s", 0, list(range(8)), 8, [3, 1, 4, 2], tail=True)]
    advance(r, 10, 11)
    assert books.build(sched({"s": 1}, table)).stores == []  # token 10: no new whole block
    advance(r, 12, 13)
    assert books.build(sched({"s": 1}, table)).stores == [
        Store("s", 8, [8, 9, 10, 11], 12, table["s"])  # a page of the answer: no tail
    ]
    advance(r, 13, 14)
    # three of the four scheduled tokens are speculative: only token 13 is surely written
    assert books.build(sched({"s": 4}, table, {"s": [7, 7, 7]})).stores == []
    # async scheduling: tokens 14.. are not sampled yet, so block 3 cannot be stored
    assert books.build(sched({"s": 4}, table)).stores == []


def test_a_finished_request_is_forgotten_on_both_sides():
    books, r = SchedulerBooks(P, ranks=1), Req("f", list(range(14)))
    books.matched_tokens(r, 0)
    books.finished(r)  # aborted in the step it was asked about: the question is withdrawn
    step = books.build(sched({"f": 4}, {"f": [1]}))
    assert (step.lookups, step.forget, step.stores) == ([], ["f"], [])
    answered(books, 0, Answer("f", 0, 12))
    assert books.matched_tokens(r, 0) == (None, False)  # asked anew, as a new request


# -- the worker ------------------------------------------------------------------------------


PAGE_BYTES = 2 * 2 * P * 8 * 4  # a block of both layers


def worker(
    blocks: int = 16,
    host_pages: int = 2048,
    tiers: tuple[dict, ...] = (),
    pin_share: float = 0.5,
    page: int = P,
) -> tuple[WorkerCache, dict[str, torch.Tensor]]:
    """A WorkerCache over two layers shaped as vLLM's CPU caches: (2, blocks, page, 8) float32
    (`page` tokens a block)."""
    host = {"type": "host", "size": host_pages * PAGE_BYTES}
    config = load_config({"tiers": [host, *tiers]}, env={})
    fields = dict(model="tiny", kv_dtype="float32", page_tokens=page, tp_rank=0, tp_size=1)
    w = WorkerCache(config, {**fields, "kv_head_sharded": True}, pin_share)
    kv = {f"layer.{i}": torch.zeros(2, blocks, page, 8) for i in range(2)}
    w.register(kv, blocks)
    return w, kv


def block(kv: dict[str, torch.Tensor], b: int) -> list[torch.Tensor]:
    return [t[:, b].clone() for t in kv.values()]


def test_worker_stores_answers_and_loads_the_bytes_granted():
    w, kv = worker()
    for t in kv.values():
        t[:, :3] = torch.randn(2, 3, P, 8)
    prompt = list(range(100, 113))
    w.start_load(StepMeta())
    w.save(StepMeta(stores=[Store("a", 0, prompt, 12, [0, 1, 2])]))  # blocks 0..2 hold 12 tokens
    w.start_load(StepMeta(lookups=[Lookup("b", [*prompt[:12], 7, 7], 0), Lookup("c", prompt, 0)]))
    assert w.answers().by_rank == {
        0: [Answer("b", 0, 12, (("host", 12),)), Answer("c", 0, 12, (("host", 12),))]
    }
    assert w.answers() is None
    # b gets all three blocks; c only two (another rank held less): block 13 stays untouched
    w.start_load(StepMeta(loads=[Load("b", 0, 12, [7, 8, 9, 10]), Load("c", 0, 8, [11, 12, 13])]))
    for src, dst in ((0, 7), (1, 8), (2, 9), (0, 11), (1, 12)):
        assert all(torch.equal(a, b) for a, b in zip(block(kv, src), block(kv, dst)))
    assert all(not t[:, 13].any() for t in kv.values())
    assert w.load_errors() == set()
    stats = w.cache.stats()
    assert (stats["host_pinned"], stats["requests"], stats["hit_tokens_host"]) == (0, 0, 20)


def test_worker_reports_a_load_it_cannot_make_and_copies_nothing():
    w, kv = worker()
    w.start_load(StepMeta(lookups=[Lookup("d", list(range(13)), 0)]))
    assert w.answers().by_rank == {0: [Answer("d", 0, 0)]}  # nothing stored: a miss
    w.start_load(StepMeta(loads=[Load("d", 0, 8, [5, 6, 7]), Load("e", 4, 12, [1, 2, 3])]))
    assert w.load_errors() == {5, 6, 2, 3}
    assert w.load_errors() == set()
    assert all(not t.any() for t in kv.values())
    assert w.cache.stats()["requests"] == 0


def test_worker_lets_pins_go_for_an_answer_not_taken_and_a_forgotten_request():
    w, _ = worker()
    prompt = list(range(13))
    w.start_load(StepMeta())
    w.save(StepMeta(stores=[Store("a", 0, prompt, 12, [0, 1, 2])]))
    w.start_load(StepMeta(lookups=[Lookup("u", prompt, 0), Lookup("f", prompt, 0)]))
    assert w.cache.stats()["host_pinned"] == 3  # both hits pin the same three slots
    w.start_load(StepMeta(unused=["u"], forget=["f"]))
    stats = w.cache.stats()
    assert (stats["host_pinned"], stats["requests"], stats["host_used"]) == (0, 0, 3)


def test_worker_keys_pages_by_the_requests_cache_salt():
    w, _ = worker()
    prompt = list(range(13))
    w.start_load(StepMeta())
    w.save(StepMeta(stores=[Store("a", 0, prompt, 12, [0, 1, 2], salt="tenant-1")]))
    w.start_load(StepMeta(lookups=[Lookup("b", prompt, 0, "tenant-2"), Lookup("c", prompt, 0)]))
    w.start_load(StepMeta(lookups=[Lookup("d", prompt, 0, "tenant-1")]))
    hits = [(a.request_id, a.hit) for a in w.answers().by_rank[0]]
    assert hits == [("b", 0), ("c", 0), ("d", 12)]


def test_worker_reports_what_its_counters_gained_to_vllms_connector_stats():
    w, _ = worker()
    prompt = list(range(13))
    w.start_load(StepMeta())
    w.save(StepMeta(stores=[Store("a", 0, prompt, 12, [0, 1, 2])]))
    assert w.stats() == HiCacheStats({"pages_stored": 3})
    assert w.stats() is None  # nothing since
    w.start_load(StepMeta(lookups=[Lookup("b", prompt, 0)]))
    w.start_load(StepMeta(loads=[Load("b", 0, 12, [4, 5, 6])]))
    got = w.stats()
    assert got == HiCacheStats({"hit_tokens_host": 12, "pages_loaded": 3})
    assert got.aggregate(HiCacheStats({"pages_loaded": 2})).reduce() == {
        "hit_tokens_host": 12,
        "pages_loaded": 5,
    }


# -- both halves, step by step ----------------------------------------------------------------


class Engine:
    """The scheduler half and one worker wired as vLLM wires them, one `step` at a time."""

    def __init__(self, w: WorkerCache, books: SchedulerBooks | None = None) -> None:
        self.page = w.layout.page_tokens
        self.books, self.w = books or SchedulerBooks(self.page, ranks=1, in_step=False), w
        self.next_block = 0

    def step(self, scheduled=None, tables=None, spec=None) -> StepMeta:
        meta = self.books.build(sched(scheduled, tables, spec))
        self.w.bind_step(meta)
        self.w.start_load(meta)
        self.w.save(meta)
        self.books.answered(SimpleNamespace(kv_connector_worker_meta=self.w.answers()))
        return meta

    def ask(self, r: Request, computed: int = 0) -> int:
        """The hit granted to `r` once the worker has answered (vLLM takes none of it)."""
        assert self.books.matched_tokens(r, computed) == (None, False)
        self.step()
        hit, _ = self.books.matched_tokens(r, computed)
        self.books.allocated(r, 0)
        return computed + hit

    def prefill(self, r: Request) -> list[int]:
        """vLLM prefills `r` in one step from scratch (no hit): its blocks, now stored."""
        if self.books.matched_tokens(r, 0)[0] is None:
            self.step()
            self.books.matched_tokens(r, 0)
        self.books.allocated(r, 0)
        table = list(range(self.next_block, self.next_block + r.num_tokens // self.page + 1))
        self.next_block += len(table)
        self.step({r.request_id: r.num_tokens}, {r.request_id: table})
        return table


def test_two_lora_adapters_never_share_pages_and_an_adapter_is_its_name_and_path():
    """The same prompt under adapter alpha, then asked under beta, under alpha re-pointed at
    another path, without an adapter, and under alpha with another of vLLM's per-process ids."""
    e = Engine(worker(blocks=32)[0])
    prompt = list(range(13))
    e.prefill(Req("a", prompt, lora=("alpha", "/adapters/alpha")))
    assert e.ask(Req("b", prompt, lora=("beta", "/adapters/beta"))) == 0
    assert e.ask(Req("c", prompt, lora=("alpha", "/adapters/alpha-v2"))) == 0
    assert e.ask(Req("d", prompt)) == 0
    again = Req("e", prompt, lora=("alpha", "/adapters/alpha"))
    again.lora_request.lora_int_id = 77
    assert e.ask(again) == 12
    # a tenant salt and an adapter together: both must agree
    e.prefill(Req("f", prompt, salt="t1", lora=("beta", "/adapters/beta")))
    assert e.ask(Req("g", prompt, salt="t2", lora=("beta", "/adapters/beta"))) == 0
    assert e.ask(Req("h", prompt, salt="t1", lora=("beta", "/adapters/beta"))) == 12


def test_two_images_behind_the_same_placeholder_ids_share_only_the_pages_before_them():
    """Pages of 8 tokens; tokens 8..23 are an image's placeholders (the same ids for every
    image): the first page is text alone and shared; from the image's first page on, only the
    same image hits."""
    e = Engine(worker(blocks=32, page=8)[0])
    prompt = [7] * 8 + [99] * 16 + list(range(9))  # 33 tokens, 4 pages before the last token
    e.prefill(Req("a", prompt, images=(("cat", 8, 16),)))
    assert e.ask(Req("b", prompt, images=(("dog", 8, 16),))) == 8
    assert e.ask(Req("c", prompt)) == 8  # the placeholder ids as text
    assert e.ask(Req("d", prompt, images=(("cat", 8, 16),))) == 32
    assert e.ask(Req("e", prompt, images=(("cat", 16, 8),))) == 8  # the same image, elsewhere


def test_no_cache_salt_names_a_lora_adapters_namespace():
    """A client's cache_salt that spells out another request's salt and adapter (as the old
    JSON salt of an adapter did) is a tenant of its own: it never reads the adapter's pages."""
    e = Engine(worker(blocks=32)[0])
    prompt = list(range(13))
    e.prefill(Req("a", prompt, lora=("alpha", "/adapters/alpha")))
    forged = '{"salt":null,"lora":["alpha","/adapters/alpha"]}'
    assert e.ask(Req("b", prompt, salt=forged)) == 0
    e.prefill(Req("c", prompt, salt="t1", lora=("beta", "/b")))
    assert e.ask(Req("d", prompt, salt='{"salt":"t1","lora":["beta","/b"]}')) == 0
    assert e.ask(Req("e", prompt, lora=("alpha", "/adapters/alpha"))) == 12


def test_an_image_is_keyed_by_its_whole_hash_where_one_placeholder_lies_on_a_page():
    """img-8548 and img-19451 agree in 31 bits of a SHA-256 of their identifiers (a birthday
    search over img-0, img-1, ... finds the pair at 19,452): behind one placeholder at the end
    of a page of 8 tokens, the page is still the image's alone."""
    e = Engine(worker(blocks=32, page=8)[0])
    prompt = [7] * 7 + [99] + list(range(5, 14))  # the image's one placeholder ends page 0
    e.prefill(Req("a", prompt, images=(("img-8548", 7, 1),)))
    assert e.ask(Req("b", prompt, images=(("img-19451", 7, 1),))) == 0
    assert e.ask(Req("c", prompt, images=(("img-8548", 7, 1),))) == 16


def test_an_image_is_keyed_by_its_whole_hash_on_pages_of_one_token():
    """A page of one token is one word, 31 bits: img-2574 and img-41150 give the image's page
    the same word (a birthday search over img-0, img-1, ... finds the pair at 41,150). Where
    pages are too short to carry 128 bits of an image's hash, every page of a request with
    images is keyed in a namespace of its images' whole hashes and positions: b misses, c (the
    same image where a had it) hits the 8 pages before its last token. Before, b was served
    a's pages, the image's page included."""
    e = Engine(worker(blocks=32, page=1)[0])
    prompt = [7, 7, 7, 99, 5, 6, 7, 8, 9]  # the image's one placeholder is page 3
    e.prefill(Req("a", prompt, images=(("img-2574", 3, 1),)))
    assert e.ask(Req("b", prompt, images=(("img-41150", 3, 1),))) == 0
    assert e.ask(Req("c", prompt, images=(("img-2574", 3, 1),))) == 8
    assert e.ask(Req("d", prompt, images=(("img-2574", 4, 1),))) == 0  # elsewhere


def test_prompt_embeddings_are_refused_at_start_in_one_line():
    config = SimpleNamespace(model_config=SimpleNamespace(enable_prompt_embeds=True))
    with pytest.raises(ConfigError, match=r"^hicache: prompt embeddings .* not supported"):
        refuse_unsupported(config)
    refuse_unsupported(SimpleNamespace(model_config=SimpleNamespace(enable_prompt_embeds=False)))


def test_a_question_vllms_own_cache_then_covers_lets_its_pins_go_and_stores_go_on():
    """The question is out and answered by the worker, but before the scheduler reads the
    answer vLLM's own prefix cache comes to cover the prompt: the question is withdrawn, the
    worker's pins go, and the request's later stores are made."""
    w, _ = worker(blocks=32)
    e = Engine(w)
    e.prefill(Req("a", list(range(13))))
    q = Req("q", list(range(21)))
    assert e.books.matched_tokens(q, 0) == (None, False)
    meta = e.books.build(sched())
    w.start_load(meta)  # the worker answers a hit of 12 and pins it
    assert w.cache.stats()["host_pinned"] == 3
    assert e.books.matched_tokens(q, 20) == (0, False)  # vLLM's own cache holds 20 tokens
    e.books.allocated(q, 0)
    e.books.answered(SimpleNamespace(kv_connector_worker_meta=w.answers()))  # too late
    q.num_computed_tokens = 20
    stored = w.cache.stats()["pages_stored"]
    e.step({"q": 1}, {"q": list(range(20, 26))})
    stats = w.cache.stats()
    assert (stats["host_pinned"], stats["requests"]) == (0, 0)
    assert stats["pages_stored"] - stored == 2  # pages 3 and 4 of q


def test_no_store_takes_a_block_whose_load_failed_nor_a_page_after_it_in_any_step():
    """A load of pages 1-2 fails (the worker was never asked: nothing pinned), vLLM computed
    page 0 itself. The same step's store, and a later one, store page 0 only: the failed
    blocks hold what vLLM will recompute, and the pages after them were computed from them."""
    w, _ = worker()
    prompt = list(range(100, 117))
    w.start_load(StepMeta(loads=[Load("b", 4, 12, [0, 1, 2])]))
    assert w.load_errors() == {1, 2}
    w.save(StepMeta(stores=[Store("b", 0, prompt[:13], 13, [0, 1, 2, 3])]))
    w.start_load(StepMeta())
    w.save(StepMeta(stores=[Store("b", 13, prompt[13:], 17, [0, 1, 2, 3, 4])]))
    w.start_load(StepMeta(lookups=[Lookup("c", prompt, 0)]))
    assert w.answers().by_rank == {0: [Answer("c", 0, 4, (("host", 4),))]}
    assert w.cache.stats()["pages_stored"] == 1


def test_a_request_sharing_a_failed_block_in_that_step_does_not_store_from_it():
    w, _ = worker()
    w.start_load(StepMeta(loads=[Load("b", 0, 8, [5, 6])]))
    assert w.load_errors() == {5, 6}
    # another request whose table holds block 6 (vLLM's prefix cache shared it) in that step
    w.save(StepMeta(stores=[Store("o", 0, list(range(16)), 16, [4, 6, 7, 8])]))
    w.start_load(StepMeta(lookups=[Lookup("c", list(range(17)), 0)]))
    assert w.answers().by_rank[0][0].hit == 4


def stored_through(w: WorkerCache, prompt: list[int]) -> None:
    """The worker stores the prompt's first 12 tokens (blocks 0-2), and its store tiers take
    them (waited for, at most a minute)."""
    w.start_load(StepMeta())
    w.save(StepMeta(stores=[Store("a", 0, prompt, 12, [0, 1, 2])]))
    deadline = time.monotonic() + 60
    while not w.cache.tiers_idle and time.monotonic() < deadline:
        w.cache.poll()
        time.sleep(0.01)


def answered_by(w: WorkerCache, lookup: Lookup) -> Answer:
    """The worker's answer to `lookup`, asked in one step and waited for (at most a minute);
    the question is then closed unused (its pins go)."""
    w.start_load(StepMeta(lookups=[lookup]))
    deadline = time.monotonic() + 60
    while not (got := (w.answers() or Answers()).by_rank) and time.monotonic() < deadline:
        time.sleep(0.01)
        w.start_load(StepMeta())
    w.start_load(StepMeta(unused=[lookup.request_id]))
    return got[w.rank][0]


class LyingTier(MemoryTier):
    """A shared in-memory store whose reads return `code(n)` for an object of n bytes
    without filling it: 0 (a miss said as zero bytes) or a short count."""

    code = staticmethod(lambda n: 0)

    def get_into(self, keys, buffers) -> list[int]:
        self._check("get", len(keys))
        return [self.code(buffers.nbytes(i)) if k in self.objects else MISSING
                for i, k in enumerate(keys)]  # fmt: skip


class LyingConfig(MemoryConfig):
    type: Literal["lying"] = "lying"  # type: ignore[assignment]


register_tier("lying", LyingConfig)(LyingTier)


@pytest.mark.parametrize("code", [lambda n: 0, lambda n: n - 1], ids=["zero", "short"])
def test_a_read_counts_only_where_it_returned_the_objects_exact_size(code, monkeypatch):
    """A first worker puts a prompt's groups to the store; a second (its own empty host tier)
    reads them back through a tier that answers 0, or a byte short, without filling the
    buffers: no hit, nothing published in the host tier."""
    monkeypatch.setattr(LyingTier, "code", staticmethod(code))
    tier = {"type": "lying", "space": uuid.uuid4().hex, "group_pages": 1}
    first, _ = worker(tiers=(tier,))
    prompt = list(range(100, 113))
    stored_through(first, prompt)
    assert len(LyingTier.spaces[tier["space"]]) == 3
    second, _ = worker(tiers=(tier,))
    assert answered_by(second, Lookup("b", prompt, 0)) == Answer("b", 0, 0)
    stats = second.cache.stats()
    assert (stats["host_used"], stats["hit_tokens_host"]) == (0, 0)
    first.close()
    second.close()


def test_answered_hits_pin_at_most_their_share_and_a_running_requests_store_is_kept():
    """A host tier of 16 pages holds three stored prompts of 4 pages; three waiting requests
    are answered hits of 4 pages each (12). With half the tier for answers, the third answer
    is given unpinned, a running request's store of 8 new pages drops nothing, and the third
    request's load finds its pages evicted: vLLM recomputes them, nothing wrong is served."""
    w, kv = worker(blocks=64, host_pages=16)
    e = Engine(w)
    prompts = [[k * 1000 + i for i in range(17)] for k in range(3)]
    stored = [e.prefill(Req(f"s{k}", p)) for k, p in enumerate(prompts)]
    waiting = [Req(f"w{k}", p) for k, p in enumerate(prompts)]
    for r in waiting:
        assert e.books.matched_tokens(r, 0) == (None, False)
    e.step()
    assert [e.books.matched_tokens(r, 0) for r in waiting] == [(16, False)] * 3
    assert w.cache.stats()["host_pinned"] == 8
    dropped = w.cache.stats()["pages_dropped"]
    e.prefill(Req("run", list(range(5000, 5033))))  # 8 new pages
    assert w.cache.stats()["pages_dropped"] == dropped
    for r in waiting:
        e.books.allocated(r, 16)
    tables = {r.request_id: list(range(40 + 5 * k, 45 + 5 * k)) for k, r in enumerate(waiting)}
    e.step({r.request_id: 1 for r in waiting}, tables)
    assert w.load_errors() == set(tables["w2"][:4])
    for src, dst in zip(stored[0][:4] + stored[1][:4], tables["w0"][:4] + tables["w1"][:4]):
        assert all(torch.equal(a, b) for a, b in zip(block(kv, src), block(kv, dst)))
    assert (w.cache.stats()["host_pinned"], w.cache.stats()["requests"]) == (0, 0)


def test_a_worker_out_of_step_asks_for_the_tokens_again_and_stores_again():
    """A store the worker never saw (a lost step): it skips the next one and asks the
    scheduler to send the request's tokens from the first; the store after that is made."""
    w, _ = worker(blocks=32)
    e = Engine(w)
    r = Req("s", list(range(10)))
    e.prefill(r)
    advance(r, 10, 13)
    e.books.build(sched({"s": 3}, {"s": [0, 1, 2, 3]}))  # this step never reaches the worker
    advance(r, 13, 17)
    e.step({"s": 4}, {"s": [0, 1, 2, 3, 4]})
    assert w.cache.stats()["pages_stored"] == 2  # the prefill's pages only
    advance(r, 17, 21)
    meta = e.step({"s": 4}, {"s": [0, 1, 2, 3, 4, 5]})
    assert (meta.stores[0].sent_before, len(meta.stores[0].new_tokens)) == (0, 20)
    assert w.cache.stats()["pages_stored"] == 5


def test_the_drafters_reprefillable_tokens_are_not_stored():
    """With an EAGLE-style drafter vLLM holds the last computed token as not final (one
    re-prefillable token): a prefill of 12 tokens stores 2 pages, not 3."""
    books = SchedulerBooks(P, ranks=1, reprefillable=1)
    r = Req("s", list(range(12)))
    books.matched_tokens(r, 0)
    books.allocated(r, 0)
    assert books.build(sched({"s": 12}, {"s": [0, 1, 2]})).stores == [
        Store("s", 0, list(range(8)), 8, [0, 1, 2])
    ]


def test_the_workers_feed_vllms_prefill_speed_to_the_cost_model():
    tier = {"type": "memory", "space": uuid.uuid4().hex, "group_pages": 1}
    w, _ = worker(tiers=(tier,))
    e = Engine(w)
    assert w.cache.stats()["prefill_tokens_per_s"] == 20_000  # the model's starting guess
    r = Req("p", list(range(2000)))
    e.books.matched_tokens(r, 0)
    e.step()
    e.books.matched_tokens(r, 0)
    e.books.allocated(r, 0)
    e.w.bind_step = _slow(e.w.bind_step)
    e.step({"p": 2000}, {"p": list(range(16))})
    e.step()  # the timed step is read at the next one
    assert 0 < w.cache.stats()["prefill_tokens_per_s"] < 20_000
    w.close()


def _slow(bind_step):
    def wrapped(meta):
        bind_step(meta)
        time.sleep(0.5 if meta.prefill_tokens else 0)  # a forward of 2000 tokens in 0.5 s

    return wrapped


def test_each_rank_gets_its_own_store_directory(tmp_path):
    config = load_config({"tiers": [
        {"type": "host", "size": "1MiB"},
        {"type": "disk", "path": str(tmp_path / "d"), "size": "1GiB"},
        {"type": "disk", "name": "other", "path": str(tmp_path / "e-{rank}"), "size": "1GiB"},
    ], "metrics": {"port": 9400}}, env={})  # fmt: skip
    paths = {r: [t.path for t in for_rank(config, r).tiers[1:]] for r in (0, 1)}
    assert paths == {
        r: [str(tmp_path / "d" / f"rank{r}"), str(tmp_path / f"e-{r}")] for r in (0, 1)
    }
    assert [for_rank(config, r).metrics.port for r in (0, 1)] == [9400, 9401]


def test_a_start_error_is_logged_and_raised_as_one_line(caplog):
    def start():
        raise ValueError("size: 64 GiB is more than this machine has available (9 GiB)\nmore")

    with caplog.at_level(logging.ERROR, logger="hicache"), pytest.raises(ConfigError) as err:
        in_one_line("TP rank 1", start)
    line = "hicache: TP rank 1: size: 64 GiB is more than this machine has available (9 GiB)"
    assert str(err.value) == line
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(logging.ERROR, line)]


# -- answers in the step they are asked --------------------------------------------------------


def in_step_engine(**kw) -> tuple[Engine, dict[str, torch.Tensor]]:
    w, kv = worker(blocks=64, **kw)
    return Engine(w, SchedulerBooks(P, ranks=1)), kv


def test_a_host_hit_and_a_miss_are_answered_in_the_step_they_are_asked():
    """Once the worker's news has reached the scheduler, a prompt whose pages the host tier
    holds is granted at once (no question, nothing pinned until the load), the load matches and
    copies the exact bytes, and a prompt with nothing to reuse is a miss at once."""
    e, kv = in_step_engine()
    for t in kv.values():
        t[:, :8] = torch.randn(2, 8, P, 8)
    prompt = list(range(100, 117))
    stored = e.prefill(Req("a", prompt))
    assert e.books.view.ready
    b, c = Req("b", [*prompt, 5, 6]), Req("c", list(range(900, 917)))
    assert e.books.matched_tokens(b, 0) == (16, False)
    assert e.books.matched_tokens(c, 0) == (0, False)
    assert e.w.cache.stats()["host_pinned"] == 0
    e.books.allocated(b, 16)
    e.books.allocated(c, 0)
    assert e.books.hit_sources(b, 16) == {CacheHitSource.HOST: 16}
    meta = e.step({"b": 3, "c": 17}, {"b": [40, 41, 42, 43, 44], "c": [50, 51, 52, 53, 54]})
    assert (meta.lookups, meta.unused) == ([], [])
    assert meta.loads == [Load("b", 0, 16, [40, 41, 42, 43, 44], [*prompt, 5, 6], None)]
    assert e.w.load_errors() == set()
    for src, dst in zip(stored[:4], [40, 41, 42, 43]):
        assert all(torch.equal(x, y) for x, y in zip(block(kv, src), block(kv, dst)))
    stats = e.w.cache.stats()
    assert (stats["host_pinned"], stats["requests"], stats["hit_tokens_host"]) == (0, 0, 16)


def test_the_view_keys_pages_by_salt_and_grants_no_more_than_a_rank_holds():
    """The view's keys are the worker's: another tenant's salt misses; vLLM's own hit of the
    first page leaves the next three to hicache; a prompt one page longer than what was stored
    is granted what is stored."""
    e, _ = in_step_engine()
    prompt = list(range(100, 117))
    e.prefill(Req("a", prompt, salt="t1"))
    assert e.books.matched_tokens(Req("x", prompt, salt="t2"), 0) == (0, False)
    assert e.books.matched_tokens(Req("y", prompt, salt="t1"), 4) == (12, False)
    longer = Req("z", [*prompt[:16], *range(7, 12)], salt="t1")
    assert e.books.matched_tokens(longer, 0) == (16, False)


def test_a_page_gone_after_the_view_granted_it_is_recomputed_not_served():
    """The view grants four pages; before the load, a flood of stores evicts them from the
    host tier (8 pages): the load matches again, finds less, copies nothing wrong and reports
    the granted blocks it did not fill; the scheduler learns of the eviction."""
    e, kv = in_step_engine(host_pages=8)
    prompt = list(range(100, 117))
    e.prefill(Req("a", prompt))
    b = Req("b", [*prompt, 1])
    assert e.books.matched_tokens(b, 0) == (16, False)
    e.books.allocated(b, 16)
    for k in range(2):  # 8 pages of other prompts: a's four are evicted
        e.prefill(Req(f"f{k}", [k * 1000 + i for i in range(17)]))
    before = {i: block(kv, i) for i in (60, 61, 62, 63)}
    e.step({"b": 1}, {"b": [60, 61, 62, 63, 20]})
    assert e.w.load_errors() == {60, 61, 62, 63}
    for i, held in before.items():
        assert all(torch.equal(x, y) for x, y in zip(block(kv, i), held))
    assert e.books.matched_tokens(Req("c", [*prompt, 2]), 0) == (0, False)
    assert (e.w.cache.stats()["host_pinned"], e.w.cache.stats()["requests"]) == (0, 0)


@pytest.mark.parametrize(
    ("tier", "asks"),
    [("memory", True), ("memory_private", False)],
    ids=["shared tier: asked", "private tier: answered"],
)
def test_a_store_tier_the_view_cannot_see_is_asked(tier, asks):
    """A shared store tier may hold another instance's pages: a miss in the host tier is
    asked of the workers. A private tier holds only what this process put: a miss is answered
    at once, and a page it took (and the host tier then lost) is asked, to be fetched."""
    store = {"type": tier, "space": uuid.uuid4().hex, "group_pages": 1}
    e, _ = in_step_engine(host_pages=8, tiers=(store,))
    e.prefill(Req("a", list(range(100, 117))))
    got, _ = e.books.matched_tokens(Req("m", list(range(900, 917))), 0)
    assert (got is None) == asks
    if asks:
        return
    deadline = time.monotonic() + 60
    while not e.w.cache.tiers_idle and time.monotonic() < deadline:
        e.step()  # the write-behind's news reaches the scheduler
        time.sleep(0.01)
    for k in range(2):  # the host tier loses a's pages; the private tier keeps them
        e.prefill(Req(f"f{k}", [k * 1000 + i for i in range(17)]))
    assert e.books.matched_tokens(Req("b", list(range(100, 118))), 0) == (None, False)


def test_with_two_ranks_the_view_answers_only_once_both_have_reported():
    books = SchedulerBooks(P, ranks=2)
    fp = b"\x01" * 16
    r = Req("a", list(range(13)))
    books.answered(SimpleNamespace(kv_connector_worker_meta=Answers(news={0: RankNews(fp, False)})))
    assert books.matched_tokens(r, 0) == (None, False)
    books.finished(r)
    books.answered(SimpleNamespace(kv_connector_worker_meta=Answers(news={1: RankNews(fp, False)})))
    assert books.matched_tokens(Req("b", list(range(13))), 0) == (0, False)


def test_loads_go_layer_by_layer_unless_layers_share_one_tensor():
    """Each layer with a tensor of its own: the HiCache loads by layer and vLLM's per-layer
    waits reach it (no-ops on the CPU, where the copies are done when the load returns); two
    layers over one tensor (vLLM's KV sharing): whole loads."""
    w, kv = worker()
    assert w.cache.layers == 2
    prompt = list(range(100, 113))
    for t in kv.values():
        t[:, :3] = torch.randn(2, 3, P, 8)
    w.start_load(StepMeta())
    w.save(StepMeta(stores=[Store("a", 0, prompt, 12, [0, 1, 2])]))
    w.start_load(StepMeta(lookups=[Lookup("b", prompt, 0)]))
    w.start_load(StepMeta(loads=[Load("b", 0, 12, [5, 6, 7])]))
    for name in kv:
        w.wait_layer(name)
    w.wait_layer("not.a.layer")
    w.save(StepMeta())
    for src, dst in ((0, 5), (1, 6), (2, 7)):
        assert all(torch.equal(a, b) for a, b in zip(block(kv, src), block(kv, dst)))
    config = load_config({"tiers": [{"type": "host", "size": 64 * PAGE_BYTES}]}, env={})
    fields = dict(model="tiny", kv_dtype="float32", page_tokens=P, tp_rank=0, tp_size=1)
    shared = WorkerCache(config, {**fields, "kv_head_sharded": True})
    one = torch.zeros(2, 16, P, 8)
    shared.register({"layer.0": one, "layer.1": one}, 16)
    assert shared.cache.layers == 0
    shared.close()
    w.close()


def test_the_view_walks_long_prompts_and_bounds_what_it_keeps_of_store_tiers(monkeypatch):
    """A 40-page prompt whose first 37 pages the host holds: the walk (in doubling steps) stops
    at page 37; a store tier's group end past it sends the question to the workers; past
    LOWER_KEYS_MAX group ends the rank's store tiers count as unknown (every miss is asked)."""
    from hicache.core.keys import chain_seed, page_keys
    from hicache.integrations.vllm import view as view_module

    fp = b"\x07" * 16
    tokens = list(range(40 * P + 1))
    keys = page_keys(chain_seed(fp, None), torch.tensor(tokens, dtype=torch.int32).numpy(), P)
    v = view_module.TierView(ranks=1, page_tokens=P)
    v.update({0: RankNews(fp, False, stored=keys[:37])})
    assert v.hit_pages(tokens, None, 0, 40) == 37
    assert v.hit_pages(tokens, "other", 0, 40) == 0
    v.update({0: RankNews(fp, False, removed=[keys[20]])})
    assert v.hit_pages(tokens, None, 0, 40) == 20
    v.update({0: RankNews(fp, False, lower=[keys[30]])})
    assert v.hit_pages(tokens, None, 0, 40) is None
    monkeypatch.setattr(view_module, "LOWER_KEYS_MAX", 2)
    v.update({0: RankNews(fp, False, lower=[b"\x01" * 16, b"\x02" * 16])})
    assert v.hit_pages(list(range(9000, 9041)), None, 0, 10) is None


@pytest.mark.parametrize("later", [4, 16], ids=["granted from the view", "a miss in the view"])
def test_a_superseded_question_lets_its_pins_go_and_the_request_loads_and_stores(later):
    """The question of q (computed 0) is asked before the view has news, and the worker pins
    its hit of 4 pages. vLLM's own prefix cache then grows (computed `later`): the new question
    is answered from the view, as a grant of the pages past vLLM's or as nothing to load. The
    old question is closed on the worker: its pins go, the later grant loads the exact bytes
    without load errors, and the request's pages are stored."""
    w, kv = worker(blocks=64)
    for t in kv.values():
        t[:, :4] = torch.randn(2, 4, P, 8)
    prompt = list(range(100, 117))
    w.start_load(StepMeta())
    w.save(StepMeta(stores=[Store("a", 0, prompt, 16, [0, 1, 2, 3])]))
    e = Engine(w, SchedulerBooks(P, ranks=1))
    q = Req("q", [*prompt, *range(7, 15)])  # 25 tokens: 6 pages
    assert e.books.matched_tokens(q, 0) == (None, False)
    e.step()
    assert w.cache.stats()["host_pinned"] == 4
    assert e.books.matched_tokens(q, later) == (16 - later, False)
    e.books.allocated(q, 16 - later)
    q.num_computed_tokens = 16
    table = list(range(40, 47))
    stored = w.cache.stats()["pages_stored"]
    e.step({"q": 9}, {"q": table})
    assert w.load_errors() == set()
    for src in range(later // P, 4):
        assert all(torch.equal(x, y) for x, y in zip(block(kv, src), block(kv, table[src])))
    stats = w.cache.stats()
    assert (stats["host_pinned"], stats["requests"]) == (0, 0)
    assert stats["pages_stored"] - stored == 2  # pages 4 and 5 of q


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    """A tiny Llama saved once for the module (vLLM loads its config; its weights are
    digested); tests that change it work on a copy."""
    import subprocess
    import sys

    root = tmp_path_factory.mktemp("models") / "llama"
    make = [sys.executable, "-m", "hicache.tools.vllm_run", "--model", str(root)]
    subprocess.run([*make, "--make-model", "llama"], check=True, capture_output=True)
    return str(root)


def test_the_model_identity_changes_with_anything_that_changes_the_kv(tiny_llama, tmp_path):
    """vLLM's ModelConfig of one saved model, loaded as is, in another dtype, with RoPE
    scaling or a sliding window overridden, and after its weights are re-saved in place (same
    name, size and config): five names, so none of them shares pages with another."""
    import shutil

    from vllm.config import ModelConfig

    from hicache.integrations.vllm.worker import model_identity

    folder = tmp_path / "llama"
    shutil.copytree(tiny_llama, folder)

    def identity(**kw) -> str:
        config = ModelConfig(model=str(folder), skip_tokenizer_init=True, **kw)
        return model_identity(config)

    names = [
        identity(dtype="float32"),
        identity(dtype="bfloat16"),
        identity(
            dtype="float32", hf_overrides={"rope_scaling": {"rope_type": "linear", "factor": 2.0}}
        ),
        identity(dtype="float32", hf_overrides={"sliding_window": 64}),
    ]
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 1
    weights.write_bytes(bytes(data))
    names.append(identity(dtype="float32"))
    assert len(set(names)) == 5
    assert all(name.startswith(f"{folder}@main:") for name in names)


def test_the_view_asks_about_a_store_group_that_ends_past_the_cap():
    """Host pages 0-1, a store tier's group of pages 2-4 (its end: page 4); the engine may skip
    4 pages (the cap): the workers would fetch the group and load pages 2-3, so the view asks."""
    from hicache.core.keys import chain_seed, page_keys
    from hicache.integrations.vllm.view import TierView

    fp = b"\x07" * 16
    tokens = list(range(5 * P + 1))
    keys = page_keys(chain_seed(fp, None), torch.tensor(tokens, dtype=torch.int32).numpy(), P)
    v = TierView(ranks=1, page_tokens=P)
    v.update({0: RankNews(fp, False, stored=keys[:2], lower=[keys[4]])})
    assert v.hit_pages(tokens, None, 0, 4) is None
    assert v.hit_pages(tokens[: 4 * P + 1], None, 0, 4) == 2  # the group's tokens are not there


def test_the_view_keeps_nothing_per_salt():
    """20,000 tenants asking once each leave the view no larger (the worker's news aside)."""
    import tracemalloc

    from hicache.integrations.vllm import view as view_module
    from hicache.integrations.vllm.view import TierView

    fp = b"\x07" * 16
    v = TierView(ranks=1, page_tokens=P)
    v.update({0: RankNews(fp, False)})
    tokens = list(range(3 * P + 1))
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for i in range(20_000):
        assert v.hit_pages(tokens, f"tenant-{i}", 0, 3) == 0
    grown = tracemalloc.take_snapshot().compare_to(before, "filename")
    tracemalloc.stop()
    mine = [d.size_diff for d in grown if d.traceback[0].filename == view_module.__file__]
    assert sum(mine) < 64 * 1024


def test_two_dp_engines_on_a_node_get_their_own_directories_and_ports(tmp_path):
    """DP 2 x TP 2 on one node (vLLM's config as each DP engine's workers see it: a dense
    model's engine is reconfigured as DP 1, its local DP rank and DP index kept): four
    workers, four disk directories, four metrics ports."""
    from vllm.config import ParallelConfig

    config = load_config({"tiers": [
        {"type": "host", "size": "1MiB"},
        {"type": "disk", "path": str(tmp_path / "d"), "size": "1GiB"},
    ], "metrics": {"port": 9400}}, env={})  # fmt: skip
    seen = []
    for dp in (0, 1):
        pc = ParallelConfig(data_parallel_size=2, data_parallel_rank=dp, tensor_parallel_size=2)
        pc.data_parallel_rank_local = dp
        pc.reconfigure_for_independent_dp_rank()
        for tp in (0, 1):
            mine = for_rank(config, node_index(SimpleNamespace(parallel_config=pc), tp, 2))
            seen.append((mine.tiers[1].path, mine.metrics.port))
    assert len({path for path, _ in seen}) == len({port for _, port in seen}) == 4
    assert seen[0] == (str(tmp_path / "d" / "rank0"), 9400)  # without DP: as before


# -- store-tier hits answered in the step, from the scheduler's own probe ----------------------


Tensors = dict[str, torch.Tensor]


def mooncake_pair(
    master, wait_s: float = 30.0, in_step: bool = True, group_pages: int = 1, codec: str = "none"
) -> tuple[Engine, Engine, Tensors, Tensors, StoreProbe]:
    """Two instances on one Mooncake store node: `a` (view answers only) writes, `b` answers
    from its view and a probe of its own (waiting `wait_s`; generous by default: the machine
    may be busy), or with `in_step` false asks its worker every time."""
    tier = {"type": "mooncake", **master.tier_config, "group_pages": group_pages, "codec": codec}
    wa, kva = worker(blocks=64, tiers=(tier,))
    wb, kvb = worker(blocks=64, tiers=(tier,))
    for w in (wa, wb):
        master.track(w.cache)  # closed before the master stops
    config = load_config({"tiers": [{"type": "host", "size": "1MiB"}, tier]}, env={})
    probe = StoreProbe.for_config(config, wait_s=wait_s)
    assert probe is not None
    master.track(probe._tier)
    assert probe._tier.wait_ready(60)
    a = Engine(wa, SchedulerBooks(P, ranks=1))
    b = Engine(wb, SchedulerBooks(P, ranks=1, in_step=in_step, probe=probe))
    b.step()  # b's worker reports (an empty host tier, a shared store tier)
    for t in kva.values():
        t[:, :8] = torch.randn(2, 8, P, 8)
    return a, b, kva, kvb, probe


def drain(e: Engine) -> None:
    deadline = time.monotonic() + 60
    while not e.w.cache.tiers_idle and time.monotonic() < deadline:
        e.step()
        time.sleep(0.01)
    assert e.w.cache.tiers_idle


@pytest.mark.mooncake
@pytest.mark.parametrize(("group_pages", "codec"), [(1, "none"), (3, "none"), (3, "lossless")])
def test_a_store_tier_hit_is_answered_in_the_step_and_loads_the_exact_bytes(
    mooncake_master, group_pages, codec
):
    """Instance a stores a prompt (its pages reach the store node: in groups of 3 pages, a
    group and a tail of one page); instance b, whose host tier holds nothing, is granted the
    four pages in the step it asks (its probe of the store tier, no question to its worker), and
    its load fetches them and copies a's exact bytes. With a codec the objects' names carry it:
    the probe names them as the workers do."""
    if codec != "none":
        pytest.importorskip("zstandard")
    a, b, kva, kvb, probe = mooncake_pair(mooncake_master, group_pages=group_pages, codec=codec)
    prompt = list(range(300 + group_pages, 317 + group_pages))
    stored = a.prefill(Req("a", prompt))
    drain(a)
    r = Req("r", [*prompt, 9])
    assert b.books.matched_tokens(r, 0) == (16, False)
    assert probe.answered == 1
    b.books.allocated(r, 16)
    assert b.books.hit_sources(r, 16) == {CacheHitSource.P2P: 16}
    meta = b.step({"r": 2}, {"r": [40, 41, 42, 43, 44]})
    assert meta.lookups == [] and len(meta.loads) == 1
    assert b.w.load_errors() == set()
    for src, dst in zip(stored[:4], [40, 41, 42, 43]):
        assert all(torch.equal(x, y) for x, y in zip(block(kva, src), block(kvb, dst)))
    assert_no_pins(b.w)


def assert_no_pins(w: WorkerCache) -> None:
    """No request is left, and the only pinned host slots are the fetch reserve."""
    stats = w.cache.stats()
    reserve = sum(v for k, v in stats.items() if k.startswith("fetch_reserve_"))
    assert (stats["host_pinned"], stats["requests"]) == (reserve, 0)


@pytest.mark.mooncake
def test_a_store_object_gone_before_the_load_is_a_load_error_not_wrong_bytes(mooncake_master):
    """b is granted four pages from the store tier; the last two objects are removed before
    its load: the load copies the first two exact pages, reports the other two blocks (vLLM
    recomputes them), copies nothing into them, and leaves no pin."""
    a, b, kva, kvb, probe = mooncake_pair(mooncake_master)
    prompt = list(range(500, 517))
    stored = a.prefill(Req("a", prompt))
    drain(a)
    r = Req("r", [*prompt, 9])
    assert b.books.matched_tokens(r, 0) == (16, False)
    b.books.allocated(r, 16)
    [(fp, chain, _)] = b.books.view.host_runs(r.all_token_ids, None, 0, 4)
    _, gone = probe.objects(fp, chain, 2, 4)
    assert len(gone) == 2 and probe._tier.remove(gone, force=True) == [0, 0]
    before = {i: block(kvb, i) for i in (42, 43)}
    b.step({"r": 2}, {"r": [40, 41, 42, 43, 44]})
    assert b.w.load_errors() == {42, 43}
    for src, dst in zip(stored[:2], [40, 41]):
        assert all(torch.equal(x, y) for x, y in zip(block(kva, src), block(kvb, dst)))
    for i, held in before.items():
        assert all(torch.equal(x, y) for x, y in zip(block(kvb, i), held))
    assert_no_pins(b.w)


@pytest.mark.mooncake
@pytest.mark.parametrize("why", ["master paused", "answer_in_step false"])
def test_without_a_probe_answer_in_time_the_workers_are_asked_and_still_grant_it(
    start_mooncake_master, why
):
    """The probe's wait is bounded: with the master paused the scheduler answers "not yet"
    within it and asks the worker (as with `answer_in_step: false`, which never probes); the
    worker's answer a step later grants the same four pages and loads a's bytes."""
    master = start_mooncake_master()
    paused = why == "master paused"
    a, b, kva, kvb, probe = mooncake_pair(master, wait_s=0.2, in_step=paused)
    prompt = list(range(700, 717))
    stored = a.prefill(Req("a", prompt))
    drain(a)
    r = Req("r", [*prompt, 9])
    if paused:
        master.pause()
    try:
        assert b.books.matched_tokens(r, 0) == (None, False)
        assert probe.late == int(paused) and probe.answered == 0
    finally:
        master.resume()
    meta = b.step()
    assert [q.request_id for q in meta.lookups] == ["r"]
    deadline = time.monotonic() + 60
    while (got := b.books.matched_tokens(r, 0)) == (None, False):
        assert time.monotonic() < deadline
        b.step()
        time.sleep(0.01)
    assert got == (16, False)
    b.books.allocated(r, 16)
    b.step({"r": 2}, {"r": [40, 41, 42, 43, 44]})
    assert b.w.load_errors() == set()
    for src, dst in zip(stored[:4], [40, 41, 42, 43]):
        assert all(torch.equal(x, y) for x, y in zip(block(kva, src), block(kvb, dst)))
    assert_no_pins(b.w)


def test_probe_wait_ms_is_a_bounded_number_and_no_probe_without_a_tier_any_process_can_ask():
    assert probe_wait_s({}) == 0.005
    for bad in (-1, 1001, True, "5"):
        with pytest.raises(ConfigError, match="probe_wait_ms must be a number in"):
            probe_wait_s({"probe_wait_ms": bad})
    host = {"type": "host", "size": "1MiB"}
    disk = {"type": "disk", "path": "/nonexistent", "size": "1MiB"}
    for tiers in ([host], [host, disk]):
        assert StoreProbe.for_config(load_config({"tiers": tiers}, env={}), 0.005) is None


def test_a_probe_call_that_raises_a_base_exception_is_one_probe_not_answered():
    """The store tier's exists raises CancelledError (a BaseException) once: that probe is not
    answered (the workers would be asked), and the next probe is sent and answered: the failed
    one does not stay "out" for ever."""
    import asyncio

    tier_config = MemoryConfig(space=uuid.uuid4().hex)
    tier = MemoryTier(tier_config)
    real = tier.exists
    raised: list[bool] = []

    def once(keys):
        if not raised:
            raised.append(True)
            raise asyncio.CancelledError("cancelled")
        return real(keys)

    tier.exists = once
    probe = StoreProbe(tier, tier_config, wait_s=30.0)
    assert probe.exists(["a"]) is None
    assert probe.exists(["a"]) == [False]
    assert (probe.answered, probe.late) == (1, 1)


def test_a_probe_of_a_tier_whose_available_raises_is_not_answered(monkeypatch):
    """The scheduler's probe reads the tier's `available`; one that raises reads as down: the
    probe is not answered (the workers are asked), and vLLM's scheduler sees no exception."""
    tier_config = MemoryConfig(space=uuid.uuid4().hex)
    probe = StoreProbe(MemoryTier(tier_config), tier_config, wait_s=30.0)

    def broken(self) -> bool:
        raise RuntimeError("the plugin lost its client")

    monkeypatch.setattr(MemoryTier, "available", property(broken))
    assert probe.exists(["a"]) is None
    assert (probe.answered, probe.late) == (0, 1)


def uint8_cache(block: int = P):
    """vLLM's KVCacheConfig of one full-attention group whose blocks lie in uint8 tensors, as
    every fp8 cache dtype has them."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=block, num_kv_heads=1, head_size=8, dtype=torch.uint8)
    return KVCacheConfig(16, [], [KVCacheGroupSpec(["layer.0", "layer.1"], spec)])


def test_each_fp8_format_keys_pages_of_its_own(tiny_llama, tmp_path):
    """vLLM keeps fp8, fp8_e4m3 and fp8_e5m2 caches all in uint8 tensors. Layouts made from
    vLLM's own configs (its VllmConfig with the cache dtype as configured, its KVCacheConfig)
    name the format: a worker with an fp8_e4m3 cache stores a prompt to a disk directory; one
    with fp8_e5m2 (the same tensors' shape and dtype) misses it there, then one with fp8_e4m3
    again hits it. Before, all three keyed pages alike and e5m2 loaded e4m3's bytes."""
    from vllm.config import CacheConfig, ModelConfig, VllmConfig

    from hicache.integrations.vllm.worker import layout_fields

    model = ModelConfig(model=tiny_llama, skip_tokenizer_init=True)
    disk = {"type": "disk", "path": str(tmp_path / "d"), "size": "64MiB", "group_pages": 1}
    config = load_config({"tiers": [{"type": "host", "size": "1MiB"}, disk]}, env={})
    prompt = list(range(100, 113))

    def fp8_worker(fmt: str) -> WorkerCache:
        vllm_config = VllmConfig(model_config=model, cache_config=CacheConfig(cache_dtype=fmt))
        w = WorkerCache(config, layout_fields(vllm_config, uint8_cache(), None, 0, 1))
        kv = {f"layer.{i}": torch.randint(0, 255, (2, 16, P, 8), dtype=torch.uint8) for i in (0, 1)}
        w.register(kv, 16)
        return w

    layouts = []
    for fmt, hit in (("fp8_e4m3", None), ("fp8_e5m2", 0), ("fp8", 0), ("fp8_e4m3", 12)):
        w = fp8_worker(fmt)
        try:
            layouts.append(w.layout)
            if hit is None:
                stored_through(w, prompt)
            else:
                assert answered_by(w, Lookup("q", prompt, 0)).hit == hit, fmt
        finally:
            w.close()
    assert len({layout.kv_dtype for layout in layouts}) == 1  # all uint8
    assert len({layout.model for layout in layouts}) == 3


def test_a_speculative_drafters_weights_are_in_the_page_keys(tiny_llama, tmp_path):
    """A drafter's attention layers (EAGLE, MTP, a draft model) keep their KV in the same
    blocks as the target's, so hicache stores it with the pages. Layouts from vLLM's own
    configs: the target alone, with a draft model, with another draft model of the same name,
    size and config but other weights, and with n-gram drafting (no drafter KV): the two
    drafters key pages apart from each other and from the target alone; n-gram keys them as
    the target alone does. Before, a drafter was not in the keys at all."""
    import shutil

    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from hicache.integrations.vllm.worker import layout_fields

    target = ModelConfig(model=tiny_llama, skip_tokenizer_init=True)
    first, second = tmp_path / "draft", tmp_path / "draft-retrained"
    shutil.copytree(tiny_llama, first)
    shutil.copytree(tiny_llama, second)
    weights = second / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 1
    weights.write_bytes(bytes(data))
    spec = FullAttentionSpec(block_size=P, num_kv_heads=1, head_size=8, dtype=torch.float32)
    kv = KVCacheConfig(16, [], [KVCacheGroupSpec(["layer.0", "layer.1"], spec)])

    def model(**speculative) -> str:
        parallel = ParallelConfig()
        drafting = SpeculativeConfig(
            **speculative, num_speculative_tokens=2, target_model_config=target,
            target_parallel_config=parallel,
        ) if speculative else None  # fmt: skip
        config = VllmConfig(
            model_config=target, parallel_config=parallel, speculative_config=drafting
        )
        return layout_fields(config, kv, None, 0, 1)["model"]

    alone = model()
    drafted = model(method="draft_model", model=str(first))
    retrained = model(method="draft_model", model=str(second))
    assert len({alone, drafted, retrained}) == 3
    assert model(method="ngram", prompt_lookup_max=3, prompt_lookup_min=1) == alone


# -- tensor parallelism: a load that failed on one rank ---------------------------------------


def tp_groups(n: int) -> list:
    """`n` real gloo process groups of one TP group in this process (one a rank, made on
    threads: each waits for the others to join), as vLLM's TP group's CPU group is."""
    import torch.distributed as dist

    store, groups = dist.HashStore(), [None] * n

    def join(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore("tp", store), rank, n)

    threads = [threading.Thread(target=join, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(g is not None for g in groups)
    return groups


def tp_worker(rank: int, tier: dict, agree=None, wait_ms: float = 60_000) -> WorkerCache:
    """The worker of TP rank `rank` of 2 (its own shard: the rank is in its keys) over a host
    tier and `tier`; `agree` as vLLM's connector gives it; fetches wait `wait_ms` at most."""
    host = {"type": "host", "size": 2048 * PAGE_BYTES}
    config = load_config({"tiers": [host, tier], "policy": {"fetch_max_wait_ms": wait_ms}}, env={})
    fields = dict(model="tiny", kv_dtype="float32", page_tokens=P, tp_rank=rank, tp_size=2)
    w = WorkerCache(config, {**fields, "kv_head_sharded": True}, agree=agree)
    w.register({f"layer.{i}": torch.randn(2, 64, P, 8) for i in range(2)}, 64)
    return w


class TPEngine:
    """The scheduler half and a worker per TP rank, as vLLM's multiprocess executor runs them:
    each step's metadata goes to every rank, the ranks run the step at the same time (each on a
    thread of its own, as each in its own process), and their answers are aggregated."""

    def __init__(self, books: SchedulerBooks, workers: list[WorkerCache]) -> None:
        self.books, self.workers = books, workers

    def step(self, scheduled=None, tables=None, before_last=None) -> StepMeta:
        """One step; `before_last`, if given, runs once the first rank has started it and
        before the others do."""
        meta = self.books.build(sched(scheduled, tables))
        errors: list[BaseException] = []

        def run(w: WorkerCache) -> None:
            try:
                w.bind_step(meta)
                w.start_load(meta)
                w.save(meta)
            except BaseException as err:
                errors.append(err)

        threads = [threading.Thread(target=run, args=(w,)) for w in self.workers]
        threads[0].start()
        if before_last is not None:
            before_last()
        for t in threads[1:]:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors and not any(t.is_alive() for t in threads), errors
        out = Answers()
        for w in self.workers:
            got = w.answers()
            out = out.aggregate(got) if got is not None else out
        self.books.answered(SimpleNamespace(kv_connector_worker_meta=out))
        return meta


@pytest.mark.mooncake
@pytest.mark.parametrize("why", ["object gone", "fetch deadline missed"])
def test_a_load_that_failed_on_one_tp_rank_is_stored_by_no_rank(start_mooncake_master, why):
    """TP=2. Instance a stores a prompt's 4 pages (each rank its own shard) to Mooncake.
    Instance b is granted them for a request of 29 tokens (its scheduler's probe); its step
    loads pages 0-3 and computes pages 4-6. On rank 1 alone the load fails: its objects of
    pages 2-3 are gone (every page fails from page 2 on), or its fetch misses
    `fetch_max_wait_ms` (rank 0's came in time; every page fails). Attention all-reduces
    across the ranks, so what every rank computed from that page on is wrong: both ranks report
    the same failed blocks, and neither stores a page from there (rank 0's host tier and the
    store hold none of pages 4-6: rank 0 answers the pages it fetched, no more). Before, rank
    0 stored pages 4-6 and answered 28 tokens."""
    from hicache.integrations.vllm.ranks import least_over

    master = start_mooncake_master()
    tier = {"type": "mooncake", **master.tier_config, "group_pages": 1}
    prompt = list(range(500, 516))
    for rank in (0, 1):
        a = master.track(tp_worker(rank, tier))
        a.start_load(StepMeta())
        a.save(StepMeta(stores=[Store("a", 0, prompt, 16, [0, 1, 2, 3])]))
        drain(Engine(a))
        a.close()
    groups = tp_groups(2)
    entered = threading.Event()
    agree0 = least_over(groups[0])

    def agree_first(values: list[int]) -> list[int]:
        entered.set()
        return agree0(values)

    late = why == "fetch deadline missed"
    b0 = master.track(tp_worker(0, tier, agree_first))
    b1 = master.track(tp_worker(1, tier, least_over(groups[1]), wait_ms=300 if late else 60_000))
    config = load_config({"tiers": [{"type": "host", "size": "1MiB"}, tier]}, env={})
    probe = master.track(StoreProbe.for_config(config, wait_s=30.0))
    assert probe._tier.wait_ready(60)
    e = TPEngine(SchedulerBooks(P, ranks=2, probe=probe), [b0, b1])
    e.step()  # both ranks report (empty host tiers, a shared store tier)
    r = Req("r", [*prompt, *range(900, 913)])  # 29 tokens: 7 whole pages before the last
    assert e.books.matched_tokens(r, 0) == (16, False)
    e.books.allocated(r, 16)
    if not late:
        [_, (fp, chain, _)] = e.books.view.host_runs(r.all_token_ids, None, 0, 4)
        _, gone = probe.objects(fp, chain, 2, 4)  # rank 1's objects of pages 2-3
        assert probe._tier.remove(gone, force=True) == [0, 0]

    def pause_once_rank_0_has_loaded() -> None:
        if late:
            assert entered.wait(120)  # rank 0's fetch came and it loaded: it waits for rank 1
            master.pause()

    r.num_computed_tokens = 16
    table = list(range(40, 48))
    try:
        meta = e.step({"r": 13}, {"r": table}, before_last=pause_once_rank_0_has_loaded)
    finally:
        master.resume()
    assert [s.upto for s in meta.stores] == [28]
    failed = set(table[0 if late else 2 : 4])
    assert b0.load_errors() == b1.load_errors() == failed
    for w in (b0, b1):
        drain(Engine(w))
    assert answered_by(b0, Lookup("q", r.all_token_ids, 0)).hit == 16  # the fetched pages
    [(fp, chain, _), _] = e.books.view.host_runs(r.all_token_ids, None, 0, 7)
    _, computed = probe.objects(fp, chain, 4, 7)  # rank 0's objects of pages 4-6
    assert probe.exists(computed) == [False, False, False]
    for w in (b0, b1):
        drain(Engine(w))
        assert_no_pins(w)
