"""refengine with hicache embedded: multi-turn conversations answer exactly as without the cache.

CPU, float32, random-weight tiny models of both families (Qwen3 with sliding layers whose window
is smaller than the prompts, so every hit also needs a state).
"""

from __future__ import annotations

import itertools

import pytest
from fake_engine import PATIENT_WAIT_MS

pytest.importorskip("hicache.cache")

from hicache.tools.refengine.build import EngineSpec, build_engine, load_model
from hicache.tools.refengine.config import FULL, SLIDING, ModelConfig
from hicache.tools.refengine.memory import RingStates
from hicache.tools.refengine.model import Transformer
from hicache.tools.refengine.workload import drive, drive_interleaved, make_workload

PAGE = 16
HOST = {"tiers": [{"type": "host", "size": "32MiB"}]}

SHAPES = {
    "llama": ModelConfig(
        family="llama",
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        layer_types=(FULL, FULL),
        initializer_range=0.1,
        name="t-llama",
    ),
    "qwen3": ModelConfig(
        family="qwen3",
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        layer_types=(SLIDING, FULL, SLIDING),
        sliding_window=40,
        initializer_range=0.1,
        name="t-qwen3",
    ),
}


@pytest.fixture(params=sorted(SHAPES))
def model(request):
    cfg = SHAPES[request.param]
    return Transformer.random(cfg, seed=11), f"{cfg.name}@random-seed11"


def _spec(**kw) -> EngineSpec:
    # no GPU prefix cache: every hit is hicache's
    base = dict(page_tokens=PAGE, num_blocks=256, num_slots=8, chunk_tokens=64, prefix_share=0.0)
    return EngineSpec(**{**base, **kw})


def _outputs(done):
    return [[r.output for r in conv] for conv in done]


def test_multi_turn_identical_with_host_tier(model):
    convs = make_workload(
        conversations=3,
        turns=4,
        first_tokens=150,
        message_tokens=24,
        answer_tokens=5,
        vocab_size=1000,
        seed=9,
    )
    off = drive(build_engine(_spec(), model=model), convs)
    eng = build_engine(_spec(), HOST, model=model)
    on = drive(eng, convs)
    assert _outputs(on) == _outputs(off)
    # turn 0 misses; every later turn reuses at least the previous prompt's full pages
    # (sliding models: down to the deepest boundary with a state, one page less at most)
    snap = PAGE if eng.memory.rings is not None else 0
    for conv in on:
        assert conv[0].hit_tokens == 0
        for prev, cur in itertools.pairwise(conv):
            assert cur.hit_tokens >= len(prev.prompt) // PAGE * PAGE - snap
            assert cur.hit_tokens % PAGE == 0 and cur.hit_tokens < len(cur.prompt)
    stats = eng.cache.stats()
    assert stats["hit_tokens_host"] == sum(r.hit_tokens for c in on for r in c)
    assert stats["pages_loaded"] * PAGE == stats["hit_tokens_host"]
    assert stats["requests"] == 0 and stats["host_pinned"] == 0
    if eng.memory.rings is not None:
        assert stats["states_stored"] > 0 and stats["hook_errors"] == 0


def test_failed_state_load_is_recomputed_not_a_hit():
    """A state hook that fails once: that request recomputes its prompt and still answers right."""
    model = Transformer.random(SHAPES["qwen3"], seed=11), "t-qwen3@random-seed11"
    convs = make_workload(
        conversations=1,
        turns=3,
        first_tokens=120,
        message_tokens=20,
        answer_tokens=4,
        vocab_size=1000,
        seed=4,
    )
    off = drive(build_engine(_spec(), model=model), convs)
    eng = build_engine(_spec(), HOST, model=model)
    hooks: RingStates = eng.cache._hooks  # the engine's own hooks object, reached for the test
    real, calls = hooks.load_state, []

    def failing_once(slot, boundary, src):
        calls.append(boundary)
        if len(calls) == 1:
            raise OSError("simulated failure")
        real(slot, boundary, src)

    hooks.load_state = failing_once
    on = drive(eng, convs)
    assert _outputs(on) == _outputs(off)
    hits = [r.hit_tokens for r in on[0]]
    # turn 2's prompt (168 tokens) starts with turn 1's prompt and answer, stored as 147 tokens:
    # 9 full pages, with a state at their end
    assert hits == [0, 0, 144] and len(calls) == 2
    assert eng.cache.stats()["hook_errors"] == 1


def test_named_shapes_run_with_the_cache():
    """The replay's default path: a named shape, built by name, with the host tier."""
    spec = _spec(model="tiny-qwen3-swa", page_tokens=32, chunk_tokens=128)
    m = load_model(spec)
    convs = make_workload(
        conversations=2,
        turns=2,
        first_tokens=300,
        message_tokens=40,
        answer_tokens=3,
        vocab_size=2048,
        seed=2,
    )
    off = drive(build_engine(spec, model=m), convs)
    on = drive(build_engine(spec, HOST, model=m), convs)
    assert _outputs(on) == _outputs(off)
    assert all(conv[1].hit_tokens >= 256 for conv in on)


def _wait_for_l3(engine, timeout_s: float = 120.0) -> None:
    """The store connects in the background, and lookups skip it until then: wait for it."""
    if not engine.cache.wait_ready(timeout_s):
        pytest.fail(f"the host tier or the L3 store was not ready within {timeout_s} s")


@pytest.mark.mooncake
def test_second_instance_hits_through_l3(model, mooncake_master):
    """Engine A stores through L3; engine B (its own host tier, empty) hits from L3."""
    config = {
        "tiers": [
            {"type": "host", "size": "32MiB"},
            {"type": "mooncake", **mooncake_master.tier_config},
        ],
        "policy": {"fetch_max_wait_ms": PATIENT_WAIT_MS},  # no deadline: not what is tested
    }
    convs = make_workload(
        conversations=2,
        turns=2,
        first_tokens=150,
        message_tokens=24,
        answer_tokens=4,
        vocab_size=1000,
        seed=3,
    )
    off = drive(build_engine(_spec(), model=model), convs)
    a = build_engine(_spec(), config, model=model)
    _wait_for_l3(a)
    drive(a, [type(c)(c.cid, c.first, [], c.answer_tokens) for c in convs])
    stored = a.cache.stats()
    a.cache.close()
    b = build_engine(_spec(), config, model=model)
    _wait_for_l3(b)
    on = drive(b, convs)
    assert _outputs(on) == _outputs(off)
    busy = {k: v for k, v in b.cache.stats().items() if v}
    # A stored each first prompt with its answer: 153 tokens, 9 full pages of 16, in two whole
    # groups of 4 (group_pages) and, without states, a tail of 1 page: B's first turns (150
    # tokens, 9 full pages) take all 9 pages from L3; with states (qwen3's), the 8 of the groups
    hit = 128 if b.cache.layout.state_bytes else 144
    assert [conv[0].l3_tokens for conv in on] == [hit, hit], f"A: {stored} B: {busy}"


def test_interleaved_runs_take_turns_and_answer_as_each_engine_alone(model):
    """`hicache replay`'s runs: turn t of every conversation through one engine until it is
    idle, then through the next, the order rotating each turn; each engine's answers are
    those it gives driven alone (its prompts built from its own answers)."""
    convs = make_workload(
        conversations=2, turns=3, first_tokens=60, message_tokens=8, answer_tokens=3,
        vocab_size=1000, seed=4,
    )  # fmt: skip
    engines = [build_engine(_spec(), model=model), build_engine(_spec(), HOST, model=model)]
    finished = []
    done, elapsed = drive_interleaved(engines, convs, on_finish=finished.append)
    whose = [next(e for e in (0, 1) if any(r in c for c in done[e])) for r in finished]
    turns = [int(r.rid.split("t")[1]) for r in finished]
    assert (
        list(zip(turns, whose))
        == [(0, 0)] * 2 + [(0, 1)] * 2 + [(1, 1)] * 2 + [(1, 0)] * 2 + [(2, 0)] * 2 + [(2, 1)] * 2
    )
    alone = drive(build_engine(_spec(), model=model), convs)
    assert _outputs(done[0]) == _outputs(alone) == _outputs(done[1])
    assert all(t > 0 for t in elapsed)
    assert sum(r.hit_tokens for c in done[1] for r in c) > 0  # the hicache engine hit


def test_every_prompt_token_the_engine_computes_reaches_the_cost_model_once(model):
    convs = make_workload(
        conversations=2,
        turns=3,
        first_tokens=150,
        message_tokens=24,
        answer_tokens=5,
        vocab_size=1000,
        seed=9,
    )
    eng = build_engine(_spec(), HOST, model=model)
    reported: list[tuple[int, float]] = []
    eng.cache.report_prefill = lambda tokens, seconds: reported.append((tokens, seconds))
    done = drive(eng, convs)
    computed = sum(len(r.prompt) - r.hit_tokens for conv in done for r in conv)
    assert sum(r.hit_tokens for conv in done for r in conv) > 0
    assert sum(tokens for tokens, _ in reported) == computed
    assert all(seconds > 0 for _, seconds in reported)
