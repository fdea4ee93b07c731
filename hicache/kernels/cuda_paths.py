"""What every CUDA copy path shares: the paths and their knobs, how ``"auto"`` chooses one, the
checks of the two buffers, and the segment tables (made once per pair of buffers)."""

from __future__ import annotations

import weakref

import torch

from hicache.kernels.buffer import PagedBuffer

__all__ = [
    "COPY_ENGINE_MIN_ROW_BYTES",
    "COPY_ENGINE_ROWS_PER_CALL",
    "KERNEL_CHUNK_BYTES",
    "KERNEL_MAX_BLOCKS",
    "PATHS",
    "STAGED_BLOCKS",
    "STAGING_BYTES",
    "check_device",
    "choose_path",
    "make_table",
    "segment_table",
    "staging_host",
]

PATHS = ("auto", "kernel", "copy_engine", "staged")
"""The values of a copy's `path` argument."""

#: Blocks of the kernel's grid (16 warps each): 4 already reach the kernel's best rate over
#: PCIe, 8 keep it with a margin; the rest of the SMs stay free.
KERNEL_MAX_BLOCKS = 8
#: Bytes of one work item of the kernel (one warp copies one chunk of one row at a time).
KERNEL_CHUNK_BYTES = 16 * 1024
#: "auto" takes the copy engines when every row (one segment of one page) has at least this
#: many bytes, the kernel otherwise. Measured on an H200: docs/decisions/page-copy-paths.md.
COPY_ENGINE_MIN_ROW_BYTES = 64 * 1024
#: Rows per cudaMemcpyBatchAsync call: the engines start while later rows are being enqueued.
COPY_ENGINE_ROWS_PER_CALL = 2048
#: The staged path's two GPU staging buffers hold at most this many bytes of pages together.
STAGING_BYTES = 32 << 20
#: Blocks of the kernel that moves rows between the staging buffer and the GPU pool (GPU memory
#: on both sides: a short burst at HBM speed, so that it adds little to the PCIe time).
STAGED_BLOCKS = 32


def check_device(src: PagedBuffer, dst: PagedBuffer) -> torch.device:
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
    """The path that ``"auto"`` takes.

    - ``"copy_engine"`` when every row (one segment of one page) has at least
      `COPY_ENGINE_MIN_ROW_BYTES`: from there the copy engines reach the PCIe limit and leave
      the SMs to the model.
    - ``"staged"`` when rows are smaller but whole pages are not, and the host side holds each
      page contiguously (a page-first host pool): the copy engines move whole pages between the
      host and a GPU staging buffer, and the kernel moves the rows on the GPU. Below 64 KiB the
      driver's cost per row (about a microsecond of host time) bounds the copy engines, and the
      kernel alone stops at 94-95 % of the link.
    - ``"kernel"`` otherwise (small pages, GPU to GPU, layer-first on both sides).
    """
    if min(src.seg_bytes) >= COPY_ENGINE_MIN_ROW_BYTES:
        return "copy_engine"
    if staging_host(src, dst) is not None and src.page_bytes >= COPY_ENGINE_MIN_ROW_BYTES:
        return "staged"
    return "kernel"


def staging_host(src: PagedBuffer, dst: PagedBuffer) -> PagedBuffer | None:
    """The host side's whole pages, when exactly one side is host memory and holds them."""
    cpu = [b for b in (src, dst) if b.device.type == "cpu"]
    return cpu[0].whole_pages if len(cpu) == 1 else None


_TABLES: weakref.WeakKeyDictionary[PagedBuffer, dict] = weakref.WeakKeyDictionary()


def segment_table(
    src: PagedBuffer, dst: PagedBuffer, chunk_bytes: int, device: torch.device | None = None
) -> tuple[torch.Tensor, int]:
    """The table of struct Segment rows (int64 ``[S, 6]``; in host memory, or a copy on
    `device`) and the number of chunks per page, made once per pair of buffers and chunk size
    (a copy between the same pools reuses them)."""
    per_src = _TABLES.setdefault(src, {})
    key = (id(dst), chunk_bytes)
    cached = per_src.get(key)
    if cached is None or cached[0]() is not dst:
        for stale in [k for k, (ref, *_) in per_src.items() if ref() is None]:
            del per_src[stale]
        table, chunks = make_table(src, dst, chunk_bytes)
        cached = per_src[key] = (weakref.ref(dst), table, chunks, {})
    _, table, chunks, copies = cached
    if device is None:
        return table, chunks
    if device not in copies:
        copies[device] = table.to(device)
    return copies[device], chunks


def make_table(src: PagedBuffer, dst: PagedBuffer, chunk_bytes: int) -> tuple[torch.Tensor, int]:
    """A new table of struct Segment rows from `src` to `dst` (int64 ``[S, 6]``, host memory:
    source address and stride, destination address and stride, row bytes, first chunk) and the
    chunks per page. `segment_table` keeps them; the staged path makes its own."""
    s, d = src.rows, dst.rows
    chunks = (s[:, 2] + chunk_bytes - 1) // chunk_bytes
    first = torch.cumsum(chunks, 0) - chunks
    table = torch.stack((s[:, 0], s[:, 1], d[:, 0], d[:, 1], s[:, 2], first), dim=1)
    return table.contiguous(), int(chunks.sum())
