"""The connector's two halves without a vLLM engine: the scheduler's questions, grants, loads
and stores step by step (vLLM's request and scheduler output reduced to the fields the
connector reads), and the worker's HiCache over CPU tensors shaped as vLLM's, byte for byte."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from test_vllm import require_vllm

pytestmark = pytest.mark.vllm
require_vllm()

from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402

from hicache import load_config  # noqa: E402
from hicache.integrations.vllm.meta import (  # noqa: E402
    Answer,
    Answers,
    HiCacheStats,
    Load,
    Lookup,
    StepMeta,
    Store,
)
from hicache.integrations.vllm.scheduler import SchedulerBooks  # noqa: E402
from hicache.integrations.vllm.worker import WorkerCache  # noqa: E402

P = 4  # tokens a block


@dataclass
class Req:
    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    cache_salt: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


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
    assert step.stores == [Store("s", 0, list(range(10)), 10, [3, 1, 4, 2])]
    r.num_computed_tokens, r.all_token_ids = 10, list(range(11))
    assert books.build(sched({"s": 1}, table)).stores == []  # token 10: no new whole block
    r.num_computed_tokens, r.all_token_ids = 12, list(range(13))
    assert books.build(sched({"s": 1}, table)).stores == [
        Store("s", 10, [10, 11, 12], 13, table["s"])
    ]
    r.num_computed_tokens, r.all_token_ids = 13, list(range(14))
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


def worker(blocks: int = 16) -> tuple[WorkerCache, dict[str, torch.Tensor]]:
    """A WorkerCache over two layers shaped as vLLM's CPU caches: (2, blocks, P, 8) float32."""
    config = load_config({"tiers": [{"type": "host", "size": "1MiB"}]}, env={})
    fields = dict(model="tiny", kv_dtype="float32", page_tokens=P, tp_rank=0, tp_size=1)
    w = WorkerCache(config, {**fields, "kv_head_sharded": True})
    kv = {f"layer.{i}": torch.zeros(2, blocks, P, 8) for i in range(2)}
    w.register(kv, blocks)
    return w, kv


def block(kv: dict[str, torch.Tensor], b: int) -> list[torch.Tensor]:
    return [t[:, b].clone() for t in kv.values()]


def test_worker_stores_answers_and_loads_the_bytes_granted():
    w, kv = worker()
    for t in kv.values():
        t[:, :3] = torch.randn(2, 3, P, 8)
    prompt = list(range(100, 113))
    w.start(StepMeta())
    w.after(StepMeta(stores=[Store("a", 0, prompt, 12, [0, 1, 2])]))  # blocks 0..2 hold 12 tokens
    w.start(StepMeta(lookups=[Lookup("b", [*prompt[:12], 7, 7], 0), Lookup("c", prompt, 0)]))
    assert w.answers() == Answers(
        {0: [Answer("b", 0, 12, (("host", 12),)), Answer("c", 0, 12, (("host", 12),))]}
    )
    assert w.answers() is None
    # b gets all three blocks; c only two (another rank held less): block 13 stays untouched
    w.start(StepMeta(loads=[Load("b", 0, 12, [7, 8, 9, 10]), Load("c", 0, 8, [11, 12, 13])]))
    for src, dst in ((0, 7), (1, 8), (2, 9), (0, 11), (1, 12)):
        assert all(torch.equal(a, b) for a, b in zip(block(kv, src), block(kv, dst)))
    assert all(not t[:, 13].any() for t in kv.values())
    assert w.load_errors() == set()
    stats = w.cache.stats()
    assert (stats["host_pinned"], stats["requests"], stats["hit_tokens_host"]) == (0, 0, 20)


def test_worker_reports_a_load_it_cannot_make_and_copies_nothing():
    w, kv = worker()
    w.start(StepMeta(lookups=[Lookup("d", list(range(13)), 0)]))
    assert w.answers() == Answers({0: [Answer("d", 0, 0)]})  # nothing stored: a miss
    w.start(StepMeta(loads=[Load("d", 0, 8, [5, 6, 7]), Load("e", 4, 12, [1, 2, 3])]))
    assert w.load_errors() == {5, 6, 2, 3}
    assert w.load_errors() == set()
    assert all(not t.any() for t in kv.values())
    assert w.cache.stats()["requests"] == 0


def test_worker_lets_pins_go_for_an_answer_not_taken_and_a_forgotten_request():
    w, _ = worker()
    prompt = list(range(13))
    w.start(StepMeta())
    w.after(StepMeta(stores=[Store("a", 0, prompt, 12, [0, 1, 2])]))
    w.start(StepMeta(lookups=[Lookup("u", prompt, 0), Lookup("f", prompt, 0)]))
    assert w.cache.stats()["host_pinned"] == 3  # both hits pin the same three slots
    w.start(StepMeta(unused=["u"], forget=["f"]))
    stats = w.cache.stats()
    assert (stats["host_pinned"], stats["requests"], stats["host_used"]) == (0, 0, 3)


def test_worker_keys_pages_by_the_requests_cache_salt():
    w, _ = worker()
    prompt = list(range(13))
    w.start(StepMeta())
    w.after(StepMeta(stores=[Store("a", 0, prompt, 12, [0, 1, 2], salt="tenant-1")]))
    w.start(StepMeta(lookups=[Lookup("b", prompt, 0, "tenant-2"), Lookup("c", prompt, 0)]))
    w.start(StepMeta(lookups=[Lookup("d", prompt, 0, "tenant-1")]))
    hits = [(a.request_id, a.hit) for a in w.answers().by_rank[0]]
    assert hits == [("b", 0), ("c", 0), ("d", 12)]


def test_worker_reports_what_its_counters_gained_to_vllms_connector_stats():
    w, _ = worker()
    prompt = list(range(13))
    w.start(StepMeta())
    w.after(StepMeta(stores=[Store("a", 0, prompt, 12, [0, 1, 2])]))
    assert w.stats() == HiCacheStats({"pages_stored": 3})
    assert w.stats() is None  # nothing since
    w.start(StepMeta(lookups=[Lookup("b", prompt, 0)]))
    w.start(StepMeta(loads=[Load("b", 0, 12, [4, 5, 6])]))
    got = w.stats()
    assert got == HiCacheStats({"hit_tokens_host": 12, "pages_loaded": 3})
    assert got.aggregate(HiCacheStats({"pages_loaded": 2})).reduce() == {
        "hit_tokens_host": 12,
        "pages_loaded": 5,
    }
