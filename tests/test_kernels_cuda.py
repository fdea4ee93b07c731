"""Page copies on a CUDA GPU: every path, both directions, both pool shapes, exact bytes.

Run on a machine with a GPU: ``pytest -m cuda tests/test_kernels_cuda.py``. The first test
builds the extension (about a minute; cached afterwards).
"""

from __future__ import annotations

import pytest
import torch

from hicache.kernels import PagedBuffer, copy_pages
from hicache.kernels.cuda import (
    CudaRoute,
    choose_path,
    copy_pages_cuda,
    copy_pages_loop,
    load_extension,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

KiB = 1024
# Segment sizes: multiples of 16, not powers of two; the last spans several kernel chunks.
SEGMENTS = (48, 592, 208 * KiB + 16)


def _pool(pages: int, seg_bytes, where: str, seed: int, layer_first: bool) -> PagedBuffer:
    """Random bytes, on "cuda" or pinned "host"; layer-first: one tensor per segment."""
    g = torch.Generator().manual_seed(seed)
    device = "cuda" if where == "cuda" else "cpu"
    pin = where == "host"

    def block(cols: int) -> torch.Tensor:
        t = torch.randint(0, 256, (pages, cols), dtype=torch.uint8, generator=g)
        return t.to(device) if device == "cuda" else (t.pin_memory() if pin else t)

    if layer_first:
        return PagedBuffer.layer_first([block(b) for b in seg_bytes])
    return PagedBuffer.page_first(block(sum(seg_bytes))).resegment(seg_bytes)


def _snapshot(buf: PagedBuffer) -> list[torch.Tensor]:
    return [s.cpu().clone() for s in buf.segments]


def _expect(src: list[torch.Tensor], src_ids, dst: list[torch.Tensor], dst_ids) -> list:
    out = [d.clone() for d in dst]
    for s_seg, d_seg in zip(src, out, strict=True):
        d_seg[dst_ids.long()] = s_seg[src_ids.long()]
    return out


def _ids(n: int, src_pages: int, dst_pages: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, src_pages, (n,), generator=g, dtype=torch.int32),
        torch.randperm(dst_pages, generator=g)[:n].to(torch.int32),
    )


DIRECTIONS = {"h2d": ("host", "cuda"), "d2h": ("cuda", "host"), "d2d": ("cuda", "cuda")}
PATHS = [
    ("auto", {}),
    ("kernel", {}),
    ("kernel", {"chunk_bytes": 64, "max_blocks": 3}),
    ("copy_engine", {}),
    ("copy_engine", {"rows_per_call": 2}),
]


@pytest.mark.parametrize("direction", list(DIRECTIONS))
@pytest.mark.parametrize("layer_first", [False, True], ids=["page_first", "segmented"])
@pytest.mark.parametrize(
    ("path", "knobs"),
    PATHS,
    ids=["auto", "kernel", "kernel_small", "ce", "ce_2_rows_per_call"],
)
def test_copy_gives_exact_bytes(direction, layer_first, path, knobs):
    src_where, dst_where = DIRECTIONS[direction]
    src = _pool(23, SEGMENTS, src_where, seed=1, layer_first=layer_first and src_where == "cuda")
    dst = _pool(19, SEGMENTS, dst_where, seed=2, layer_first=layer_first and dst_where == "cuda")
    src_ids, dst_ids = _ids(11, 23, 19, seed=3)
    expected = _expect(_snapshot(src), src_ids, _snapshot(dst), dst_ids)
    stream = torch.cuda.Stream()

    if path == "auto":
        copy_pages(src, src_ids, dst, dst_ids, stream)
    else:
        copy_pages_cuda(src, src_ids, dst, dst_ids, stream, path=path, **knobs)
    stream.synchronize()

    for got, want in zip(_snapshot(dst), expected, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("direction", list(DIRECTIONS))
@pytest.mark.parametrize("path", ["copy_engine", "loop"])
def test_runs_of_consecutive_pages_are_merged_and_exact_both_ways(direction, path):
    """Rows adjacent on both sides are copied as one: runs going up, runs going down, a run
    that turns, and pages of a page-first pool next to each other (the whole page is one
    row)."""
    src_where, dst_where = DIRECTIONS[direction]
    src = _pool(40, (64 * KiB,), src_where, seed=4, layer_first=False)
    dst = _pool(40, (64 * KiB,), dst_where, seed=5, layer_first=False)
    src_ids = torch.tensor([3, 4, 5, 6, 20, 19, 18, 17, 30, 31, 30 - 1, 0], dtype=torch.int32)
    dst_ids = torch.tensor([10, 11, 12, 13, 9, 8, 7, 6, 30, 31, 29, 39], dtype=torch.int32)
    expected = _expect(_snapshot(src), src_ids, _snapshot(dst), dst_ids)
    stream = torch.cuda.Stream()
    if path == "loop":
        copy_pages_loop(src, src_ids, dst, dst_ids, stream)
    else:
        copy_pages_cuda(src, src_ids, dst, dst_ids, stream, path=path)
    stream.synchronize()
    for got, want in zip(_snapshot(dst), expected, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("staging_pages", [2, 4, 10, 64])
def test_staged_path_gives_exact_bytes(direction, staging_pages):
    """Whole pages through two GPU staging buffers taking turns, in parts of `staging_pages` / 2
    pages (11 pages: parts of 1, 2 and 5 + 5 + 1, and all at once)."""
    src_where, dst_where = DIRECTIONS[direction]
    src = _pool(23, SEGMENTS, src_where, seed=21, layer_first=src_where == "cuda")
    dst = _pool(19, SEGMENTS, dst_where, seed=22, layer_first=dst_where == "cuda")
    src_ids, dst_ids = _ids(11, 23, 19, seed=23)
    expected = _expect(_snapshot(src), src_ids, _snapshot(dst), dst_ids)
    stream = torch.cuda.Stream()
    staging = staging_pages * sum(SEGMENTS)
    path = copy_pages_cuda(src, src_ids, dst, dst_ids, stream, path="staged", staging_bytes=staging)
    stream.synchronize()
    assert path == "staged"
    for got, want in zip(_snapshot(dst), expected, strict=True):
        assert torch.equal(got, want)


def test_auto_stages_small_rows_of_a_page_first_host_pool():
    gpu = _pool(4, (32 * KiB, 32 * KiB), "cuda", seed=24, layer_first=True)
    host = _pool(4, (32 * KiB, 32 * KiB), "host", seed=25, layer_first=False)
    assert choose_path(host, gpu) == choose_path(gpu, host) == "staged"
    small = _pool(4, (16 * KiB, 16 * KiB), "cuda", seed=26, layer_first=True)
    small_host = _pool(4, (16 * KiB, 16 * KiB), "host", seed=27, layer_first=False)
    assert choose_path(small_host, small) == "kernel"  # 32 KiB pages: below the copy engines
    other = _pool(4, (32 * KiB, 32 * KiB), "cuda", seed=28, layer_first=True)
    assert choose_path(gpu, other) == "kernel"  # GPU to GPU
    big = _pool(4, (64 * KiB,), "cuda", seed=29, layer_first=False)
    big_host = _pool(4, (64 * KiB,), "host", seed=30, layer_first=False)
    assert choose_path(big_host, big) == "copy_engine"
    with pytest.raises(ValueError, match="staged path needs one side in host memory"):
        copy_pages_cuda(gpu, torch.tensor([0]), other, torch.tensor([1]), path="staged")


@pytest.mark.parametrize("page_bytes", [16, 4 * 1024 * KiB + 16])
def test_single_segment_pages_of_odd_sizes(page_bytes):
    src = _pool(6, (page_bytes,), "cuda", seed=4, layer_first=False)
    dst = _pool(5, (page_bytes,), "host", seed=5, layer_first=False)
    src_ids, dst_ids = torch.tensor([5, 0, 3], dtype=torch.int64), torch.tensor([1, 4, 0])
    expected = _expect(_snapshot(src), src_ids, _snapshot(dst), dst_ids)
    copy_pages(src, src_ids, dst, dst_ids)
    torch.cuda.current_stream().synchronize()
    assert torch.equal(_snapshot(dst)[0], expected[0])


def test_copy_engine_path_keeps_order_on_the_legacy_default_stream():
    """cudaMemcpyBatchAsync refuses the legacy default stream: the copy goes through a side
    stream, after what the default stream had and before what it gets next."""
    src = _pool(7, SEGMENTS, "cuda", seed=19, layer_first=True)
    dst = _pool(7, SEGMENTS, "cuda", seed=20, layer_first=False)
    src_ids, dst_ids = _ids(5, 7, 7, seed=21)
    expected = _expect([s + 1 for s in _snapshot(src)], src_ids, _snapshot(dst), dst_ids)
    load_extension()
    default = torch.cuda.default_stream()
    with torch.cuda.stream(default):
        torch.cuda._sleep(50_000_000)
        for seg in src.segments:
            seg.add_(1)  # enqueued before the copy: the copy must see it
        copy_pages_cuda(src, src_ids, dst, dst_ids, default, path="copy_engine")
        after = [seg.clone() for seg in dst.segments]  # enqueued after: must see the copy
    default.synchronize()
    for got, want in zip(after, expected, strict=True):
        assert torch.equal(got.cpu(), want)


def test_per_page_loop_baseline_gives_exact_bytes():
    src = _pool(9, SEGMENTS, "host", seed=6, layer_first=False)
    dst = _pool(9, SEGMENTS, "cuda", seed=7, layer_first=True)
    src_ids, dst_ids = _ids(5, 9, 9, seed=8)
    expected = _expect(_snapshot(src), src_ids, _snapshot(dst), dst_ids)
    stream = torch.cuda.Stream()
    copy_pages_loop(src, src_ids, dst, dst_ids, stream)
    stream.synchronize()
    for got, want in zip(_snapshot(dst), expected, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("path", ["kernel", "copy_engine"])
def test_empty_lists_copy_nothing(path):
    src = _pool(4, SEGMENTS, "host", seed=9, layer_first=False)
    dst = _pool(4, SEGMENTS, "cuda", seed=10, layer_first=True)
    before = _snapshot(dst)
    empty = torch.empty(0, dtype=torch.int32)
    copy_pages(src, empty, dst, empty)
    copy_pages_cuda(src, empty, dst, empty, path=path)
    torch.cuda.synchronize()
    for got, want in zip(_snapshot(dst), before, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("path", ["kernel", "copy_engine", "staged"])
def test_calls_return_while_the_stream_is_busy_and_keep_their_ids(path):
    """Many calls are queued behind a long kernel: none waits for it, and each one's ids (read
    during the call: the kernel's travel in its parameters) hold until the stream reaches it; on
    the staged path the two staging buffers are reused call after call, in order."""
    src = _pool(64, (4 * KiB,), "host", seed=11, layer_first=False)
    dst = _pool(64, (4 * KiB,), "cuda", seed=12, layer_first=False)
    expected = _snapshot(dst)
    load_extension()  # a first build must not run while the stream sleeps
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(2_000_000_000)  # about a second on current GPUs
    for call in range(40):
        src_ids, dst_ids = _ids(8, 64, 64, seed=100 + call)
        copy_pages_cuda(src, src_ids, dst, dst_ids, stream, path=path)
        expected = _expect(_snapshot(src), src_ids, expected, dst_ids)
    assert not stream.query(), "copy_pages waited for the stream"
    stream.synchronize()
    assert torch.equal(_snapshot(dst)[0], expected[0])


ROUTE_POOLS = {
    "copy_engine": ((64 * KiB,), False),
    "kernel": ((16 * KiB,), False),
    "staged": ((16 * KiB, 16 * KiB, 32 * KiB), True),
}


@pytest.mark.native  # the paths of the compiled extension
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("path", list(ROUTE_POOLS))
def test_a_route_copies_exact_bytes_on_its_path_call_after_call(direction, path):
    """A cache's route (checked once, numpy ids, a raw stream handle) between a page-first host
    pool and a GPU pool whose rows choose `path`: 4,364 pages in one call (a launch of the
    kernel's large id batch and one of its small one; 18 parts of the staged path, its two
    buffers taking turns), then four calls of a few pages each on a second stream, exact after
    each."""
    segs, layer_first = ROUTE_POOLS[path]
    host = _pool(4500, segs, "host", seed=40, layer_first=False)
    gpu = _pool(4400, segs, "cuda", seed=41, layer_first=layer_first)
    src, dst = (host, gpu) if direction == "h2d" else (gpu, host)
    route = CudaRoute(src, dst)
    assert route.path == path
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    expected = _snapshot(dst)
    for call, n in enumerate((4364, 3, 40, 1, 17)):
        src_ids, dst_ids = _ids(n, src.num_pages, dst.num_pages, seed=50 + call)
        expected = _expect(_snapshot(src), src_ids, expected, dst_ids)
        stream = streams[min(call, 1)]
        route.copy(src_ids.numpy(), dst_ids.numpy(), stream.cuda_stream)
        stream.synchronize()
        for got, want in zip(_snapshot(dst), expected, strict=True):
            assert torch.equal(got, want)


def _vllm_layers(layers: int, blocks: int, seed: int, kv_dim: int) -> list[torch.Tensor]:
    """vLLM's GPU KV caches for an 8B model's shapes: per layer its own (2, blocks, 16, 8, 128)
    bf16 tensor (kv_dim 0, FlashAttention) or (blocks, 2, 16, 8, 128) (kv_dim 1)."""
    g = torch.Generator().manual_seed(seed)
    shape = (2, blocks, 16, 8, 128) if kv_dim == 0 else (blocks, 2, 16, 8, 128)
    return [torch.randn(shape, generator=g).to(torch.bfloat16).cuda() for _ in range(layers)]


@pytest.mark.parametrize("kv_dim", [0, 1])
@pytest.mark.parametrize("path", ["auto", "kernel", "copy_engine", "staged"])
def test_vllm_kv_caches_copy_exact_bytes_both_ways(path, kv_dim):
    """Separately allocated per-layer caches (32 KiB of K and of V per block) to a page-first
    pinned host pool of whole pages and back into fresh caches, random ids on both sides; "auto"
    stages (rows of 32 KiB, pages of 256 KiB)."""
    layers = _vllm_layers(4, 12, seed=60, kv_dim=kv_dim)
    gpu = PagedBuffer.from_kv_tensors(layers, kv_dim=kv_dim)
    assert gpu.seg_bytes == (32 * KiB,) * 8
    pool = torch.zeros(20, gpu.page_bytes, dtype=torch.uint8).pin_memory()
    host = PagedBuffer.page_first(pool).resegment(gpu.seg_bytes)
    assert choose_path(gpu, host) == choose_path(host, gpu) == "staged"
    src_ids, host_ids = _ids(9, 12, 20, seed=61)
    stream = torch.cuda.Stream()

    def copy(a, a_ids, b, b_ids):
        if path == "auto":
            copy_pages(a, a_ids, b, b_ids, stream)
        else:  # staged: two pages a part, five parts
            staging = 4 * gpu.page_bytes
            copy_pages_cuda(a, a_ids, b, b_ids, stream, path=path, staging_bytes=staging)

    copy(gpu, src_ids, host, host_ids)  # GPU -> host
    stream.synchronize()
    for s, h in zip(src_ids.tolist(), host_ids.tolist(), strict=True):
        page = [t.select(kv_dim, kv)[s].cpu().reshape(-1) for t in layers for kv in (0, 1)]
        assert torch.equal(pool[h], torch.cat(page).view(torch.uint8))

    fresh = [torch.zeros_like(t) for t in layers]
    back = torch.randperm(12, generator=torch.Generator().manual_seed(62))[:9].to(torch.int32)
    copy(host, host_ids, PagedBuffer.from_kv_tensors(fresh, kv_dim=kv_dim), back)  # and back
    stream.synchronize()
    for t, f in zip(layers, fresh, strict=True):
        want = torch.zeros_like(t)
        for s, b in zip(src_ids.tolist(), back.tolist(), strict=True):
            want.select(kv_dim, 0)[b] = t.select(kv_dim, 0)[s]
            want.select(kv_dim, 1)[b] = t.select(kv_dim, 1)[s]
        assert torch.equal(f.view(torch.int16), want.view(torch.int16))


def test_staged_load_and_store_at_once_give_exact_bytes():
    """A load (host -> GPU) and a store (GPU -> host) on the staged path on two streams at once:
    each Stager has its own side stream, and neither waits for the other."""
    gpu_in = PagedBuffer.from_kv_tensors(_vllm_layers(2, 10, seed=64, kv_dim=0))
    gpu_out = PagedBuffer.from_kv_tensors(_vllm_layers(2, 10, seed=65, kv_dim=0))
    host_in = _pool(14, gpu_in.seg_bytes, "host", seed=66, layer_first=False)
    host_out = _pool(14, gpu_in.seg_bytes, "host", seed=67, layer_first=False)
    load_ids, store_ids = _ids(8, 14, 10, seed=68), _ids(8, 10, 14, seed=69)
    want_in = _expect(_snapshot(host_in), load_ids[0], _snapshot(gpu_in), load_ids[1])
    want_out = _expect(_snapshot(gpu_out), store_ids[0], _snapshot(host_out), store_ids[1])
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    staging = 2 * gpu_in.page_bytes  # a page a part: eight parts each way
    load_extension()
    for s in streams:
        with torch.cuda.stream(s):
            torch.cuda._sleep(10_000_000)  # both enqueued before either starts
    for src, ids, dst, s in (
        (host_in, load_ids, gpu_in, streams[0]),
        (gpu_out, store_ids, host_out, streams[1]),
    ):
        path = copy_pages_cuda(src, ids[0], dst, ids[1], s, path="staged", staging_bytes=staging)
        assert path == "staged"
    torch.cuda.synchronize()
    for got, want in zip(_snapshot(gpu_in) + _snapshot(host_out), want_in + want_out, strict=True):
        assert torch.equal(got, want)


def test_unpinned_host_memory_is_rejected():
    src = _pool(4, (64,), "cpu", seed=13, layer_first=False)
    dst = _pool(4, (64,), "cuda", seed=14, layer_first=False)
    with pytest.raises(ValueError, match="src is host memory that is not pinned"):
        copy_pages(src, torch.tensor([0]), dst, torch.tensor([1]))


def test_ids_on_the_gpu_are_rejected():
    src = _pool(4, (64,), "host", seed=15, layer_first=False)
    dst = _pool(4, (64,), "cuda", seed=16, layer_first=False)
    with pytest.raises(ValueError, match="src_ids must be on the CPU, got cuda:0"):
        copy_pages(src, torch.tensor([0], device="cuda"), dst, torch.tensor([1]))


def test_misaligned_cuda_rows_are_rejected():
    src = PagedBuffer.page_first(torch.zeros(4, 40, dtype=torch.uint8, device="cuda"))
    dst = PagedBuffer.page_first(torch.zeros(4, 40, dtype=torch.uint8).pin_memory())
    with pytest.raises(ValueError, match="src segment 0: row size 40 is not a multiple of 16"):
        copy_pages(src, torch.tensor([0]), dst, torch.tensor([1]))


def test_unknown_path_is_rejected():
    src = _pool(4, (64,), "host", seed=17, layer_first=False)
    dst = _pool(4, (64,), "cuda", seed=18, layer_first=False)
    with pytest.raises(ValueError, match="path must be one of"):
        copy_pages_cuda(src, torch.tensor([0]), dst, torch.tensor([1]), path="dma")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_buffers_on_two_gpus_are_rejected():
    src = PagedBuffer.page_first(torch.zeros(4, 64, dtype=torch.uint8, device="cuda:0"))
    dst = PagedBuffer.page_first(torch.zeros(4, 64, dtype=torch.uint8, device="cuda:1"))
    with pytest.raises(ValueError, match="one device only"):
        copy_pages(src, torch.tensor([0]), dst, torch.tensor([1]))
