"""The CPU twin of the page-copy kernel: the same contract, one memcpy a row.

The rows are copied by a compiled helper (hicache/native/copyrows.c) where a C compiler is
present, else by numpy fancy indexing (a gather and a scatter, about three times slower). Not
torch index ops: torch's would wake its intra-op thread pool on every call, which costs more
than the copy for the small batches an engine step moves.
"""

from __future__ import annotations

import numpy as np
import torch

from hicache import native
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
    lib = native.library()
    if lib is None:
        for s_seg, d_seg in zip(src.segments, dst.segments, strict=True):
            d_seg.numpy()[dst_index] = s_seg.numpy()[src_index]
        return
    src_index = np.ascontiguousarray(src_index, dtype=np.int32)
    dst_index = np.ascontiguousarray(dst_index, dtype=np.int32)
    src_rows, dst_rows = src.rows, dst.rows  # cached per buffer
    lib.hicache_copy_pages_cpu(
        src_rows.data_ptr(),
        dst_rows.data_ptr(),
        src_rows.shape[0],
        src_index.ctypes.data,
        dst_index.ctypes.data,
        src_index.shape[0],
    )
