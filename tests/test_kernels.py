"""Page copies on the CPU: exact bytes for both pool shapes, and the argument checks."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from hicache.kernels import ALIGNMENT, PagedBuffer, copy_pages
from hicache.kernels.cuda import choose_path, toolchain_problem


def _random_bytes(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)


def _pairs(n: int, src_pages: int, dst_pages: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    src_ids = torch.randint(0, src_pages, (n,), generator=g)  # a source page may repeat
    dst_ids = torch.randperm(dst_pages, generator=g)[:n]
    return src_ids, dst_ids


@pytest.mark.parametrize("page_bytes", [16, 48, 592, 16 * 37 * 11])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_page_first_copy_moves_exactly_the_listed_pages(page_bytes, id_dtype):
    src_pool = _random_bytes(40, page_bytes, seed=1)
    dst_pool = _random_bytes(30, page_bytes, seed=2)
    before = dst_pool.clone()
    src_ids, dst_ids = _pairs(17, 40, 30, seed=3)

    copy_pages(
        PagedBuffer.page_first(src_pool),
        src_ids.to(id_dtype),
        PagedBuffer.page_first(dst_pool),
        dst_ids.to(id_dtype),
    )

    expected = before.clone()
    for s, d in zip(src_ids.tolist(), dst_ids.tolist(), strict=True):
        expected[d] = src_pool[s]
    assert torch.equal(dst_pool, expected)


def _layer_pools(num_pages: int, seed: int) -> list[torch.Tensor]:
    """Three 'layers' of different dtypes and shapes: rows of 64, 96 and 592 bytes."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(num_pages, 4, 8, generator=g).to(torch.float16),
        torch.randn(num_pages, 3, 16, generator=g).to(torch.bfloat16),
        torch.randn(num_pages, 148, generator=g),
    ]


def test_segmented_pool_round_trips_through_a_page_first_pool():
    layers = _layer_pools(12, seed=4)
    engine = PagedBuffer.layer_first(layers)
    assert engine.seg_bytes == (64, 96, 592)
    host_pool = _random_bytes(20, engine.page_bytes, seed=5)
    host = PagedBuffer.page_first(host_pool).resegment(engine.seg_bytes)
    src_ids, dst_ids = _pairs(7, 12, 20, seed=6)

    copy_pages(engine, src_ids, host, dst_ids)  # device-to-host direction of a real cache

    for s, d in zip(src_ids.tolist(), dst_ids.tolist(), strict=True):
        page = torch.cat([t[s].reshape(-1).view(torch.uint8) for t in layers])
        assert torch.equal(host_pool[d], page)

    fresh = [torch.zeros_like(t) for t in layers]
    copy_pages(host, dst_ids, PagedBuffer.layer_first(fresh), src_ids)  # and back

    for t, f in zip(layers, fresh, strict=True):
        touched = torch.zeros(12, dtype=torch.bool)
        touched[src_ids] = True
        assert torch.equal(f[touched], t[touched])
        assert not f[~touched].any()


def test_empty_id_lists_copy_nothing():
    src_pool = _random_bytes(4, 32, seed=7)
    dst_pool = _random_bytes(4, 32, seed=8)
    before = dst_pool.clone()
    empty = torch.empty(0, dtype=torch.int64)
    copy_pages(PagedBuffer.page_first(src_pool), empty, PagedBuffer.page_first(dst_pool), empty)
    assert torch.equal(dst_pool, before)


# -- argument checks ---------------------------------------------------------------------------


def _buffers(page_bytes: int = 32, pages: int = 4) -> tuple[PagedBuffer, PagedBuffer]:
    return (
        PagedBuffer.page_first(torch.zeros(pages, page_bytes, dtype=torch.uint8)),
        PagedBuffer.page_first(torch.zeros(pages, page_bytes, dtype=torch.uint8)),
    )


def _ids(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def test_row_size_that_is_not_a_multiple_of_16_is_rejected():
    src, dst = _buffers(page_bytes=24)
    with pytest.raises(ValueError, match=f"row size 24 is not a multiple of {ALIGNMENT}"):
        copy_pages(src, _ids(0), dst, _ids(1))


def test_row_stride_that_is_not_a_multiple_of_16_is_rejected():
    rows = torch.zeros(4, 24, dtype=torch.uint8)[:, :16]  # 16-byte rows, 24 bytes apart
    src = PagedBuffer.page_first(rows)
    _, dst = _buffers(page_bytes=16)
    with pytest.raises(ValueError, match="src segment 0: row stride 24"):
        copy_pages(src, _ids(0), dst, _ids(1))


def test_misaligned_address_is_rejected():
    flat = torch.zeros(8 + 4 * 32, dtype=torch.uint8)
    src = PagedBuffer.page_first(flat[8:].view(4, 32))
    _, dst = _buffers()
    with pytest.raises(ValueError, match=r"src segment 0: address \d+ is not a multiple of 16"):
        copy_pages(src, _ids(0), dst, _ids(1))


@pytest.mark.parametrize(
    ("src_ids", "dst_ids", "message"),
    [
        (_ids(4), _ids(0), r"src_ids holds an id outside \[0, 4\)"),
        (_ids(0), _ids(-1), r"dst_ids holds an id outside \[0, 4\)"),
        (_ids(0, 1), _ids(2), "src_ids has 2 ids, dst_ids has 1"),
        (_ids(0).to(torch.float32), _ids(1), "src_ids must be a 1-D int32 or int64 tensor"),
        (_ids(0, 1).view(1, 2), _ids(1, 2), "src_ids must be a 1-D int32 or int64 tensor"),
        (_ids(0), torch.zeros(1, dtype=torch.int64, device="meta"), "dst_ids must be on the CPU"),
    ],
)
def test_bad_ids_are_rejected_before_anything_is_copied(src_ids, dst_ids, message):
    src = PagedBuffer.page_first(torch.full((4, 32), 7, dtype=torch.uint8))
    _, dst = _buffers()
    with pytest.raises(ValueError, match=message):
        copy_pages(src, src_ids, dst, dst_ids)
    assert not dst.segments[0].any()


def test_ids_that_are_not_tensors_are_rejected():
    src, dst = _buffers()
    with pytest.raises(TypeError, match=r"src_ids must be a torch\.Tensor, got list"):
        copy_pages(src, [0], dst, _ids(1))


def test_different_segment_sizes_are_rejected():
    src = PagedBuffer.layer_first([torch.zeros(4, 16, dtype=torch.uint8)] * 2)
    _, dst = _buffers()
    with pytest.raises(ValueError, match="segment sizes differ"):
        copy_pages(src, _ids(0), dst, _ids(1))


# -- PagedBuffer ---------------------------------------------------------------------------


def test_rows_describe_each_segment():
    pool = torch.zeros(6, 64, dtype=torch.uint8)
    buf = PagedBuffer.page_first(pool).resegment([16, 48])
    base = pool.data_ptr()
    assert buf.rows.tolist() == [[base, 64, 16], [base + 16, 64, 48]]
    assert buf.pinned is False


def test_resegment_needs_the_same_page_size():
    buf = PagedBuffer.page_first(torch.zeros(2, 64, dtype=torch.uint8))
    with pytest.raises(ValueError, match="segments of 48 bytes in all do not fit pages of 64"):
        buf.resegment([16, 32])


def test_layer_first_needs_equal_page_counts():
    with pytest.raises(ValueError, match="segment 1 has 3 pages, segment 0 has 4"):
        PagedBuffer.layer_first([torch.zeros(4, 16), torch.zeros(3, 16)])


def _kv_layers(layers: int, blocks: int, seed: int) -> list[torch.Tensor]:
    """vLLM FlashAttention-style caches: one (2, blocks, block_size, heads, dim) bf16 tensor per
    layer, each its own allocation."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, blocks, 4, 2, 8, generator=g).to(torch.bfloat16) for _ in range(layers)]


def _kv_page(layers: list[torch.Tensor], block: int, kv_dim: int = 0) -> torch.Tensor:
    """Block `block`'s page: per layer its K bytes, then its V bytes."""
    parts = [t.select(kv_dim, kv)[block] for t in layers for kv in (0, 1)]
    return torch.cat([p.contiguous().reshape(-1).view(torch.uint8) for p in parts])


@pytest.mark.parametrize("kv_dim", [0, 1])
def test_vllm_kv_caches_round_trip_through_a_page_first_pool(kv_dim):
    layers = _kv_layers(3, 10, seed=30)
    if kv_dim == 1:  # (blocks, 2, ...): K and V of a block side by side
        layers = [t.transpose(0, 1).contiguous() for t in layers]
    engine = PagedBuffer.from_kv_tensors(layers, kv_dim=kv_dim)
    assert engine.seg_bytes == (128,) * 6 and engine.num_pages == 10
    assert [len(b.segments) for b in engine.by_layer(3)] == [2, 2, 2]
    host_pool = _random_bytes(16, engine.page_bytes, seed=31)
    host = PagedBuffer.page_first(host_pool).resegment(engine.seg_bytes)
    src_ids, dst_ids = _pairs(6, 10, 16, seed=32)

    copy_pages(engine, src_ids, host, dst_ids)
    for s, d in zip(src_ids.tolist(), dst_ids.tolist(), strict=True):
        assert torch.equal(host_pool[d], _kv_page(layers, s, kv_dim))

    fresh = [torch.zeros_like(t) for t in layers]
    copy_pages(host, dst_ids, PagedBuffer.from_kv_tensors(fresh, kv_dim=kv_dim), src_ids)
    for s in src_ids.tolist():
        assert torch.equal(_kv_page(fresh, s, kv_dim), _kv_page(layers, s, kv_dim))


def test_vllm_kv_caches_in_another_stride_order_copy_their_bytes_as_they_lie():
    """vLLM's HND order: memory (2, blocks, heads, block_size, dim) seen as (2, blocks,
    block_size, heads, dim). A block's K is still one dense run; the page holds it as it lies."""
    g = torch.Generator().manual_seed(33)
    memory = [torch.randn(2, 6, 2, 4, 8, generator=g).to(torch.bfloat16) for _ in range(2)]
    views = [m.permute(0, 1, 3, 2, 4) for m in memory]
    engine = PagedBuffer.from_kv_tensors(views)
    host_pool = torch.zeros(6, engine.page_bytes, dtype=torch.uint8)
    host = PagedBuffer.page_first(host_pool).resegment(engine.seg_bytes)
    ids = torch.arange(6)
    copy_pages(engine, ids, host, ids)
    assert torch.equal(host_pool[4], _kv_page(memory, 4))


def test_vllm_kv_caches_that_do_not_fit_are_rejected():
    layers = _kv_layers(2, 5, seed=34)
    with pytest.raises(ValueError, match=r"layer 0: expected K and V at dim 1 \(size 2\)"):
        PagedBuffer.from_kv_tensors(layers, kv_dim=1)
    with pytest.raises(ValueError, match="kv_dim must be 0 or 1"):
        PagedBuffer.from_kv_tensors(layers, kv_dim=2)
    with pytest.raises(ValueError, match="layer 1, K: a block is not one dense run of memory"):
        PagedBuffer.from_kv_tensors([layers[0], layers[1][:, :, :, :1]])  # one head of two
    with pytest.raises(ValueError, match="segment 2 has 4 pages, segment 0 has 5"):
        PagedBuffer.from_kv_tensors([layers[0], layers[1][:, :4]])


# -- path choice (pure function of the layout) -----------------------------------------------


@pytest.mark.parametrize(
    ("seg_bytes", "path"),
    [
        ((16 * 1024,), "kernel"),
        ((48 * 1024,), "kernel"),
        ((64 * 1024,), "copy_engine"),
        ((4 * 1024 * 1024,), "copy_engine"),
        ((64 * 1024,) * 32, "copy_engine"),
        ((32 * 1024,) * 64, "kernel"),  # rows decide, not pages
        ((256 * 1024, 16 * 1024), "kernel"),  # the smallest row decides
    ],
)
def test_auto_takes_the_copy_engines_for_rows_of_64_kib_and_more(seg_bytes, path):
    pool = torch.zeros(2, sum(seg_bytes), dtype=torch.uint8)
    buf = PagedBuffer.page_first(pool).resegment(seg_bytes)
    assert choose_path(buf, buf) == path


# -- building the extension ------------------------------------------------------------------


def test_missing_nvcc_is_named():
    message = toolchain_problem(None)
    assert message is not None and "nvcc" in message and "CUDA_HOME" in message


def test_missing_cxx_compiler_is_named(tmp_path):
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.parent.mkdir()
    nvcc.write_text("#!/bin/sh\n")
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IXUSR)
    assert toolchain_problem(str(tmp_path), cxx="no-such-compiler-hicache") == (
        "building the hicache page-copy kernel needs a C++ compiler: "
        "'no-such-compiler-hicache' is not on PATH"
    )
    assert toolchain_problem(str(tmp_path), cxx=os.path.realpath("/bin/sh")) is None


@pytest.mark.parametrize(
    ("ids", "slots", "want"),
    [
        ([4, 5, 6, 7], [9, 8, 7, 6], [6, 7, 8, 9]),  # ids go up, slots came down: reversed
        ([4, 5, 6, 7], [2, 9, 0, 5], [0, 2, 5, 9]),  # ids go up, slots in no order: sorted
        ([7, 6, 5, 1], [1, 2, 3, 4], [4, 3, 2, 1]),  # ids go down: slots go down
        ([7, 6, 5, 1], [3, 1, 4, 2], [4, 3, 2, 1]),
        ([4, 5, 6, 7], [1, 2, 3, 4], [1, 2, 3, 4]),  # in order already
        ([4, 6, 5, 7], [9, 8, 7, 6], [9, 8, 7, 6]),  # ids run neither way: left as they are
        ([3], [8], [8]),
    ],
)
def test_fresh_slots_run_the_way_the_block_ids_run(ids, slots, want):
    import numpy as np

    from hicache.core import native

    if native.library() is None:
        pytest.skip("no C compiler: slots are left as they come")
    assert native.align_slots(np.array(ids, dtype=np.int32), slots).tolist() == want


def test_a_route_checks_its_buffers_once_and_copies_exact_bytes():
    import numpy as np

    from hicache.kernels import route

    src = PagedBuffer.page_first(_random_bytes(12, 4 * 48, seed=11)).resegment((48, 96, 48))
    layers = [_random_bytes(9, n, seed=12 + n) for n in (48, 96, 48)]
    dst = PagedBuffer.layer_first(layers)
    before = [t.clone() for t in layers]
    r = route(src, dst)
    r.copy(np.array([7, 0, 11], dtype=np.int32), np.array([2, 8, 5], dtype=np.int32), 0)
    for seg, (s_seg, old) in enumerate(zip(src.segments, before, strict=True)):
        want = old.clone()
        want[[2, 8, 5]] = s_seg[[7, 0, 11]]
        assert torch.equal(layers[seg], want)
    with pytest.raises(ValueError, match="segment sizes differ"):
        route(src, PagedBuffer.page_first(_random_bytes(4, 192, seed=1)))
