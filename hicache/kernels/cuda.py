"""The CUDA page copy: building the extension at first use, packing arguments, choosing the path.

Three paths move the rows (one segment of one page) of a page list between a CUDA buffer and a
pinned host buffer, or between two CUDA buffers of one device, enqueued on the caller's stream:

- ``"copy_engine"``: ``cudaMemcpyBatchAsync`` over all rows, in calls of at most
  `COPY_ENGINE_ROWS_PER_CALL` rows. The copy engines move the bytes; no SM is taken from the
  model's kernels. The driver costs about a microsecond of host time per row. On the legacy
  default stream (which the batch API refuses) the rows go through a side stream, forked and
  joined with events.
- ``"kernel"``: the kernel in ``page_copy.cu`` on a grid of at most `KERNEL_MAX_BLOCKS` blocks.
  The segment table is copied to the device once per pair of pools; the ids travel in the
  kernel's parameters (480 pages per launch for a few pages, 4,064 for many with CUDA 12.1+).
- ``"staged"``: whole pages between the host and two GPU staging buffers on the copy engines,
  rows between those and the GPU pool with the kernel on a side stream, the two taking turns
  (`Staging`; each has its own side stream, so that a load and a store run at once). For small
  rows of a page-first host pool: the link's rate without the copy engines' cost per row.

On every path the ids are read on the host during the call, and the call is one call into the
extension that keeps the GIL (once a pair of pools has its tables, and on the staged path its
staging buffers): an engine-thread copy cannot be cut into by a hicache worker thread.
`choose_path` says which one ``"auto"`` takes, and why; the measurements are in
docs/decisions/page-copy-paths.md. Nothing here synchronizes the device.

Where the extension cannot be built or loaded (no nvcc, no ninja, no C++ compiler, or
``HICACHE_NO_NATIVE=1``), `extension()` logs one warning and the cache takes the ``"torch"``
path: torch's index ops on the same stream and torch's events. It gives the same bytes, slower;
its device-to-host copies wait for the stream, and its calls release the GIL.

This module is the public face: `copy_pages_cuda` (checked at every call) and the baseline
`copy_pages_loop` are here, and it re-exports what its parts define: `cuda_paths` (the paths,
their knobs, the checks and segment tables), `cuda_build` (the extension), `cuda_staging`
(`Staging`), `cuda_route` (`CudaRoute`, checked once: the cache's path) and `cuda_events`
(`CudaEvent`, `TorchEvent`, stream handles).
"""

from __future__ import annotations

import torch

from hicache.kernels.buffer import PagedBuffer
from hicache.kernels.cuda_build import extension, load_extension, toolchain_problem
from hicache.kernels.cuda_events import (
    CudaEvent,
    TorchEvent,
    current_stream_handle,
    event_class,
)
from hicache.kernels.cuda_paths import (
    COPY_ENGINE_MIN_ROW_BYTES,
    COPY_ENGINE_ROWS_PER_CALL,
    KERNEL_CHUNK_BYTES,
    KERNEL_MAX_BLOCKS,
    PATHS,
    STAGED_BLOCKS,
    STAGING_BYTES,
    check_device,
    choose_path,
    segment_table,
    staging_host,
)
from hicache.kernels.cuda_route import CudaRoute
from hicache.kernels.cuda_staging import Staging

__all__ = [
    "COPY_ENGINE_MIN_ROW_BYTES",
    "COPY_ENGINE_ROWS_PER_CALL",
    "KERNEL_CHUNK_BYTES",
    "KERNEL_MAX_BLOCKS",
    "STAGED_BLOCKS",
    "STAGING_BYTES",
    "CudaEvent",
    "CudaRoute",
    "Staging",
    "TorchEvent",
    "choose_path",
    "copy_pages_cuda",
    "copy_pages_loop",
    "current_stream_handle",
    "event_class",
    "extension",
    "load_extension",
    "toolchain_problem",
]


def copy_pages_cuda(
    src: PagedBuffer,
    src_ids: torch.Tensor,
    dst: PagedBuffer,
    dst_ids: torch.Tensor,
    stream: torch.cuda.Stream | None = None,
    *,
    path: str = "auto",
    max_blocks: int = KERNEL_MAX_BLOCKS,
    chunk_bytes: int = KERNEL_CHUNK_BYTES,
    rows_per_call: int = COPY_ENGINE_ROWS_PER_CALL,
    staging_bytes: int = STAGING_BYTES,
) -> str:
    """Enqueue the copy on `stream` (default: the current stream of the CUDA device); returns the
    path taken. Arguments were checked by `hicache.kernels.copy_pages`, except what only
    matters here (pinned host memory, one device, the stream's device), checked now. The keyword
    arguments after `path` are tuning knobs for the benchmark.
    """
    path, device, stream = _checked(src, dst, stream, path)
    if src_ids.numel() == 0:
        return path
    ext = load_extension()
    src32 = src_ids.to(torch.int32).contiguous()
    dst32 = dst_ids.to(torch.int32).contiguous()
    if path == "staged":
        staging = Staging.of(src, dst, staging_bytes, rows_per_call)
        staging.copy(src32.numpy(), dst32.numpy(), stream.cuda_stream)
        return path
    # the arguments of the calls into the extension (page_copy.cu), as addresses and counts
    src_at, dst_at, n = src32.data_ptr(), dst32.data_ptr(), src32.numel()
    handle, index = stream.cuda_stream, stream.device.index
    if path == "copy_engine":
        table, _ = segment_table(src, dst, KERNEL_CHUNK_BYTES)
        table_at, segments = table.data_ptr(), table.shape[0]
        ext.copy_batch(table_at, segments, src_at, dst_at, n, rows_per_call, handle, index)
    else:  # "kernel": the table on the device, where the kernel reads it
        table, chunks = segment_table(src, dst, chunk_bytes, device)
        table_at, segments = table.data_ptr(), table.shape[0]
        ext.launch_kernel(
            table_at, segments, src_at, dst_at, n, chunks, chunk_bytes, max_blocks, handle, index
        )
    return path


def _checked(
    src: PagedBuffer, dst: PagedBuffer, stream: torch.cuda.Stream | None, path: str
) -> tuple[str, torch.device, torch.cuda.Stream]:
    """`copy_pages_cuda`'s checks: the path ("auto" resolved), the device and the stream (the
    device's current one for None). Raises ValueError naming the problem."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    device = check_device(src, dst)
    if stream is None:
        stream = torch.cuda.current_stream(device)
    elif stream.device != device:
        raise ValueError(f"the stream is on {stream.device}, the CUDA buffer on {device}")
    if max(src.num_pages, dst.num_pages) > 2**31 - 1:
        raise ValueError("a CUDA page copy addresses at most 2**31 - 1 pages per buffer (int32)")
    if path == "auto":
        path = choose_path(src, dst)
    if path == "staged" and staging_host(src, dst) is None:
        raise ValueError("the staged path needs one side in host memory that holds whole pages")
    return path, device, stream


def copy_pages_loop(
    src: PagedBuffer,
    src_ids: torch.Tensor,
    dst: PagedBuffer,
    dst_ids: torch.Tensor,
    stream: torch.cuda.Stream,
) -> None:
    """One ``cudaMemcpyAsync`` per row: the baseline that the benchmark compares with."""
    device = check_device(src, dst)
    src32 = src_ids.to(torch.int32).contiguous()
    dst32 = dst_ids.to(torch.int32).contiguous()
    table, _ = segment_table(src, dst, KERNEL_CHUNK_BYTES)
    load_extension().copy_loop(
        table.data_ptr(),
        table.shape[0],
        src32.data_ptr(),
        dst32.data_ptr(),
        src32.numel(),
        stream.cuda_stream,
        device.index,
    )
