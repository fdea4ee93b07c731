"""`CudaRoute`: the copies between two fixed buffers, one of them on a CUDA device, checked once
(the cache's path: `hicache.kernels.route`)."""

from __future__ import annotations

import numpy as np
import torch

from hicache.core import native
from hicache.kernels.buffer import PagedBuffer
from hicache.kernels.cuda_build import extension
from hicache.kernels.cuda_paths import (
    COPY_ENGINE_ROWS_PER_CALL,
    KERNEL_CHUNK_BYTES,
    KERNEL_MAX_BLOCKS,
    PATHS,
    STAGING_BYTES,
    check_device,
    choose_path,
    segment_table,
)
from hicache.kernels.cuda_staging import Staging

__all__ = ["CudaRoute"]


class CudaRoute:
    """Copies between two fixed buffers (one of them on a CUDA device), checked once.

    `copy_pages` checks its buffers, picks a path and converts its ids at every call: tens of
    microseconds of the engine thread that a cache, which copies between the same two pools all
    the time, pays once here. What every copy needs (the path, the segment table on the host
    or the device, the staged path's buffers) is made at construction. `copy` takes int32 numpy
    ids and a raw stream handle, and on every path is one call into the extension, which reads
    the ids during the call and keeps the GIL.
    """

    def __init__(self, src: PagedBuffer, dst: PagedBuffer, path: str = "auto") -> None:
        """`path`: "auto" (`choose_path`) or one path forced (tests and benchmarks)."""
        if path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, got {path!r}")
        self.device = check_device(src, dst)
        if max(src.num_pages, dst.num_pages) > 2**31 - 1:
            raise ValueError("a CUDA page copy addresses at most 2**31 - 1 pages per buffer")
        self.src, self.dst = src, dst
        self._ext = extension()
        if self._ext is None:
            self.path = "torch"
        else:
            self.path = choose_path(src, dst) if path == "auto" else path
        if self._ext is None:
            return
        on = self.device if self.path == "kernel" else None
        self._table, self._chunks = segment_table(src, dst, KERNEL_CHUNK_BYTES, on)
        self._table_ptr = self._table.data_ptr()
        self._segments = self._table.shape[0]
        self._index = self.device.index if self.device.index is not None else 0
        self._staging = (
            Staging.of(src, dst, STAGING_BYTES, COPY_ENGINE_ROWS_PER_CALL)
            if self.path == "staged"
            else None
        )

    def copy(self, src_ids: np.ndarray, dst_ids: np.ndarray, stream: int) -> None:
        """Enqueue the copy of page ``src_ids[k]`` to ``dst_ids[k]`` on the stream with handle
        `stream`. The caller guarantees C-contiguous int32 ids of equal length, in range, with no
        destination twice (as `copy_pages` with ``ids_in_range=True``)."""
        n = src_ids.shape[0]
        if n == 0:
            return
        if self._ext is None:
            self._copy_with_torch(src_ids, dst_ids, stream)
        elif self._staging is not None:
            self._staging.copy(src_ids, dst_ids, stream)
        elif self.path == "copy_engine":
            self._ext.copy_batch(
                self._table_ptr,
                self._segments,
                native.address(src_ids),
                native.address(dst_ids),
                n,
                COPY_ENGINE_ROWS_PER_CALL,
                stream,
                self._index,
            )
        else:
            self._ext.launch_kernel(
                self._table_ptr,
                self._segments,
                native.address(src_ids),
                native.address(dst_ids),
                n,
                self._chunks,
                KERNEL_CHUNK_BYTES,
                KERNEL_MAX_BLOCKS,
                stream,
                self._index,
            )

    def _copy_with_torch(self, src_ids: np.ndarray, dst_ids: np.ndarray, stream: int) -> None:
        """The path without the extension: per segment, a gather on the source's device, a
        move to the destination's and a scatter there, on the stream. A copy to the host waits
        for the stream (the rows must have arrived before the call returns)."""
        index = self.device.index if self.device.index is not None else 0
        with torch.cuda.stream(torch.cuda.ExternalStream(stream, device=index)):
            for s_seg, d_seg in zip(self.src.segments, self.dst.segments, strict=True):
                src_at = torch.from_numpy(src_ids).to(s_seg.device, torch.int64)
                dst_at = torch.from_numpy(dst_ids).to(d_seg.device, torch.int64)
                rows = s_seg.index_select(0, src_at).to(d_seg.device)
                d_seg.index_copy_(0, dst_at, rows)
