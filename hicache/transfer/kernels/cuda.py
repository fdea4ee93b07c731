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
"""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import weakref
from pathlib import Path

import numpy as np
import torch

from hicache.core import native
from hicache.transfer.kernels.buffer import PagedBuffer

__all__ = [
    "CudaEvent",
    "CudaRoute",
    "Staging",
    "choose_path",
    "copy_pages_cuda",
    "current_stream_handle",
    "load_extension",
    "toolchain_problem",
]

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("page_copy.cu")
_EXTENSION = "hicache_page_copy"
_PATHS = ("auto", "kernel", "copy_engine", "staged")

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


@functools.cache
def extension():
    """The loaded extension, or None (one warning logged) where it cannot be had: the cache
    then copies with torch (`CudaRoute`'s ``"torch"`` path, `TorchEvent`)."""
    if not native.enabled():
        return None
    try:
        return load_extension()
    except Exception as err:  # a missing tool, a failed build or load: all end the same
        log.warning(
            "hicache: the CUDA page-copy extension is unavailable (%s); copying with torch "
            "(slower)",
            " ".join(str(err).split())[:300],
        )
        return None


class TorchEvent:
    """`CudaEvent`'s interface over ``torch.cuda.Event``, for when the extension is missing
    (its `record` releases the GIL)."""

    __slots__ = ("event",)

    def __init__(self, device: int, timing: bool = False) -> None:
        self.event = torch.cuda.Event(enable_timing=timing, blocking=True)

    def record(self, stream: int, device: int) -> None:
        self.event.record(torch.cuda.ExternalStream(stream, device=device))

    def block(self, stream: int, device: int) -> None:
        torch.cuda.ExternalStream(stream, device=device).wait_event(self.event)

    def query(self) -> bool:
        return self.event.query()

    def synchronize(self) -> None:
        self.event.synchronize()

    def elapsed_s(self, end: TorchEvent) -> float:
        return self.event.elapsed_time(end.event) / 1e3


def event_class() -> type[CudaEvent] | type[TorchEvent]:
    """The events the cache records: the extension's, or torch's without it."""
    return CudaEvent if extension() is not None else TorchEvent


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
    if _staging_host(src, dst) is not None and src.page_bytes >= COPY_ENGINE_MIN_ROW_BYTES:
        return "staged"
    return "kernel"


def _staging_host(src: PagedBuffer, dst: PagedBuffer) -> PagedBuffer | None:
    """The host side's whole pages, when exactly one side is host memory and holds them."""
    cpu = [b for b in (src, dst) if b.device.type == "cpu"]
    return cpu[0].whole_pages if len(cpu) == 1 else None


_TABLES: weakref.WeakKeyDictionary[PagedBuffer, dict] = weakref.WeakKeyDictionary()


def _segment_table(
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
        table, chunks = _make_table(src, dst, chunk_bytes)
        cached = per_src[key] = (weakref.ref(dst), table, chunks, {})
    _, table, chunks, copies = cached
    if device is None:
        return table, chunks
    if device not in copies:
        copies[device] = table.to(device)
    return copies[device], chunks


def _make_table(src: PagedBuffer, dst: PagedBuffer, chunk_bytes: int) -> tuple[torch.Tensor, int]:
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
    staging_bytes: int = STAGING_BYTES,
) -> str:
    """Enqueue the copy on `stream` (default: the current stream of the CUDA device); returns the
    path taken. Arguments were checked by `hicache.transfer.kernels.copy_pages`, except what only
    matters here (pinned host memory, one device, the stream's device), checked now. The keyword
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
    if path == "staged" and _staging_host(src, dst) is None:
        raise ValueError("the staged path needs one side in host memory that holds whole pages")
    if src_ids.numel() == 0:
        return path
    ext = load_extension()
    src32 = src_ids.to(torch.int32).contiguous()
    dst32 = dst_ids.to(torch.int32).contiguous()
    if path == "copy_engine":
        table, _ = _segment_table(src, dst, KERNEL_CHUNK_BYTES)
        ext.copy_batch(
            table.data_ptr(),
            table.shape[0],
            src32.data_ptr(),
            dst32.data_ptr(),
            src32.numel(),
            rows_per_call,
            stream.cuda_stream,
            stream.device.index,
        )
    elif path == "kernel":
        table, chunks = _segment_table(src, dst, chunk_bytes, device)
        ext.launch_kernel(
            table.data_ptr(),
            table.shape[0],
            src32.data_ptr(),
            dst32.data_ptr(),
            src32.numel(),
            chunks,
            chunk_bytes,
            max_blocks,
            stream.cuda_stream,
            stream.device.index,
        )
    else:
        staging = Staging.of(src, dst, staging_bytes, rows_per_call)
        staging.copy(src32.numpy(), dst32.numpy(), stream.cuda_stream)
    return path


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
        host = _staging_host(src, dst)
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
                _make_table(host, whole, KERNEL_CHUNK_BYTES)
                if self.to_gpu
                else _make_table(whole, host, KERNEL_CHUNK_BYTES)
            )
            row_table, chunks = (
                _make_table(rows, dst, KERNEL_CHUNK_BYTES)
                if self.to_gpu
                else _make_table(src, rows, KERNEL_CHUNK_BYTES)
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
        if path not in _PATHS:
            raise ValueError(f"path must be one of {_PATHS}, got {path!r}")
        self.device = _device(src, dst)
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
        self._table, self._chunks = _segment_table(src, dst, KERNEL_CHUNK_BYTES, on)
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


class CudaEvent:
    """A blocking-sync CUDA event made, recorded and queried by the copy extension.

    Unlike ``torch.cuda.Event.record``, `record` keeps the GIL: an engine-thread call that
    records one cannot be cut into by a hicache worker waiting for the GIL. `synchronize`
    releases it while it sleeps (worker threads only). `timing` events can be measured with
    `elapsed_s`. The event is destroyed with the object (CUDA releases it once it completes).
    """

    __slots__ = ("_ext", "handle")

    def __init__(self, device: int, timing: bool = False) -> None:
        self._ext = load_extension()
        self.handle = self._ext.event_create(timing, device)

    def record(self, stream: int, device: int) -> None:
        self._ext.event_record(self.handle, stream, device)

    def block(self, stream: int, device: int) -> None:
        """Make the stream with handle `stream` wait, on the device, for the work before the
        last `record`. The host thread does not wait."""
        self._ext.event_wait(self.handle, stream, device)

    def query(self) -> bool:
        """True once the work enqueued before the last `record` has completed. Never waits."""
        return self._ext.event_query(self.handle)

    def synchronize(self) -> None:
        self._ext.event_synchronize(self.handle)

    def elapsed_s(self, end: CudaEvent) -> float:
        """Device seconds from this event to `end`, both recorded, completed and timing."""
        return self._ext.event_elapsed_ms(self.handle, end.handle) / 1e3

    def __del__(self) -> None:
        handle = getattr(self, "handle", None)
        if handle is not None:
            self._ext.event_destroy(handle)


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream_handle(device: torch.device) -> int:
    """The handle of `device`'s current stream. torch's private getter costs ~0.3 µs where
    ``torch.cuda.current_stream(device).cuda_stream`` costs ~5 µs; the public one is the
    fallback for a torch that lacks it."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if _RAW_STREAM is not None:
        return _RAW_STREAM(index)
    return torch.cuda.current_stream(index).cuda_stream


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
