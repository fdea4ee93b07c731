"""The CPU twin of the page-copy kernel: the same contract, done with torch index ops."""

from __future__ import annotations

import torch

from hicache.kernels.buffer import PagedBuffer


def copy_pages_cpu(
    src: PagedBuffer, src_ids: torch.Tensor, dst: PagedBuffer, dst_ids: torch.Tensor
) -> None:
    """Copy page ``src_ids[k]`` of `src` to page ``dst_ids[k]`` of `dst` for every k, synchronously.

    The caller has validated the arguments (see `hicache.kernels.copy_pages`).
    """
    if src_ids.numel() == 0:
        return
    src_index = src_ids.to(torch.int64)
    dst_index = dst_ids.to(torch.int64)
    for s_seg, d_seg in zip(src.segments, dst.segments):
        d_seg.index_copy_(0, dst_index, s_seg.index_select(0, src_index))
