"""The CPU twin of the page-copy kernel: the same contract, done with numpy fancy indexing.

numpy rather than torch index ops: torch's would wake its intra-op thread pool on every call,
which costs more than the copy for the small batches an engine step moves.
"""

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
    src_index = src_ids.numpy()
    dst_index = dst_ids.numpy()
    for s_seg, d_seg in zip(src.segments, dst.segments, strict=True):
        d_seg.numpy()[dst_index] = s_seg.numpy()[src_index]
