"""Loads layer by layer and partial loads (the tail of a hit), on the CPU: exact bytes, pins
released in one place, bad arguments refused; and the partial-fetch plan.

The CUDA side (a copy stream of its own, one event per layer) is in test_layerwise_cuda.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hicache import HiCache, Layout, PagedBuffer, load_config
from hicache.core.plan import PrefillSpeed, plan_fetch

P = 4
LAYERS = 4
LAYER_BYTES = 32  # per page and layer: K and V of 16 bytes each


def make(shape: str, layers: int = LAYERS) -> tuple[HiCache, PagedBuffer]:
    if shape == "page_first":
        pool = torch.zeros(32, LAYERS, 2, 16, dtype=torch.uint8)  # a page: layer after layer
        pages = PagedBuffer.page_first(pool)
        layout = Layout(model="m", kv_dtype="uint8", page_tokens=P, page_bytes=pages.page_bytes)
    else:  # one tensor per layer and K/V, as vLLM keeps them
        tensors = [torch.zeros(32, 16, dtype=torch.uint8) for _ in range(2 * LAYERS)]
        pages = PagedBuffer.layer_first(tensors)
        layout = Layout(model="m", kv_dtype="uint8", page_tokens=P, segments=pages.seg_bytes)
    cfg = load_config({"tiers": [{"type": "host", "size": 64 * layout.page_size}]}, env={})
    cache = HiCache(cfg, pages, layout=layout, layers=layers)
    assert cache.wait_ready(30)
    return cache, pages


def fill(pages: PagedBuffer, blocks: list[int], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for seg in pages.segments:
        seg[blocks] = torch.randint(0, 256, (len(blocks), seg.shape[1]), generator=g).to(seg.dtype)


def rows(pages: PagedBuffer, blocks: list[int]) -> torch.Tensor:
    return torch.cat([seg[blocks] for seg in pages.segments], dim=1)


def stored(cache: HiCache, pages: PagedBuffer, n: int, seed: int) -> np.ndarray:
    """A prompt of `n` pages and a token, its pages filled at random in blocks 0..n-1 and
    stored (request "a", released)."""
    prompt = np.arange(n * P + 1, dtype=np.int32)
    fill(pages, list(range(n)), seed=seed)
    cache.store("a", prompt, list(range(n)))
    cache.release("a")
    return prompt


def clean(cache: HiCache) -> None:
    s = cache.stats()
    assert s["host_pinned"] == 0 and s["requests"] == 0 and s["copies_in_flight"] == 0


@pytest.mark.parametrize("shape", ["page_first", "layer_first"])
def test_a_load_by_layer_puts_every_byte_of_every_layer(shape):
    cache, pages = make(shape)
    prompt = stored(cache, pages, 10, seed=1)
    m = cache.match("b", prompt)
    assert (m.hit_tokens, m.load_pages) == (10 * P, 10)
    blocks = list(range(31, 21, -1))
    loading = cache.load(m, blocks, by_layer=True)
    for layer in range(LAYERS):  # on the CPU the copies are done: the waits are no-ops
        loading.wait_layer(layer)
    assert loading.done()
    assert torch.equal(rows(pages, blocks), rows(pages, list(range(10))))
    assert cache.stats()["pages_loaded"] == 10
    cache.release("b")
    clean(cache)


@pytest.mark.parametrize("by_layer", [False, True])
def test_a_load_from_a_token_copies_only_the_tail_of_the_hit(by_layer):
    cache, pages = make("layer_first")
    prompt = stored(cache, pages, 12, seed=2)
    m = cache.match("b", prompt)
    assert m.hit_tokens == 12 * P
    blocks = list(range(12, 24))
    cache.load(m, blocks, by_layer=by_layer, from_token=5 * P)  # the engine computes 5 pages
    assert torch.equal(rows(pages, blocks[5:]), rows(pages, list(range(5, 12))))
    assert not rows(pages, blocks[:5]).any()  # left to the engine: not copied
    s = cache.stats()
    assert (s["pages_loaded"], s["hit_tokens_host"]) == (7, 7 * P)
    cache.release("b")
    clean(cache)


def test_a_load_from_the_end_of_the_hit_copies_nothing_and_releases_the_pins():
    cache, pages = make("page_first")
    prompt = stored(cache, pages, 6, seed=3)
    m = cache.match("b", prompt)
    assert cache.stats()["host_pinned"] == 6
    done = cache.load(m, list(range(6, 12)), by_layer=True, from_token=m.hit_tokens)
    assert done.done() and cache.stats()["host_pinned"] == 0
    assert not rows(pages, list(range(6, 12))).any()
    cache.release("b")
    clean(cache)


def test_bad_layer_arguments_name_the_problem_and_leave_the_match_loadable():
    cache, pages = make("page_first")
    prompt = stored(cache, pages, 6, seed=4)
    m = cache.match("b", prompt)
    blocks = list(range(6, 12))
    for bad in (3, -P, 7 * P):
        with pytest.raises(
            ValueError, match=rf"from_token={bad} must be a multiple of .* \[0, 24\]"
        ):
            cache.load(m, blocks, from_token=bad)
    cache.load(m, blocks, by_layer=True, from_token=2 * P)  # still loadable after the refusals
    assert torch.equal(rows(pages, blocks[2:]), rows(pages, list(range(2, 6))))
    cache.release("b")
    clean(cache)

    flat, _ = make("page_first", layers=0)
    flat.store("a", prompt, list(range(6)))
    m = flat.match("b", prompt)
    with pytest.raises(ValueError, match="by_layer needs layers= at construction"):
        flat.load(m, list(range(6, 12)), by_layer=True)
    flat.load(m, list(range(6, 12)))
    flat.release("a")
    flat.release("b")
    clean(flat)


def test_layers_that_do_not_divide_the_pool_are_refused_at_construction():
    with pytest.raises(ValueError, match="8 segments do not split into 3 equal layers"):
        make("layer_first", layers=3)
    with pytest.raises(ValueError, match="pages of 128 bytes do not split into 3 equal layers"):
        make("page_first", layers=3)


def test_by_layer_views_cover_each_layer_exactly():
    pool = torch.arange(2 * 64, dtype=torch.int32).view(2, 64).view(torch.uint8)  # 256-byte pages
    page_first = PagedBuffer.page_first(pool)
    views = page_first.by_layer(4)
    for i, view in enumerate(views):
        assert view.seg_bytes == (64,)
        assert torch.equal(view.segments[0], pool[:, i * 64 : (i + 1) * 64])
    tensors = [torch.full((3, 16), i, dtype=torch.uint8) for i in range(6)]  # K0 V0 K1 V1 K2 V2
    views = PagedBuffer.layer_first(tensors).by_layer(3)
    assert [[int(s[0, 0]) for s in v.segments] for v in views] == [[0, 1], [2, 3], [4, 5]]


# -- the plan ------------------------------------------------------------------------------------

PAGE_BYTES = 1 << 20  # 1 MiB per 16-token page
SPEED = PrefillSpeed(tokens_per_s=16 * 1024)  # a 16K-token hit recomputes in 1 s


def plan(read_bytes_per_s: float, **kw) -> object:
    return plan_fetch(
        16 * 1024,
        page_tokens=16,
        page_bytes=PAGE_BYTES,
        read_bytes_per_s=read_bytes_per_s,
        prefill=SPEED,
        **kw,
    )


def test_a_fast_tier_fetches_all_and_a_slow_one_recomputes_all():
    fast = plan(1e13)  # 1 GiB in 0.1 ms: less than one page's prefill
    assert (fast.kind, fast.head_tokens, fast.fetch_tokens) == ("fetch_all", 0, 16 * 1024)
    slow = plan(1e6)  # 1 GiB in ~1000 s against 1 s of prefill
    assert (slow.kind, slow.head_tokens, slow.fetch_s) == ("recompute_all", 16 * 1024, 0.0)
    assert slow.head_s == pytest.approx(1.0)


def test_a_tier_as_slow_as_recompute_splits_the_hit_in_half():
    # the whole hit takes 1 s either way: both halves take 0.5 s together
    p = plan(1024 * PAGE_BYTES)  # 1024 pages a second
    assert p.kind == "split" and p.head_tokens == 8 * 1024
    assert p.head_s == pytest.approx(0.5) and p.fetch_s == pytest.approx(0.5)
    assert p.finish_s == pytest.approx(0.5)


@pytest.mark.parametrize("ratio", [0.5, 0.8, 1.25, 2.0])
def test_the_split_is_no_worse_than_either_end_and_the_parts_finish_together(ratio):
    # the tier's time for the whole hit is `ratio` times its recompute time
    p = plan(1024 * PAGE_BYTES / ratio)
    best_end = min(1.0, ratio)
    assert p.finish_s <= best_end
    ideal = ratio / (1 + ratio)  # head = k / 16K s, fetch = ratio (1 - k / 16K) s
    assert p.finish_s == pytest.approx(ideal, abs=1 / 1024 * max(1, ratio))  # within a page
    assert abs(p.head_s - p.fetch_s) <= 2 / 1024 * max(1, ratio)


def test_the_plan_accounts_for_what_the_engine_holds_latency_and_context():
    p = plan(1024 * PAGE_BYTES, computed_tokens=4096, latency_s=0.1)
    assert 4096 < p.head_tokens < 16 * 1024 and p.head_tokens % 16 == 0
    assert p.fetch_s == pytest.approx(0.1 + (16 * 1024 - p.head_tokens) / 16 / 1024)
    slower = plan_fetch(
        16 * 1024,
        page_tokens=16,
        page_bytes=PAGE_BYTES,
        read_bytes_per_s=1024 * PAGE_BYTES,
        prefill=PrefillSpeed(16 * 1024, context_s_per_token2=1e-8),
    )
    assert slower.head_tokens < 8 * 1024  # prefill slows with context: recompute less


def test_prefill_speed_fits_two_measurements():
    truth = PrefillSpeed(20_000, 2e-9)
    fit = PrefillSpeed.fit((2048, truth.seconds(0, 2048)), (32768, truth.seconds(0, 32768)))
    assert fit.tokens_per_s == pytest.approx(20_000)
    assert fit.context_s_per_token2 == pytest.approx(2e-9)
    # a fixed cost per call dominating the short one: the long one's average speed
    overhead = PrefillSpeed.fit((2048, 0.5), (32768, 1.6))
    assert overhead.tokens_per_s == pytest.approx(32768 / 1.6)
    assert overhead.context_s_per_token2 == 0


def test_bad_plan_input_names_the_problem():
    with pytest.raises(ValueError, match="multiples of page_tokens=16"):
        plan_fetch(100, page_tokens=16, page_bytes=1, read_bytes_per_s=1.0, prefill=SPEED)
    with pytest.raises(ValueError, match="read_bytes_per_s > 0"):
        plan(0.0)
    with pytest.raises(ValueError, match="tokens_per_s > 0"):
        PrefillSpeed(0.0)
