"""Loads layer by layer on a GPU: exact bytes, a copy stream ordered after the engine's, and an
engine stream that waits for one layer's pages at a time while the later layers are in flight.

Run on a machine with CUDA (skipped elsewhere): ``pytest -m cuda tests/test_layerwise_cuda.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_cache_cuda import fill, rows

from hicache import HiCache, Layout, PagedBuffer, load_config

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

P = 16


def make(pages: PagedBuffer, layout: Layout, layers: int, host_pages: int) -> HiCache:
    size = host_pages * layout.page_size
    cfg = load_config({"tiers": [{"type": "host", "size": size}]}, env={})
    cache = HiCache(cfg, pages, layout=layout, layers=layers)
    assert cache.wait_ready(120)
    assert cache.host.pinned
    return cache


def build(shape: str, layers: int, layer_bytes: int, blocks: int = 32):
    """A cache over a page-first pool (a page: layer after layer), a layer-first one (a K and
    a V tensor per layer) or vLLM's (one K/V tensor per layer, as its connector registers)."""
    if shape == "page_first":
        pool = torch.zeros(blocks, layers, layer_bytes, dtype=torch.uint8, device="cuda")
        pages = PagedBuffer.page_first(pool)
        layout = Layout(model="m", kv_dtype="uint8", page_tokens=P, page_bytes=pages.page_bytes)
    elif shape == "vllm":  # vLLM's: one (2, blocks, P, heads, 128) bf16 tensor a layer
        heads = layer_bytes // (2 * P * 128 * 2)
        tensors = [
            torch.zeros(2, blocks, P, heads, 128, dtype=torch.bfloat16, device="cuda")
            for _ in range(layers)
        ]
        pages = PagedBuffer.from_kv_tensors(tensors, kv_dim=0)
        layout = Layout(model="m", kv_dtype="bfloat16", page_tokens=P, segments=pages.seg_bytes)
    else:
        half = layer_bytes // 2
        tensors = [
            torch.zeros(blocks, half, dtype=torch.uint8, device="cuda") for _ in range(2 * layers)
        ]
        pages = PagedBuffer.layer_first(tensors)
        layout = Layout(model="m", kv_dtype="uint8", page_tokens=P, segments=pages.seg_bytes)
    return make(pages, layout, layers, host_pages=blocks), pages


def layer_rows(pages: PagedBuffer, layers: int, layer: int, blocks: list[int]) -> torch.Tensor:
    return rows(pages.by_layer(layers)[layer], blocks)


@pytest.mark.parametrize("stream_kind", ["default", "side"])
@pytest.mark.parametrize(
    ("shape", "layer_bytes"),
    [
        ("page_first", 512 << 10),
        ("page_first", 32 << 10),
        ("layer_first", 64 << 10),
        ("vllm", 64 << 10),
    ],
)
def test_a_load_by_layer_gives_exact_bytes_once_the_stream_waited_for_each_layer(
    stream_kind, shape, layer_bytes
):
    layers = 4
    cache, pages = build(shape, layers, layer_bytes)
    stream = torch.cuda.current_stream() if stream_kind == "default" else torch.cuda.Stream()
    prompt = np.arange(10 * P + 3, dtype=np.int32)
    with torch.cuda.stream(stream):
        fill(pages, list(range(10)), seed=1)
        want = rows(pages, list(range(10)))
        assert cache.store("a", prompt, list(range(10))) == 10
        cache.release("a")
        m = cache.match("b", prompt)
        target = list(range(10, 20))
        # the engine's last use of the target blocks, still running when the load is asked:
        # the copy stream must start after it, or these bytes would land on the loaded ones
        torch.cuda._sleep(100_000_000)
        fill(pages, target, seed=2)
        loading = cache.load(m, target, by_layer=True)
        got = []
        for layer in range(layers):
            loading.wait_layer(layer)  # the engine's stream, not the host, waits
            got.append(layer_rows(pages, layers, layer, target))
    stream.synchronize()
    for layer in range(layers):
        assert torch.equal(got[layer], layer_rows(pages, layers, layer, list(range(10))))
    assert torch.equal(rows(pages, target), want)
    cache.poll()
    s = cache.stats()
    assert (s["host_pinned"], s["copies_in_flight"], s["pages_loaded"]) == (0, 0, 10)
    assert loading.done()
    loading.wait_layer(layers - 1)  # retired: nothing left to wait for
    cache.release("b")
    cache.close()


def test_a_partial_load_by_layer_copies_the_tail_only():
    layers = 4
    cache, pages = build("layer_first", layers, 64 << 10)
    prompt = np.arange(12 * P + 1, dtype=np.int32)
    fill(pages, list(range(12)), seed=4)
    cache.store("a", prompt, list(range(12)))
    m = cache.match("b", prompt)
    target = list(range(12, 24))
    loading = cache.load(m, target, by_layer=True, from_token=5 * P)
    loading.wait_layer(layers - 1)  # in order on one stream: the last layer means all
    torch.cuda.current_stream().synchronize()
    assert torch.equal(rows(pages, target[5:]), rows(pages, list(range(5, 12))))
    assert not rows(pages, target[:5]).any()
    cache.poll()
    cache.release("a")
    cache.release("b")
    assert cache.stats()["host_pinned"] == 0
    cache.close()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_refengine_on_the_gpu_answers_exactly_with_loads_by_layer_and_partial_fetches(family):
    from test_refengine_hicache import HOST, SHAPES

    from hicache.tools.refengine.build import EngineSpec, build_engine
    from hicache.tools.refengine.model import Transformer
    from hicache.tools.refengine.workload import drive, make_workload

    cfg = SHAPES[family]
    model = Transformer.random(cfg, seed=11, device="cuda"), f"{cfg.name}@random-seed11"
    convs = make_workload(
        conversations=2,
        turns=3,
        first_tokens=150,
        message_tokens=40,
        answer_tokens=5,
        vocab_size=1000,
        seed=9,
    )
    spec = dict(
        page_tokens=P, num_blocks=256, num_slots=8, chunk_tokens=64, device="cuda", prefix_share=0.0
    )
    off = drive(build_engine(EngineSpec(**spec), model=model), convs)
    for share in (None, 0.5):
        eng = build_engine(EngineSpec(**spec, by_layer=True), HOST, model=model)
        if share is not None:
            eng.planner = lambda req, m, share=share: int(m.hit_tokens * share) // P * P
        on = drive(eng, convs)
        assert [[r.output for r in c] for c in on] == [[r.output for r in c] for c in off]
        assert sum(r.hit_tokens for c in on for r in c) > 0
        eng.cache.close()
