"""The CUDA page copy: building the extension at first use, packing arguments, choosing the path.

Two paths move the rows (one segment of one page) of a page list between a CUDA buffer and a
pinned host buffer, or between two CUDA buffers of one device, enqueued on the caller's stream:

- ``"copy_engine"``: ``cudaMemcpyBatchAsync`` over all rows, in calls of at most
  `COPY_ENGINE_ROWS_PER_CALL` rows. The copy engines move the bytes; no SM is taken from the
  model's kernels. The ids are read on the host during the call, so nothing is staged; the
  driver costs about a microsecond of host time per row. On the legacy default stream (which
  the batch API refuses) the rows go through a side stream, forked and joined with events.
- ``"kernel"``: the kernel in ``page_copy.cu`` on a grid of at most `KERNEL_MAX_BLOCKS` blocks.
  The segment table and the ids are staged to the device through a pinned buffer, with a
  non-blocking copy on the same stream (torch's pinned allocator keeps the host block until
  that copy has run; the device block belongs to the stream).

`choose_path` says which one ``"auto"`` takes, and why; the README has the measurements.
Nothing here synchronizes the device.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
from pathlib import Path

import torch

from hicache.kernels.buffer import PagedBuffer

__all__ = ["choose_path", "copy_pages_cuda", "load_extension", "toolchain_problem"]

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("page_copy.cu")
_EXTENSION = "hicache_page_copy"
_PATHS = ("auto", "kernel", "copy_engine")

#: Blocks of the kernel's grid (16 warps each): 4 already reach the kernel's best rate over
#: PCIe, 8 keep it with a margin; the rest of the SMs stay free.
KERNEL_MAX_BLOCKS = 8
#: Bytes of one work item of the kernel (one warp copies one chunk of one row at a time).
KERNEL_CHUNK_BYTES = 16 * 1024
#: "auto" takes the copy engines when every row (one segment of one page) has at least this
#: many bytes, the kernel otherwise. Measured on an H200, see the README.
COPY_ENGINE_MIN_ROW_BYTES = 64 * 1024
#: Rows per cudaMemcpyBatchAsync call: the engines start while later rows are being enqueued.
COPY_ENGINE_ROWS_PER_CALL = 2048


def toolchain_problem(cuda_home: str | None, cxx: str | None = None) -> str | None:
    """What keeps the extension from being built, as a message, or None when nothing does."""
    nvcc = os.path.join(cuda_home, "bin", "nvcc") if cuda_home else None
    if nvcc is None or not os.access(nvcc, os.X_OK):
        return (
            "building the hicache page-copy kernel needs CUDA's compiler nvcc, and none was found "
            f"(CUDA_HOME={cuda_home!r}); install the CUDA toolkit that torch was built with "
            f"(CUDA {torch.version.cuda}) and set CUDA_HOME, or put nvcc on PATH"
        )
    cxx = cxx or os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"building the hicache page-copy kernel needs a C++ compiler: {cxx!r} is not on PATH"
    return None


def _cache_dir() -> Path:
    root = os.environ.get("HICACHE_KERNEL_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "hicache", "kernels"
    )
    tag = re.sub(r"[^A-Za-z0-9.]+", "_", f"torch{torch.__version__}-cuda{torch.version.cuda}")
    return Path(root) / tag


@functools.cache
def load_extension():
    """Build (first use only; cached on disk by source hash) and import the CUDA extension.

    Raises RuntimeError naming the missing tool when nvcc, a C++ compiler or ninja is missing.
    The build directory is ``$HICACHE_KERNEL_CACHE`` or ``~/.cache/hicache/kernels``; the target
    architecture is torch's (``TORCH_CUDA_ARCH_LIST`` or the visible GPUs).
    """
    from torch.utils import cpp_extension

    problem = toolchain_problem(cpp_extension.CUDA_HOME)
    if problem is None and not cpp_extension.is_ninja_available():
        problem = "building the hicache page-copy kernel needs ninja (pip install ninja)"
    if problem is not None:
        raise RuntimeError(problem)
    build_dir = _cache_dir()
    build_dir.mkdir(parents=True, exist_ok=True)
    log.info("loading the hicache page-copy kernel (built in %s at first use)", build_dir)
    return cpp_extension.load(
        name=_EXTENSION,
        sources=[str(_SOURCE)],
        build_directory=str(build_dir),
        extra_cuda_cflags=["-O3", "-std=c++17"],
        verbose=os.environ.get("HICACHE_KERNEL_VERBOSE") == "1",
    )


def _device(src: PagedBuffer, dst: PagedBuffer) -> torch.device:
    """The CUDA device of the copy; raises ValueError for host memory that is not pinned."""
    for name, buf in (("src", src), ("dst", dst)):
        if buf.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{name} is on {buf.device}; pages move between CPU and CUDA only")
        if buf.device.type == "cpu" and not buf.pinned:
            raise ValueError(
                f"{name} is host memory that is not pinned: a copy to or from a CUDA buffer needs "
                "page-locked memory (torch.empty(..., pin_memory=True) or tensor.pin_memory())"
            )
    devices = [b.device for b in (src, dst) if b.device.type == "cuda"]
    if len(devices) == 2 and devices[0] != devices[1]:
        raise ValueError(f"src is on {devices[0]} and dst on {devices[1]}: one device only")
    return devices[0]


def choose_path(src: PagedBuffer, dst: PagedBuffer) -> str:
    """The path that ``"auto"`` takes: ``"copy_engine"`` when every row (one segment of one
    page) has at least `COPY_ENGINE_MIN_ROW_BYTES`, ``"kernel"`` otherwise.

    From 64 KiB rows on, the copy engines reach the PCIe limit and leave the SMs to the model;
    below, the driver's cost per row (about a microsecond of host time) bounds them, while the
    kernel keeps 94-95 % of the link whatever the row size.
    """
    if min(src.seg_bytes) >= COPY_ENGINE_MIN_ROW_BYTES:
        return "copy_engine"
    return "kernel"


def _segment_table(
    src: PagedBuffer, dst: PagedBuffer, chunk_bytes: int
) -> tuple[torch.Tensor, int]:
    """The table of struct Segment rows (int64 ``[S, 6]``) and the number of chunks per page."""
    s, d = src.rows, dst.rows
    chunks = (s[:, 2] + chunk_bytes - 1) // chunk_bytes
    first = torch.cumsum(chunks, 0) - chunks
    table = torch.stack((s[:, 0], s[:, 1], d[:, 0], d[:, 1], s[:, 2], first), dim=1)
    return table.contiguous(), int(chunks.sum())


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
) -> str:
    """Enqueue the copy on `stream` (default: the current stream of the CUDA device); returns the
    path taken. Arguments were checked by `hicache.kernels.copy_pages`, except what only matters
    here (pinned host memory, one device, the stream's device), checked now. The keyword
    arguments after `path` are tuning knobs for the benchmark.
    """
    if path not in _PATHS:
        raise ValueError(f"path must be one of {_PATHS}, got {path!r}")
    device = _device(src, dst)
    if stream is None:
        stream = torch.cuda.current_stream(device)
    elif stream.device != device:
        raise ValueError(f"the stream is on {stream.device}, the CUDA buffer on {device}")
    if max(src.num_pages, dst.num_pages) > 2**31 - 1:
        raise ValueError("a CUDA page copy addresses at most 2**31 - 1 pages per buffer (int32)")
    if path == "auto":
        path = choose_path(src, dst)
    n = int(src_ids.numel())
    if n == 0:
        return path
    ext = load_extension()
    src32 = src_ids.to(torch.int32).contiguous()
    dst32 = dst_ids.to(torch.int32).contiguous()
    table, chunks_per_page = _segment_table(src, dst, chunk_bytes)
    if path == "copy_engine":
        ext.copy_batch(
            table.data_ptr(),
            table.shape[0],
            src32.data_ptr(),
            dst32.data_ptr(),
            n,
            rows_per_call,
            stream.cuda_stream,
            device.index,
        )
        return path
    # Stage [table | src ids | dst ids] in one pinned buffer, then one non-blocking copy on the
    # stream. The host block is not reused before that copy ran (torch's pinned allocator records
    # an event on it); the device block belongs to `stream`, so its reuse is ordered after us.
    words = table.numel() * 2
    staged = torch.empty(words + 2 * n, dtype=torch.int32, pin_memory=True)
    staged[:words].view(torch.int64).copy_(table.view(-1))
    staged[words : words + n].copy_(src32)
    staged[words + n :].copy_(dst32)
    with torch.cuda.stream(stream):
        on_device = staged.to(device, non_blocking=True)
    base = on_device.data_ptr()
    ext.launch_kernel(
        base,
        table.shape[0],
        base + 4 * words,
        n,
        chunks_per_page,
        chunk_bytes,
        max_blocks,
        stream.cuda_stream,
        device.index,
    )
    return path


def copy_pages_loop(
    src: PagedBuffer,
    src_ids: torch.Tensor,
    dst: PagedBuffer,
    dst_ids: torch.Tensor,
    stream: torch.cuda.Stream,
) -> None:
    """One ``cudaMemcpyAsync`` per row: the baseline that the benchmark compares with."""
    device = _device(src, dst)
    src32 = src_ids.to(torch.int32).contiguous()
    dst32 = dst_ids.to(torch.int32).contiguous()
    table, _ = _segment_table(src, dst, KERNEL_CHUNK_BYTES)
    load_extension().copy_loop(
        table.data_ptr(),
        table.shape[0],
        src32.data_ptr(),
        dst32.data_ptr(),
        src32.numel(),
        stream.cuda_stream,
        device.index,
    )
