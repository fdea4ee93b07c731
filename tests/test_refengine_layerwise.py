"""refengine with hicache: loads layer by layer and partial fetches answer exactly as without the
cache (CPU, float32; Llama and Qwen3 with sliding layers whose window is smaller than the hits,
so every hit also needs the state at its end).

A partial fetch prefills the head of the hit [0, k) itself and loads the pages of [k, hit) with
the state at the hit's end: for a sliding model the window before the hit must come from what
was stored, not from the head's prefill (which ends at k).
"""

from __future__ import annotations

import pytest
from test_refengine_hicache import HOST, PAGE, SHAPES

from hicache.tools.refengine.build import EngineSpec, build_engine
from hicache.tools.refengine.model import Transformer
from hicache.tools.refengine.workload import drive, make_workload


@pytest.fixture(params=sorted(SHAPES), scope="module")
def model(request):
    cfg = SHAPES[request.param]
    return Transformer.random(cfg, seed=11), f"{cfg.name}@random-seed11"


@pytest.fixture(scope="module")
def convs():
    return make_workload(
        conversations=2,
        turns=4,
        first_tokens=150,
        message_tokens=40,
        answer_tokens=5,
        vocab_size=1000,
        seed=9,
    )


@pytest.fixture(scope="module")
def off(model, convs):
    return _outputs(drive(build_engine(_spec(), model=model), convs))


def _spec(**kw) -> EngineSpec:
    # no GPU prefix cache: every hit is hicache's
    base = dict(page_tokens=PAGE, num_blocks=256, num_slots=8, chunk_tokens=64, prefix_share=0.0)
    return EngineSpec(**{**base, **kw})


def _outputs(done):
    return [[r.output for r in conv] for conv in done]


def _clean(eng) -> dict:
    stats = eng.cache.stats()
    assert stats["requests"] == 0 and stats["host_pinned"] == 0
    assert stats["copies_in_flight"] == 0
    return stats


def test_loads_by_layer_answer_exactly_as_without_the_cache(model, convs, off):
    eng = build_engine(_spec(by_layer=True), HOST, model=model)
    on = drive(eng, convs)
    assert _outputs(on) == off
    hits = [r.hit_tokens for conv in on for r in conv[1:]]
    assert all(h > 0 for h in hits)  # every later turn was a hit, loaded layer by layer
    stats = _clean(eng)
    assert stats["pages_loaded"] * PAGE == stats["hit_tokens_host"] == sum(hits)


@pytest.mark.parametrize(
    ("share", "by_layer"),
    [(0.0, True), (0.25, True), (0.5, True), (0.75, True), (1.0, True), (0.5, False)],
)
def test_partial_fetches_answer_exactly_at_every_split(model, convs, off, share, by_layer):
    """The planner recomputes `share` of every hit (0: fetch all; 1: recompute all)."""
    heads: dict[str, tuple[int, int]] = {}

    def planner(req, m):
        k = m.computed_tokens + int(share * (m.hit_tokens - m.computed_tokens)) // PAGE * PAGE
        heads[req.rid] = (k, m.hit_tokens)
        return k

    eng = build_engine(_spec(by_layer=by_layer), HOST, model=model)
    eng.planner = planner
    on = drive(eng, convs)
    assert _outputs(on) == off
    splits = [heads[r.rid] for conv in on for r in conv[1:]]
    assert all(hit > 0 for _, hit in splits)
    if 0 < share < 1:
        assert all(0 < k < hit for k, hit in splits)
    stats = _clean(eng)
    fetched = sum(hit - k for k, hit in splits)  # only the tails were copied
    assert stats["pages_loaded"] * PAGE == stats["hit_tokens_host"] == fetched


def test_a_tail_waits_for_its_tier_and_others_run_meanwhile(model, convs, off):
    """The tail of a split hit is loaded only once `fetch_ready` says its tier has sent it; the
    head stops at k until then, and other requests keep running."""
    asked: dict[str, int] = {}
    steps_at: dict[str, list[int]] = {}

    def ready(req) -> bool:
        asked[req.rid] = asked.get(req.rid, 0) + 1
        return asked[req.rid] > 3  # the tier needs three more engine steps

    eng = build_engine(_spec(by_layer=True), HOST, model=model)
    eng.planner = lambda req, m: m.hit_tokens // 2 // PAGE * PAGE
    eng.fetch_ready = ready
    real_load = eng.cache.load

    def load(m, blocks, **kw):
        steps_at.setdefault(m.request_id, []).append(eng.steps)
        return real_load(m, blocks, **kw)

    eng.cache.load = load
    on = drive(eng, convs)
    assert _outputs(on) == off
    later = [r.rid for conv in on for r in conv[1:]]
    assert all(asked[rid] == 4 for rid in later)
    assert all(len(steps_at[rid]) == 1 for rid in later)
    _clean(eng)


def test_a_partial_fetch_without_the_stored_window_would_answer_wrong(convs):
    """The control for the sliding model: the same split with the state load left out (the
    window before the hit is what the head's prefill left) gives other tokens, so the exact
    answers above do depend on the stored state."""
    cfg = SHAPES["qwen3"]
    model = Transformer.random(cfg, seed=11), f"{cfg.name}@random-seed11"
    want = _outputs(drive(build_engine(_spec(), model=model), convs))
    eng = build_engine(_spec(), HOST, model=model)
    eng.planner = lambda req, m: m.hit_tokens // 2 // PAGE * PAGE
    hooks = eng.cache._hooks  # the engine's own RingStates, reached for the control

    def keep_slot_len(slot, boundary, src):
        eng.memory.slot_len[slot] = boundary  # resume at the hit, ring untouched

    hooks.load_state = keep_slot_len
    assert _outputs(drive(eng, convs)) != want
