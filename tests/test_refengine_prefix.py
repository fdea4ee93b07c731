"""refengine's own GPU prefix cache: exact hits, shared blocks, LRU eviction, and the same answers.

CPU, float32, a random-weight tiny Llama shape (a model with sliding layers keeps no prefix cache).
"""

from __future__ import annotations

import itertools

import pytest

from hicache.tools.refengine.build import EngineSpec, build_engine
from hicache.tools.refengine.config import FULL, SLIDING, ModelConfig
from hicache.tools.refengine.engine import Engine, Request
from hicache.tools.refengine.memory import KVMemory
from hicache.tools.refengine.model import Transformer
from hicache.tools.refengine.prefix import PrefixCache, PrefixHit
from hicache.tools.refengine.workload import drive, make_workload

PAGE = 16
HOST = {"tiers": [{"type": "host", "size": "32MiB"}]}
CFG = ModelConfig(
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
)


@pytest.fixture(scope="module")
def model():
    return Transformer.random(CFG, seed=11), f"{CFG.name}@random-seed11"


def _spec(**kw) -> EngineSpec:
    return EngineSpec(**{"page_tokens": PAGE, "num_blocks": 256, "chunk_tokens": 64, **kw})


def _convs(conversations: int = 3, turns: int = 4):
    return make_workload(conversations, turns, 150, 24, 5, vocab_size=1000, seed=9)


def _outputs(done):
    return [[r.output for r in conv] for conv in done]


# -- the cache alone ---------------------------------------------------------------------------


def test_lookup_finds_the_longest_cached_prefix_and_leaves_a_token_to_compute():
    pc = PrefixCache(page_tokens=4, max_blocks=10)
    tokens = list(range(12))  # three full pages
    assert pc.finish(tokens, [7, 8, 9], PrefixHit()) == []  # all kept
    assert len(pc) == 3
    assert pc.lookup([*tokens, 99]).blocks == [7, 8, 9]
    assert pc.lookup(tokens).blocks == [7, 8]  # the last token must be computed
    assert pc.lookup(list(range(6)) + [0] * 6).blocks == [7]  # diverges in page 1
    assert pc.lookup([*tokens, 99], salt="other").blocks == []  # tenants do not share


def test_a_page_already_cached_frees_the_duplicate_block():
    pc = PrefixCache(page_tokens=4, max_blocks=10)
    pc.finish(list(range(8)), [1, 2], PrefixHit())
    hit = pc.lookup(list(range(9)))
    assert hit.blocks == [1, 2]
    # the request used the shared blocks 1, 2; block 3 holds its page 2, block 4 its tail
    assert pc.finish(list(range(14)), [1, 2, 3, 4], hit) == [4]
    # another request computed page 0 itself into block 5: 5 is a duplicate and is freed
    assert pc.finish(list(range(4)), [5], PrefixHit()) == [5]
    assert len(pc) == 3


def test_eviction_takes_unpinned_tails_first_and_never_a_pinned_page():
    pc = PrefixCache(page_tokens=2, max_blocks=10)
    a, b = [1, 1, 2, 2, 3, 3], [5, 5, 6, 6]
    pc.finish(a, [10, 11, 12], PrefixHit())
    pc.finish(b, [20, 21], PrefixHit())
    pinned = pc.lookup([*b, 0])  # b is in use: its pages stay
    assert pc.evict(2) == [12, 11]  # a's tail, then the page before it
    assert pc.lookup([*a, 0]).blocks == [10]
    assert sorted(pc.evict(5)) == []  # 10 is pinned by the lookup above, b by `pinned`
    pc.unpin(pinned)
    assert pc.evict(5) == [21, 20]


def test_the_cache_keeps_at_most_max_blocks():
    pc = PrefixCache(page_tokens=2, max_blocks=2)
    freed = pc.finish([1, 1, 2, 2, 3, 3], [10, 11, 12], PrefixHit())
    assert freed == [12] and len(pc) == 2
    # a newer sequence displaces the least recently used pages, tail first
    freed = pc.finish([7, 7, 8, 8], [30, 31], PrefixHit())
    assert sorted(freed) == [10, 11] and pc.lookup([7, 7, 8, 8, 0]).blocks == [30, 31]


# -- in the engine -----------------------------------------------------------------------------


def test_multi_turn_answers_are_the_same_with_the_prefix_cache(model):
    convs = _convs()
    off = drive(build_engine(_spec(prefix_share=0.0), model=model), convs)
    eng = build_engine(_spec(), model=model)
    on = drive(eng, convs)
    assert _outputs(on) == _outputs(off)
    for conv in on:
        assert conv[0].gpu_hit_tokens == 0
        for prev, cur in itertools.pairwise(conv):  # the previous prompt and answer were kept
            kv = len(prev.prompt) + len(prev.output) - 1
            assert cur.gpu_hit_tokens == min(kv, len(cur.prompt) - 1) // PAGE * PAGE
    assert eng.memory.free_blocks + len(eng.prefix) == eng.memory.num_blocks  # none leaked


def test_a_pool_smaller_than_the_working_set_evicts_and_answers_the_same(model):
    convs = _convs(conversations=4)
    off = drive(build_engine(_spec(prefix_share=0.0), model=model), convs)
    eng = build_engine(_spec(num_blocks=40), model=model)  # 2.5 conversations of 4
    on = drive(eng, convs)
    assert _outputs(on) == _outputs(off)
    later = [r for conv in on for r in conv[1:]]
    assert any(r.gpu_hit_tokens < len(r.prompt) // PAGE * PAGE - PAGE for r in later)  # evicted
    assert eng.memory.free_blocks + len(eng.prefix) == eng.memory.num_blocks


def test_hicache_serves_what_the_gpu_prefix_cache_lost(model):
    convs = _convs(conversations=4)
    off = drive(build_engine(_spec(prefix_share=0.0), model=model), convs)
    eng = build_engine(_spec(num_blocks=40), HOST, model=model)
    on = drive(eng, convs)
    assert _outputs(on) == _outputs(off)
    for conv in on:
        for prev, cur in itertools.pairwise(conv):  # GPU hit + hicache's hit: the whole prefix
            assert cur.gpu_hit_tokens + cur.hit_tokens >= len(prev.prompt) // PAGE * PAGE
    assert any(r.hit_tokens > 0 for conv in on for r in conv)
    assert any(r.gpu_hit_tokens > 0 for conv in on for r in conv)
    eng.cache.close()


def test_the_prefix_cache_is_sized_by_share_or_blocks_and_off_for_sliding_models(model):
    assert _spec(num_blocks=100, prefix_share=0.25).prefix_cache_blocks == 25
    assert _spec(num_blocks=100, prefix_blocks=7).prefix_cache_blocks == 7
    assert build_engine(_spec(prefix_share=0.0), model=model).prefix is None
    with pytest.raises(ValueError, match="prefix_share"):
        _ = _spec(prefix_share=1.5).prefix_cache_blocks
    swa = ModelConfig(
        **{
            **CFG.__dict__,
            "family": "qwen3",
            "layer_types": (FULL, SLIDING),
            "sliding_window": 32,
            "hf": {},
        }
    )
    mem = KVMemory(swa, num_blocks=8, page_tokens=PAGE, num_slots=2)
    with pytest.raises(ValueError, match="sliding-window"):
        Engine(Transformer.random(swa, seed=1), mem, prefix=PrefixCache(PAGE, 4))
    assert build_engine(_spec(), model=(Transformer.random(swa, seed=1), "swa")).prefix is None


def test_a_request_waiting_for_blocks_holds_no_pins(model):
    eng = build_engine(_spec(num_blocks=12), model=model)
    first = Request("a", list(range(1, 100)), 2)
    eng.run([first])
    assert len(eng.prefix) == 6
    big = Request("b", list(range(1, 100)) + list(range(500, 580)), 2)  # needs 12 blocks
    eng.run([big])  # the cached pages it shares stay; the others are evicted for its blocks
    assert big.gpu_hit_tokens == 96 and big.output
    assert eng.memory.free_blocks + len(eng.prefix) == eng.memory.num_blocks


# -- hicache replay's comparison --------------------------------------------------------------


def test_replay_compares_the_engine_with_its_prefix_cache_against_it_plus_hicache(tmp_path):
    import json

    from hicache.tools.refengine.replay import main

    out = tmp_path / "r.json"
    args = ["--model", "tiny-llama", "--conversations", "3", "--turns", "3", "--first-tokens",
            "128", "--message-tokens", "16", "--answer-tokens", "2", "--plot", "", "--quiet",
            "--no-prefix-row", "--repeats", "2", "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    res = json.loads(out.read_text())
    assert (res["baseline"], res["by_layer"]) == ("gpu_prefix_cache", False)  # CPU: whole loads
    # two repetitions of 9 requests, each figure their median with its range beside it
    assert (res["repeats"], res["requests"], res["identical_requests"]) == (2, 18, 18)
    assert res["identical"] and len(res["per_repeat"]) == 2
    for key, (lo, hi) in res["range"].items():
        assert lo <= res[key] <= hi and sorted(r[key] for r in res["per_repeat"]) == [lo, hi]
    assert res["command"].startswith("hicache replay --model tiny-llama")
    assert res["commit"] and res["machine"]
    off, on, none = res["off"], res["on"], res["no_prefix_cache"]
    assert none["cached_tokens_gpu"] == 0
    # the pool holds 60 % of the working set: the GPU prefix cache serves part of the reuse,
    # hicache's host tier what it lost
    assert off["cached_tokens_gpu"] > 0 and on["cached_tokens_host"] > 0
    assert res["setup"]["num_blocks"] < res["setup"]["working_set_blocks"]
    assert main([*args, "--prefix-share", "0", "--repeats", "1"]) == 0
    assert json.loads(out.read_text())["baseline"] == "no_prefix_cache"
