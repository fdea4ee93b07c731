"""Partial fetches from a real store tier: the cache plans k from its cost model, asks the tier
only for the page groups from k's on, and the reference engine prefills [0, k) meanwhile; the
answers are token-identical with the cache off (CPU, float32, Llama and Qwen3 with sliding
layers, whose window before the hit comes from the state stored with the tail).

A writer engine fills the in-memory store tier (`tests/memory_tier.py`); a reader engine with a
cache of its own (an empty host tier) runs the same conversations, so that every first turn is a
hit from the store tier alone. k is forced through the cost model's figures: the tier's
`read_gbps:` and `policy.prefill_tokens_per_s`, with the moving averages frozen (their weight
set to 0), so that the tier's time per token is `x` times the prefill's and the plan splits a
hit of H tokens from the engine's 0 at k = H x / (1 + x) (to the group start below it).
"""

from __future__ import annotations

import time
import uuid

import pytest
from fake_engine import PATIENT_WAIT_MS
from memory_tier import MemoryTier
from test_refengine_hicache import PAGE, SHAPES
from test_refengine_layerwise import _outputs, _spec

from hicache.core import cost
from hicache.tools.refengine.build import build_engine
from hicache.tools.refengine.model import Transformer
from hicache.tools.refengine.workload import drive, make_workload

GROUP = 2  # pages per object of the store tier
PREFILL = 20000.0  # tokens/s, the cost model's figure


@pytest.fixture(params=sorted(SHAPES), scope="module")
def model(request):
    cfg = SHAPES[request.param]
    return Transformer.random(cfg, seed=11), f"{cfg.name}@random-seed11"


@pytest.fixture(scope="module")
def convs():
    return make_workload(
        conversations=2,
        turns=2,
        first_tokens=230,
        message_tokens=40,
        answer_tokens=5,
        vocab_size=1000,
        seed=5,
    )


@pytest.fixture(scope="module")
def off(model, convs):
    return _outputs(drive(build_engine(_spec(), model=model), convs))


@pytest.fixture(scope="module")
def space(model, convs):
    """A store tier that holds every page (and group-end state) of the conversations."""
    name = uuid.uuid4().hex
    writer = build_engine(_spec(), _config(name, 1.0), model=model)
    drive(writer, convs)
    writer.cache.close()  # drains nothing here (not persistent); the puts are in already
    return name


def _config(space: str, read_gbps: float, tier: dict | None = None) -> dict:
    tier = tier or {"type": "memory", "space": space}
    return {
        "tiers": [
            {"type": "host", "size": "32MiB"},
            {**tier, "group_pages": GROUP, "read_gbps": read_gbps},
        ],
        "policy": {"prefill_tokens_per_s": PREFILL, "fetch_max_wait_ms": PATIENT_WAIT_MS},
    }


def _reader(model, space: str, x: float, monkeypatch, tier: dict | None = None, **spec: bool):
    """A fresh cache on the tier whose read takes `x` times the prefill per token."""
    monkeypatch.setattr(cost, "WEIGHT", 0.0)  # the rates stay at their configured figures
    probe = build_engine(_spec(), model=model)
    page_bytes = probe.memory.pool[0].numel() * probe.memory.pool.element_size()
    read_gbps = PREFILL * page_bytes / PAGE / x / 1e9
    eng = build_engine(_spec(**spec), _config(space, read_gbps, tier), model=model)
    asked: dict[str, list] = {}
    real_match = eng.cache.match

    def match(rid, tokens, **kw):
        m = real_match(rid, tokens, **kw)
        asked.setdefault(rid, []).append(m)
        return m

    eng.cache.match = match
    MemoryTier.calls.setdefault(space, []).clear()
    eng.cache.poll()  # fills the fetch reserve: a fetch that fits is one get
    return eng, asked


def _clean(eng) -> dict:
    """Check that the reader settles with nothing held, then close it; its last stats."""
    deadline = time.monotonic() + 120
    while not eng.cache.tiers_idle:  # the reader's own stores are put behind to the tier
        assert time.monotonic() < deadline, "the store tier did not settle in time"
        eng.cache.poll()
        time.sleep(0.005)
    eng.cache.poll()
    stats = eng.cache.stats()
    # nothing pinned but the free slots the tier keeps for its fetches
    reserve = sum(v for key, v in stats.items() if key.startswith("fetch_reserve_"))
    assert stats["requests"] == 0 and stats["host_pinned"] == reserve
    assert stats["copies_in_flight"] == 0
    eng.cache.close()
    return stats


def _groups_asked(n_tokens: int, from_page: int) -> int:
    """Groups a fetch from `from_page` asks for in a prompt of `n_tokens` (capped one token
    short of the prompt): every whole group that starts below the cap."""
    cap = (n_tokens - 1) // PAGE
    return min(-(-cap // GROUP), n_tokens // PAGE // GROUP) - from_page // GROUP


@pytest.mark.parametrize(("x", "by_layer"), [(1 / 3, False), (1.0, True), (3.0, False)])
def test_planned_partial_fetches_answer_exactly_and_fetch_only_the_tail(
    model, convs, off, space, x, by_layer, monkeypatch
):
    eng, asked = _reader(model, space, x, monkeypatch, partial=True, by_layer=by_layer)
    on = drive(eng, convs)
    assert _outputs(on) == off
    gets = [n for op, n in MemoryTier.calls[space] if op == "get"]
    fetched_groups = []
    for conv in on:
        first = conv[0]
        plan, final = asked[first.rid][0], asked[first.rid][-1]
        hit = (len(first.prompt) - 1) // PAGE * PAGE
        want = int(hit * x / (1 + x)) // (PAGE * GROUP) * (PAGE * GROUP)
        assert plan.pending and plan.head_tokens == want > 0  # a store hit, split at k
        assert (final.pending, final.head_tokens) == (False, want)
        assert final.hit_tokens > want and final.fetched_tokens == final.hit_tokens - want
        fetched_groups.append(_groups_asked(len(first.prompt), want // PAGE))
        later = asked[conv[1].rid][0]  # the host holds the first turn: past k, no plan
        assert later.head_tokens == 0
    _clean(eng)
    # the first turns' fetches come first, each asking only for the groups from k's on (Qwen3
    # asks which exist first, with the states at the group ends; its get brings the run and
    # the state at the run's end)
    if eng.memory.rings is None:
        assert gets[: len(on)] == fetched_groups
    else:
        assert gets[: len(on)] == [g + 1 for g in fetched_groups]


@pytest.mark.parametrize("x", [1 / 3, 0.5])
def test_without_the_plan_a_store_hit_is_fetched_whole(model, convs, off, space, x, monkeypatch):
    eng, asked = _reader(model, space, x, monkeypatch)
    on = drive(eng, convs)
    assert _outputs(on) == off
    whole = [_groups_asked(len(conv[0].prompt), 0) for conv in on]
    for conv in on:
        assert all(m.head_tokens == 0 for m in asked[conv[0].rid])
    _clean(eng)
    gets = [n for op, n in MemoryTier.calls[space] if op == "get"]
    assert gets[: len(on)] == (whole if eng.memory.rings is None else [g + 1 for g in whole])


def test_a_planned_hit_cannot_be_loaded_from_below_its_head(model, convs, space, monkeypatch):
    """The pages before k were never fetched: a load from below k is refused and leaves the
    match loadable; loaded from k, its pins go once the copies are done."""
    eng, _ = _reader(model, space, 1.0, monkeypatch, partial=True)
    cache, prompt = eng.cache, convs[0].first
    m = cache.match("r", prompt, partial=True)
    k = m.head_tokens
    assert m.pending and k > 0
    deadline = time.monotonic() + 120
    while m.pending:
        assert time.monotonic() < deadline, "the tier did not answer in time"
        time.sleep(0.005)
        m = cache.match("r", prompt, partial=True)
    assert m.head_tokens == k < m.hit_tokens
    blocks = eng.memory.alloc_blocks(m.load_pages)
    with pytest.raises(ValueError, match=f"from_token >= head_tokens={k}"):
        cache.load(m, blocks, state_slot=0, from_token=k - PAGE * 2)
    with pytest.raises(ValueError, match="head_tokens"):
        cache.load(m, blocks, state_slot=0)
    cache.load(m, blocks, state_slot=0, from_token=k)
    cache.release("r")
    _clean(eng)


def test_a_planned_fetch_from_the_disk_tier_answers_exactly(
    model, convs, off, monkeypatch, tmp_path
):
    """The same over real files: a fresh cache on the directory a first one wrote."""
    disk = {"type": "disk", "path": str(tmp_path), "size": "64MiB"}
    writer = build_engine(_spec(), _config("", 1.0, disk), model=model)
    drive(writer, convs)
    writer.cache.close()  # a persistent tier: its writes are drained
    eng, asked = _reader(model, "", 1.0, monkeypatch, disk, partial=True)
    on = drive(eng, convs)
    assert _outputs(on) == off
    for conv in on:
        final = asked[conv[0].rid][-1]
        k = (len(conv[0].prompt) - 1) // PAGE * PAGE // 2 // (PAGE * GROUP) * (PAGE * GROUP)
        assert (final.pending, final.head_tokens) == (False, k)
        assert final.tier_tokens == (("disk", final.hit_tokens - k),) and final.hit_tokens > k
    _clean(eng)
