"""Page copies between pools: the CUDA paths and their CPU twin behind one function.

`copy_pages(src, src_ids, dst, dst_ids, stream)` copies page ``src_ids[k]`` of `src` to page
``dst_ids[k]`` of `dst`. Where both buffers are on the CPU it runs the CPU twin, synchronously;
where either is on a CUDA device it enqueues the copy on `stream` and returns without waiting
(`hicache.kernels.cuda` says which CUDA path runs when). `route(src, dst)` checks two
buffers once for a caller that copies between them again and again: its `copy` takes int32 numpy
ids and a raw stream handle and does nothing but the copy.

The package: the paged buffer (`buffer`: `PagedBuffer`), the CPU path (`cpu`), the CUDA paths
(`cuda`, with the extension's build `cuda_build` of ``page_copy.cu``, the path choice and
segment tables `cuda_paths`, the staging buffers `cuda_staging`, the route checked once
`cuda_route` and the events `cuda_events`), and the copies on the engine's stream with their
completions (`completions`: `Transfers`, fences). Imports only `hicache.core`,
`hicache.observability` and the base below it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from hicache.kernels.buffer import ALIGNMENT, PagedBuffer
from hicache.kernels.cpu import CpuRoute, copy_pages_cpu

__all__ = [
    "ALIGNMENT",
    "CpuRoute",
    "PagedBuffer",
    "PoolRoutes",
    "Route",
    "copy_pages",
    "prepare",
    "route",
]


def prepare(device: torch.device) -> None:
    """Make the copies to and from `device` ready: on CUDA, build (the first time on a machine,
    about 20 s, then cached on disk) and load the extension, or settle on torch's copies where
    it cannot be built (one warning). Call it at start-up, so that no copy on the engine thread
    pays for it; on the CPU it does nothing."""
    if device.type == "cuda":
        from hicache.kernels.cuda import extension

        extension()


def copy_pages(
    src: PagedBuffer,
    src_ids: torch.Tensor,
    dst: PagedBuffer,
    dst_ids: torch.Tensor,
    stream: torch.cuda.Stream | None = None,
    *,
    ids_in_range: bool = False,
) -> None:
    """Copy page ``src_ids[k]`` of `src` into page ``dst_ids[k]`` of `dst`, for every k.

    Contract: `src_ids` and `dst_ids` are 1-D int32/int64 tensors of equal length on the CPU;
    every id is in range; both buffers have the same segment sizes (re-segment a page-first
    buffer with `PagedBuffer.resegment`); every segment's address, row stride and row size are
    multiples of `ALIGNMENT` bytes (on every device, so that what runs on the CPU runs on a GPU);
    `dst_ids` holds no id twice (not checked: that would cost more than the rest of the call).
    With a CUDA buffer, the other one is on the same device or in pinned host memory, and the
    copy is enqueued on `stream` (default: the device's current stream) without synchronizing;
    the caller keeps both buffers alive and unchanged until the stream has passed the copy.
    Raises ValueError (TypeError for ids that are no tensor) naming the problem, before anything
    is copied. `ids_in_range=True` skips the scan of the ids for their range (a few µs a call):
    for callers whose ids are already checked or allocated by themselves, as hicache's cache.
    """
    _check(src, src_ids, dst, dst_ids, ids_in_range)
    if src.device.type == "cpu" and dst.device.type == "cpu":
        copy_pages_cpu(src, src_ids, dst, dst_ids)
        return
    from hicache.kernels.cuda import copy_pages_cuda

    copy_pages_cuda(src, src_ids, dst, dst_ids, stream)


def _check_buffers(src: PagedBuffer, dst: PagedBuffer) -> None:
    if src.seg_bytes != dst.seg_bytes:
        raise ValueError(
            f"segment sizes differ: source {src.seg_bytes[:4]}... ({len(src.seg_bytes)} segments), "
            f"destination {dst.seg_bytes[:4]}... ({len(dst.seg_bytes)} segments)"
        )
    for name, buf in (("src", src), ("dst", dst)):
        problem = buf.misalignment
        if problem is not None:
            raise ValueError(f"{name} {problem}")


def _check(
    src: PagedBuffer,
    src_ids: torch.Tensor,
    dst: PagedBuffer,
    dst_ids: torch.Tensor,
    ids_in_range: bool = False,
) -> None:
    _check_buffers(src, dst)
    for name, ids, buf in (("src_ids", src_ids, src), ("dst_ids", dst_ids, dst)):
        if not isinstance(ids, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(ids).__name__}")
        if ids.device.type != "cpu":
            raise ValueError(f"{name} must be on the CPU, got {ids.device}")
        if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"{name} must be a 1-D int32 or int64 tensor, got {ids.dtype} of shape "
                f"{tuple(ids.shape)}"
            )
        if ids.numel() and not ids_in_range:
            values = ids.numpy()  # numpy: a tenth of torch's cost for the few ids of one call
            low, high = int(values.min()), int(values.max())
            if low < 0 or high >= buf.num_pages:
                raise ValueError(
                    f"{name} holds an id outside [0, {buf.num_pages}): min {low}, max {high}"
                )
    if src_ids.numel() != dst_ids.numel():
        raise ValueError(f"src_ids has {src_ids.numel()} ids, dst_ids has {dst_ids.numel()}")


class Route(Protocol):
    """Copies between two fixed buffers, checked once by `route` (see `CudaRoute`)."""

    def copy(self, src_ids: np.ndarray, dst_ids: np.ndarray, stream: int) -> None:
        """Copy page ``src_ids[k]`` to ``dst_ids[k]``: C-contiguous int32 ids of equal length,
        in range, no destination twice. On CUDA enqueued on the stream with handle `stream`; on
        the CPU done before it returns (`stream` is ignored)."""


def route(src: PagedBuffer, dst: PagedBuffer) -> Route:
    """A `Route` from `src` to `dst`, after the checks `copy_pages` makes of its buffers (the
    ids are the caller's to get right). For callers that copy between the same two pools many
    times, as the cache does."""
    _check_buffers(src, dst)
    if src.device.type == "cpu" and dst.device.type == "cpu":
        return CpuRoute(src, dst)
    from hicache.kernels.cuda import CudaRoute

    return CudaRoute(src, dst)


@dataclass
class PoolRoutes:
    """The routes between the engine's GPU pool and the host tier's slots, both ways and layer
    by layer: made empty, filled once by `build` (on the host tier's allocating thread, before
    the tier is ready, so that the engine thread never builds them), read by every copy."""

    to_host: Route | None = None
    to_gpu: Route | None = None
    layers: list[Route] = field(default_factory=list)
    """Host -> GPU, one route per layer (`HiCache`'s `layers`); empty: no loads by layer."""

    def build(self, gpu: PagedBuffer, host: PagedBuffer, layers: int) -> None:
        """Check the buffers and make the routes: `host` is cut into `gpu`'s segments first."""
        slots = host.resegment(gpu.seg_bytes)
        self.to_host, self.to_gpu = route(gpu, slots), route(slots, gpu)
        if layers:
            pairs = zip(slots.by_layer(layers), gpu.by_layer(layers), strict=True)
            self.layers = [route(src, dst) for src, dst in pairs]
