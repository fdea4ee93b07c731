"""The cache on a GPU: pinned host pools, copies on the engine's stream, completion by events.

Run on a machine with CUDA (skipped elsewhere): ``pytest -m cuda tests/test_cache_cuda.py``.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from hicache import HiCache, Layout, PagedBuffer, load_config

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

P = 16


def make(pool: PagedBuffer, layout: Layout) -> HiCache:
    cfg = load_config({"tiers": [{"type": "host", "size": 64 * layout.page_size}]}, env={})
    cache = HiCache(cfg, pool, layout=layout)
    assert cache.wait_ready(60)
    assert cache.host.pinned
    return cache


def fill(pages: PagedBuffer, blocks: list[int], seed: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(seed)
    for seg in pages.segments:
        rows = torch.randint(
            0, 256, (len(blocks), seg.shape[1]), dtype=torch.uint8, device="cuda", generator=g
        )
        seg[torch.tensor(blocks, device="cuda")] = rows


def rows(pages: PagedBuffer, blocks: list[int]) -> torch.Tensor:
    idx = torch.tensor(blocks, device="cuda")
    return torch.cat([seg[idx] for seg in pages.segments], dim=1).cpu()


@pytest.mark.parametrize("stream_kind", ["default", "side"])
@pytest.mark.parametrize("shape", ["page_first", "layer_first"])
def test_store_then_load_gives_exact_bytes_on_the_engine_stream(stream_kind, shape):
    if shape == "page_first":
        pool = torch.zeros(32, 2, 8, P, 128, dtype=torch.bfloat16, device="cuda")  # 64 KiB pages
        pages = PagedBuffer.page_first(pool)
        layout = Layout(model="m", kv_dtype="bfloat16", page_tokens=P, page_bytes=pages.page_bytes)
    else:
        layers = [torch.zeros(32, P, 4, 128, dtype=torch.bfloat16, device="cuda") for _ in range(6)]
        pages = PagedBuffer.layer_first(layers)
        layout = Layout(model="m", kv_dtype="bfloat16", page_tokens=P, segments=pages.seg_bytes)
    cache = make(pages, layout)
    stream = torch.cuda.current_stream() if stream_kind == "default" else torch.cuda.Stream()
    prompt = np.arange(10 * P + 3, dtype=np.int32)
    with torch.cuda.stream(stream):
        fill(pages, list(range(10)), seed=1)
        want = rows(pages, list(range(10)))
        assert cache.store("a", prompt, list(range(10))) == 10
        cache.release("a")
        m = cache.match("b", prompt)
        assert (m.hit_tokens, m.load_pages) == (10 * P, 10)
        fill(pages, list(range(10, 20)), seed=2)  # poison the target blocks
        done = cache.load(m, list(range(10, 20)))
        got = rows(pages, list(range(10, 20)))  # ordered after the load on the same stream
    stream.synchronize()
    assert done.done()
    assert torch.equal(got, want)
    cache.poll()
    s = cache.stats()
    assert (s["host_pinned"], s["copies_in_flight"], s["pages_loaded"]) == (0, 0, 10)
    cache.release("b")
    cache.close()


@pytest.mark.native  # torch's fallback copies to the host wait for the stream
def test_calls_return_while_the_stream_is_busy():
    pool = torch.zeros(64, 1 << 20, dtype=torch.uint8, device="cuda")  # 1 MiB pages
    pages = PagedBuffer.page_first(pool)
    layout = Layout(model="m", kv_dtype="uint8", page_tokens=P, page_bytes=1 << 20)
    cache = make(pages, layout)
    prompt = np.arange(32 * P + 1, dtype=np.int32)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)  # hold the stream for a while (~0.1 s)
        cache.store("a", prompt, list(range(32)))
        cache.poll()
        assert cache.stats()["copies_in_flight"] == 1  # not retired: the copy has not run yet
    stream.synchronize()
    cache.poll()
    assert cache.stats()["copies_in_flight"] == 0
    cache.release("a")
    cache.close()


@pytest.mark.native  # the extension's events are reused; torch's are not
def test_a_retired_copy_hands_its_event_to_the_next_and_stays_done():
    from hicache.kernels import route
    from hicache.kernels.completions import Transfers

    gpu = PagedBuffer.page_first(torch.zeros(4, 1 << 16, dtype=torch.uint8, device="cuda"))
    host = PagedBuffer.page_first(torch.zeros(4, 1 << 16, dtype=torch.uint8).pin_memory())
    stream = torch.cuda.Stream()
    transfers = Transfers(torch.device("cuda", torch.cuda.current_device()), stream)
    to_host, ids, ran = route(gpu, host), np.arange(4, dtype=np.int32), []
    transfers.copy(to_host, ids, ids)
    first = transfers.then(lambda: ran.append("first"))
    event = first.event
    stream.synchronize()
    assert transfers.poll() == 1
    assert first.event is None and first.done()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)  # hold the stream: the next copy stays in flight
    transfers.copy(to_host, ids, ids)
    second = transfers.then(lambda: ran.append("second"))
    assert second.event is event  # recorded again, not made anew
    assert first.done() and not second.done()
    assert transfers.poll() == 0 and ran == ["first"]
    stream.synchronize()
    assert transfers.poll() == 1 and ran == ["first", "second"]


@pytest.mark.mooncake
def test_write_behind_queued_before_the_copy_ran_puts_the_copied_bytes(mooncake_master):
    """store queues the L3 put at once, while the engine's stream still holds the copy back: the
    put worker must wait for the copy's event, so another cache reads the GPU's bytes from L3,
    never the stale host slots."""
    layout = Layout(model="m", kv_dtype="uint8", page_tokens=P, page_bytes=64 << 10)
    tier = {"type": "mooncake", **mooncake_master.tier_config, "group_pages": 4}

    def cache_on(pages: PagedBuffer) -> HiCache:
        host = {"type": "host", "size": 64 * layout.page_size}
        cfg = load_config({"tiers": [host, tier], "policy": {"prefill_tokens_per_s": 1}}, env={})
        cache = HiCache(cfg, pages, layout=layout)
        assert cache.wait_ready(60)
        return cache

    src = PagedBuffer.page_first(torch.zeros(64, 64 << 10, dtype=torch.uint8, device="cuda"))
    dst = PagedBuffer.page_first(torch.zeros(64, 64 << 10, dtype=torch.uint8, device="cuda"))
    writer, reader = cache_on(src), cache_on(dst)
    prompt = np.arange(16 * P + 1, dtype=np.int32) + 7
    blocks = list(range(8, 24))
    fill(src, blocks, seed=3)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)  # the copy runs ~0.1 s after store returns
        writer.store("w", prompt, blocks)
        assert writer.stats()["jobs_in_flight_mooncake"] == 1  # queued already, before the copy ran
    deadline = time.monotonic() + 30
    while not writer.tiers_idle and time.monotonic() < deadline:
        writer.poll()
        time.sleep(0.005)
    assert writer.stats()["objects_put_mooncake"] == 4
    m = reader.match("r", prompt)
    while m.pending and time.monotonic() < deadline:
        reader.poll()
        time.sleep(0.005)
        m = reader.match("r", prompt)
    assert (m.hit_tokens, m.fetched_tokens) == (16 * P, 16 * P)
    out = list(range(40, 56))
    reader.load(m, out)
    torch.cuda.synchronize()
    assert torch.equal(rows(dst, out), rows(src, blocks))
    for cache, rid in ((writer, "w"), (reader, "r")):
        cache.release(rid)
        cache.close()


def _pool_for(path: str, pages: int) -> tuple[PagedBuffer, Layout]:
    """A GPU pool whose copies to and from a page-first host pool take `path`: 64 KiB pages
    (copy engines), 16 KiB pages (the kernel), or 64 KiB pages in four layers of 16 KiB rows
    (staged)."""
    if path == "staged":
        layers = [torch.zeros(pages, 16 << 10, dtype=torch.uint8, device="cuda") for _ in range(4)]
        pool = PagedBuffer.layer_first(layers)
        return pool, Layout(model="m", kv_dtype="uint8", page_tokens=P, segments=pool.seg_bytes)
    size = (64 if path == "copy_engine" else 16) << 10
    pool = PagedBuffer.page_first(torch.zeros(pages, size, dtype=torch.uint8, device="cuda"))
    return pool, Layout(model="m", kv_dtype="uint8", page_tokens=P, page_bytes=size)


@pytest.mark.mooncake
@pytest.mark.native  # the extension's paths keep the GIL; torch's fallback does not
@pytest.mark.parametrize("path", ["copy_engine", "kernel", "staged"])
def test_no_engine_thread_call_lets_go_of_the_gil_on_any_path(mooncake_master, path):
    """As on the CPU (test_mooncake_tier.py), with CUDA copies on each path: the extension's copy
    calls and the completion events keep the GIL (torch's Event.record and tensor copies would
    let go of it). 600 pages: numpy releases the GIL for arrays of more than a few hundred
    elements."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from gil_watch import GilWatch

    pages, n = 640, 600
    src, layout = _pool_for(path, pages)
    dst, _ = _pool_for(path, pages)
    tier = {"type": "mooncake", **mooncake_master.tier_config, "group_pages": 4}
    host = {"type": "host", "size": 2 * pages * layout.page_size}
    cfg = load_config({"tiers": [host, tier], "policy": {"prefill_tokens_per_s": 1}}, env={})

    def cache_on(pool: PagedBuffer) -> HiCache:
        cache = HiCache(cfg, pool, layout=layout)
        assert cache.wait_ready(60)
        return cache

    writer, reader = cache_on(src), cache_on(dst)
    prompt = np.random.default_rng(5).integers(0, 30_000, n * P + 1, dtype=np.int32)
    blocks = list(range(n))
    fill(src, blocks, seed=9)
    writer.store("w", prompt, blocks)
    deadline = time.monotonic() + 60
    while not writer.tiers_idle and time.monotonic() < deadline:
        writer.poll()
        time.sleep(0.005)
    watch, released = GilWatch(), []

    def call(name: str, fn, *args):
        gave_up, result = watch.released(fn, *args)
        if gave_up:
            released.append(name)
        return result

    try:
        m = call("match", reader.match, "r", prompt)
        while m.pending and time.monotonic() < deadline:
            time.sleep(0.005)
            call("poll", reader.poll)
            m = call("match", reader.match, "r", prompt)
        out = list(range(pages - 1, pages - 1 - n, -1))
        call("load", reader.load, m, out)
        call("store", reader.store, "r", prompt, out)
        torch.cuda.synchronize()
        call("poll", reader.poll)
    finally:
        watch.close()
    assert (m.hit_tokens, m.fetched_tokens) == (n * P, n * P)
    assert torch.equal(rows(dst, out), rows(src, blocks))
    assert released == []
    assert {route.path for route in (reader._routes.to_host, reader._routes.to_gpu)} == {path}
    for cache, rid in ((writer, "w"), (reader, "r")):
        cache.release(rid)
        cache.close()
