"""The CPU twin of the page-copy kernel: the same contract, one memcpy a row.

The rows are copied by a compiled helper (hicache/core/native/copyrows.c) where a C compiler is
present, else by numpy fancy indexing (a gather and a scatter, about three times slower). Not
torch index ops: torch's would wake its intra-op thread pool on every call, which costs more
than the copy for the small batches an engine step moves.
"""

from __future__ import annotations

import numpy as np
import torch

from hicache.core import native
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


class CpuRoute:
    """Copies between two fixed CPU buffers: `copy` is one call into the compiled helper (or the
    numpy fallback), with no checks left to make but the caller's (see
    `hicache.kernels.Route`)."""

    def __init__(self, src: PagedBuffer, dst: PagedBuffer) -> None:
        self.src, self.dst = src, dst
        self._lib = native.library()
        self._rows = (src.rows.data_ptr(), dst.rows.data_ptr(), src.rows.shape[0])

    def copy(self, src_ids: np.ndarray, dst_ids: np.ndarray, stream: int = 0) -> None:
        n = src_ids.shape[0]
        if n == 0:
            return
        if self._lib is None:
            copy_pages_cpu(self.src, torch.from_numpy(src_ids), self.dst, torch.from_numpy(dst_ids))
            return
        src_rows, dst_rows, segments = self._rows
        self._lib.hicache_copy_pages_cpu(
            src_rows, dst_rows, segments, native.address(src_ids), native.address(dst_ids), n
        )
