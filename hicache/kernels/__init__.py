"""Page copies between pools: the CUDA kernel and its CPU twin behind one function.

`copy_pages(src, src_ids, dst, dst_ids, stream)` copies page ``src_ids[k]`` of `src` to page
``dst_ids[k]`` of `dst`. Where both buffers are on the CPU it runs the CPU twin, synchronously.
"""

from __future__ import annotations

import torch

from hicache.kernels.buffer import PagedBuffer
from hicache.kernels.cpu import copy_pages_cpu

__all__ = ["PagedBuffer", "copy_pages"]


def copy_pages(
    src: PagedBuffer,
    src_ids: torch.Tensor,
    dst: PagedBuffer,
    dst_ids: torch.Tensor,
    stream: torch.cuda.Stream | None = None,
) -> None:
    """Copy page ``src_ids[k]`` of `src` into page ``dst_ids[k]`` of `dst`, for every k.

    Contract: `src_ids` and `dst_ids` are 1-D integer tensors of equal length on the CPU; every
    id is in range; both buffers have the same segment sizes (re-segment a page-first buffer with
    `PagedBuffer.resegment`). Raises ValueError naming the problem otherwise, before anything is
    copied.
    """
    _check(src, src_ids, dst, dst_ids)
    if src.device.type == "cpu" and dst.device.type == "cpu":
        copy_pages_cpu(src, src_ids, dst, dst_ids)
        return
    raise NotImplementedError("CUDA page copies come with the kernel module")


def _check(src: PagedBuffer, src_ids: torch.Tensor, dst: PagedBuffer, dst_ids: torch.Tensor) -> None:
    if src.seg_bytes != dst.seg_bytes:
        raise ValueError(
            f"segment sizes differ: source {src.seg_bytes[:4]}... ({len(src.seg_bytes)} segments), "
            f"destination {dst.seg_bytes[:4]}... ({len(dst.seg_bytes)} segments)"
        )
    for name, ids, buf in (("src_ids", src_ids, src), ("dst_ids", dst_ids, dst)):
        if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be a 1-D int32 or int64 tensor")
        if ids.device.type != "cpu":
            raise ValueError(f"{name} must be on the CPU, got {ids.device}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= buf.num_pages):
            raise ValueError(f"{name} holds an id outside [0, {buf.num_pages})")
    if src_ids.numel() != dst_ids.numel():
        raise ValueError(f"src_ids has {src_ids.numel()} ids, dst_ids has {dst_ids.numel()}")
