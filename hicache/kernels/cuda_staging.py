"""The staged path's buffers and tables for one pair of pools (`Staging`): whole pages between
the host and two GPU staging buffers on the copy engines, rows between those and the GPU pool
with the kernel."""

from __future__ import annotations

import weakref

import numpy as np
import torch

from hicache.core import native
from hicache.kernels.buffer import PagedBuffer
from hicache.kernels.cuda_build import load_extension
from hicache.kernels.cuda_paths import (
    KERNEL_CHUNK_BYTES,
    STAGED_BLOCKS,
    make_table,
    staging_host,
)

__all__ = ["Staging"]

_STAGINGS: weakref.WeakKeyDictionary[PagedBuffer, dict] = weakref.WeakKeyDictionary()


class Staging:
    """The staged path between a page-first host pool and a GPU pool, one direction: two GPU
    staging buffers of whole pages (`staging_bytes` together), the four segment tables around
    them, and the extension's ``Stager``, which enqueues the copy engines' and the kernel's
    parts and orders them with events (see ``page_copy.cu``).

    Made once per pair of pools and knobs (`of`) and kept while the source pool lives: a copy
    allocates nothing. The buffers come from torch's caching allocator on the stream current at
    construction; drop the pools only once their copies have completed. One thread at a time.
    """

    def __init__(
        self, src: PagedBuffer, dst: PagedBuffer, staging_bytes: int, rows_per_call: int
    ) -> None:
        host = staging_host(src, dst)
        if host is None:
            raise ValueError("the staged path needs one side in host memory that holds whole pages")
        self.to_gpu = src.device.type == "cpu"
        gpu = dst if self.to_gpu else src
        self.per_part = max(1, staging_bytes // (2 * gpu.page_bytes))
        whole_tables, row_tables, self._keep = [], [], []
        for _ in range(2):  # per buffer: whole pages host <-> buffer, rows buffer <-> GPU pool
            shape = (self.per_part, gpu.page_bytes)
            flat = torch.empty(shape, dtype=torch.uint8, device=gpu.device)
            whole = PagedBuffer.page_first(flat)
            rows = whole.resegment(gpu.seg_bytes)
            whole_table, _ = (
                make_table(host, whole, KERNEL_CHUNK_BYTES)
                if self.to_gpu
                else make_table(whole, host, KERNEL_CHUNK_BYTES)
            )
            row_table, chunks = (
                make_table(rows, dst, KERNEL_CHUNK_BYTES)
                if self.to_gpu
                else make_table(src, rows, KERNEL_CHUNK_BYTES)
            )
            row_table = row_table.to(gpu.device)  # the kernel reads it; the copy engines' table
            self._keep += [flat, whole_table, row_table]  # is read on the host during a call
            whole_tables.append(whole_table.data_ptr())
            row_tables.append(row_table.data_ptr())
        index = gpu.device.index if gpu.device.index is not None else torch.cuda.current_device()
        self._stager = load_extension().Stager(
            self.to_gpu,
            self.per_part,
            whole_tables,
            whole_table.shape[0],
            row_tables,
            row_table.shape[0],
            chunks,
            KERNEL_CHUNK_BYTES,
            STAGED_BLOCKS,
            rows_per_call,
            index,
        )

    @classmethod
    def of(
        cls, src: PagedBuffer, dst: PagedBuffer, staging_bytes: int, rows_per_call: int
    ) -> Staging:
        """The `Staging` of this pair and knobs, made at first use."""
        per_src = _STAGINGS.setdefault(src, {})
        key = (id(dst), staging_bytes, rows_per_call)
        cached = per_src.get(key)
        if cached is None or cached[0]() is not dst:
            for stale in [k for k, (ref, _) in per_src.items() if ref() is None]:
                del per_src[stale]
            cached = per_src[key] = (weakref.ref(dst), cls(src, dst, staging_bytes, rows_per_call))
        return cached[1]

    def copy(self, src_ids: np.ndarray, dst_ids: np.ndarray, stream: int) -> None:
        """Enqueue page ``src_ids[k]`` -> ``dst_ids[k]`` on the stream with handle `stream`
        (C-contiguous int32 ids, in range, read before the call returns)."""
        host_ids, pool_ids = (src_ids, dst_ids) if self.to_gpu else (dst_ids, src_ids)
        self._stager.copy(
            native.address(host_ids), native.address(pool_ids), src_ids.shape[0], stream
        )
