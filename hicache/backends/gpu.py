"""The GPU tier (L1): the engine's own KV pool, addressed by the engine's block ids.

hicache does not index this tier: the engine's prefix cache (if it has one) knows what its pool
holds and tells `match` through `computed_tokens`. hicache only copies pages into and out of the
blocks the engine names.
"""

from __future__ import annotations

from array import array

import numpy as np
import torch

from hicache.backends.base import PoolTier
from hicache.config import Layout
from hicache.core import native
from hicache.kernels import PagedBuffer


class GpuTier(PoolTier):
    """The engine's pool, page-first (one tensor) or segmented (one tensor per layer)."""

    type = "gpu"
    shared = False
    persistent = False

    def __init__(self, pages: PagedBuffer, layout: Layout) -> None:
        if layout.segments and pages.seg_bytes != layout.segments:
            raise ValueError(
                f"the pool's segments {_short(pages.seg_bytes)} disagree with the layout's "
                f"segments {_short(layout.segments)}"
            )
        if pages.page_bytes != layout.page_size:
            raise ValueError(
                f"the pool's pages are {pages.page_bytes} bytes but the layout says "
                f"page_bytes={layout.page_size}"
            )
        self._pages = pages
        self._limit = pages.num_pages

    @property
    def pages(self) -> PagedBuffer:
        return self._pages

    @property
    def device(self) -> torch.device:
        return self._pages.device

    def block_ids(self, block_ids: object, needed: int, what: str) -> np.ndarray:
        """The first `needed` of `block_ids` as an int32 array; ValueError naming any problem."""
        limit = self._limit
        if type(block_ids) is list or type(block_ids) is tuple:  # what engines pass: no numpy
            if len(block_ids) < needed:
                raise ValueError(f"{what} needs {needed} block ids, got {len(block_ids)}")
            try:  # a C loop over the ints: ~1 µs for 64, a tenth of np.asarray's cost
                ints = array("i", block_ids[:needed])
            except (TypeError, OverflowError) as err:
                raise ValueError(f"{what}: block ids must be int32 integers ({err})") from None
            bad = native.bad_id(ints, limit)  # checked in place, in C
            if bad >= 0:
                raise ValueError(
                    f"{what}: block id {ints[bad]} is outside the engine's pool of {limit} blocks"
                )
            return np.frombuffer(ints, dtype=np.int32)
        ids = self._ids_array(block_ids, needed, what)
        converted = native.ids_int32(ids, limit)  # compiled: numpy would release the GIL
        if converted is not None:
            out, bad = converted
            if bad >= 0:
                raise ValueError(
                    f"{what}: block id {int(ids[bad])} is outside the engine's pool of "
                    f"{limit} blocks"
                )
            return out
        outside = np.flatnonzero((ids < 0) | (ids >= limit))
        if outside.size:
            raise ValueError(
                f"{what}: block id {int(ids[outside[0]])} is outside the engine's pool of "
                f"{limit} blocks"
            )
        return ids.astype(np.int32)

    @staticmethod
    def _ids_array(block_ids: object, needed: int, what: str) -> np.ndarray:
        """The first `needed` of block ids given as an array or a CPU tensor."""
        if isinstance(block_ids, torch.Tensor):
            if block_ids.device.type != "cpu":
                raise ValueError(f"{what}: block_ids must be on the CPU, got {block_ids.device}")
            block_ids = block_ids.numpy()
        ids = np.asarray(block_ids)
        if ids.ndim != 1:
            raise ValueError(f"{what}: block_ids must be 1-D, got shape {ids.shape}")
        if ids.shape[0] < needed:
            raise ValueError(f"{what} needs {needed} block ids, got {ids.shape[0]}")
        if needed and ids.dtype.kind not in "iu":
            raise ValueError(f"{what}: block ids must be integers, got dtype {ids.dtype}")
        return ids[:needed]


def _short(sizes: tuple[int, ...]) -> str:
    return f"({len(sizes)} segments: {list(sizes[:3])}{'...' if len(sizes) > 3 else ''})"
