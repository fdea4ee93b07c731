"""The memory a store tier has registered, and the checks of a call's keys and pieces against it.

Store clients (`MooncakeStore`, and any other that registers host memory)
keep their registered tensors here and check every get and put with `Regions.locate`: one
vectorized pass over the pieces, or one comparison where the caller gives the span of them all.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Generic, TypeVar

import numpy as np
import torch

from hicache.backends.base import Buffers

T = TypeVar("T")


@dataclass(frozen=True)
class Region(Generic[T]):
    """A registered tensor: `nbytes` at `start`, what the store keeps of it (`info`), and the
    tensor itself, referenced so that its memory stays mapped while the store may use it."""

    start: int
    nbytes: int
    index: int
    """Registration order: 0 for the first region, and so on."""
    info: T
    owner: torch.Tensor


@dataclass(frozen=True)
class Located:
    """Where a call's pieces lie: `region[j]` is the index of the region of piece ``j``,
    `offset[j]` its offset in it, `size[j]` its bytes; `counts[i]` the pieces of object ``i``.
    `span`: (region index, low offset, high offset) when the caller's span covers them all."""

    counts: list[int]
    region: np.ndarray
    offset: np.ndarray
    size: np.ndarray
    span: tuple[int, int, int] | None


Arrays = tuple[np.ndarray, np.ndarray, np.ndarray]
"""Starts, ends and registration indexes of the regions, sorted by start."""


class Regions(Generic[T]):
    """Registered memory: contiguous CPU tensors that do not overlap. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sorted: list[Region[T]] = []  # by start
        self._arrays = _arrays([])  # (starts, ends, indexes) of _sorted, replaced whole

    def add(self, memory: object, info: T) -> Region[T] | None:
        """Register `memory`; the new region, or None if exactly this memory is registered
        already. TypeError/ValueError naming the problem for anything but a contiguous,
        non-empty CPU tensor, or one that overlaps a registered region."""
        start, nbytes = checked_tensor(memory)
        with self._lock:
            i = bisect.bisect_right(self._sorted, start, key=lambda r: r.start)
            before = self._sorted[i - 1] if i else None
            after = self._sorted[i] if i < len(self._sorted) else None
            if before is not None and before.start == start and before.nbytes == nbytes:
                return None
            prev_end = before.start + before.nbytes if before is not None else 0
            if prev_end > start or (after is not None and start + nbytes > after.start):
                raise ValueError("register: the tensor overlaps memory registered already")
            region = Region(start, nbytes, len(self._sorted), info, memory)  # type: ignore[arg-type]
            self._sorted.insert(i, region)
            self._arrays = _arrays(self._sorted)
            return region

    def all(self) -> list[Region[T]]:
        """Every region, in registration order."""
        with self._lock:
            return sorted(self._sorted, key=lambda r: r.index)

    def clear(self) -> list[Region[T]]:
        """Forget every region; returns them (in registration order)."""
        with self._lock:
            regions = sorted(self._sorted, key=lambda r: r.index)
            self._sorted, self._arrays = [], _arrays([])
            return regions

    def check(self, keys: Sequence[str], buffers: Buffers) -> None:
        """Check a call's `buffers` against its `keys` and the registered memory. Raises
        TypeError/ValueError naming the first key at fault: a count that disagrees, an object
        without pieces, a piece that is empty or outside registered memory. Where the buffers
        carry a span inside one region, that one comparison stands for every piece."""
        counts, arrays = _counts(keys, buffers), self._arrays
        if buffers.span is None or _span(arrays, *buffers.span) is None:
            _pieces(arrays, keys, buffers, counts)

    def locate(self, keys: Sequence[str], buffers: Buffers) -> Located:
        """`check`, and where each piece lies."""
        counts, arrays = _counts(keys, buffers), self._arrays  # one snapshot for the whole call
        span = None if buffers.span is None else _span(arrays, *buffers.span)
        if span is None:
            ptr, size, at = _pieces(arrays, keys, buffers, counts)
        else:
            ptr, size = _flat(buffers, counts)
            at = np.full(len(ptr), span[0], dtype=np.int64)
        starts, _, indexes = arrays
        where = None if span is None else (int(indexes[span[0]]), span[1], span[2])
        return Located(counts, indexes[at], ptr - starts[at], size, where)


def _span(arrays: Arrays, low: int, high: int) -> tuple[int, int, int] | None:
    """(position in the sorted regions, low and high offsets) where [low, high) lies inside one
    region, else None."""
    starts, ends, _ = arrays
    k = int(np.searchsorted(starts, low, side="right")) - 1
    if k < 0 or not low < high <= ends[k]:
        return None
    return k, low - int(starts[k]), high - int(starts[k])


def _flat(buffers: Buffers, counts: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Every piece's address and size, as int64 arrays."""
    total = sum(counts)
    ptr = np.fromiter(chain.from_iterable(buffers.ptrs), dtype=np.int64, count=total)
    size = np.fromiter(chain.from_iterable(buffers.sizes), dtype=np.int64, count=total)
    return ptr, size


def _pieces(
    arrays: Arrays, keys: Sequence[str], buffers: Buffers, counts: list[int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every piece's address, size and position in the sorted regions, checked."""
    ptr, size = _flat(buffers, counts)
    starts, ends, _ = arrays
    at = np.searchsorted(starts, ptr, side="right") - 1
    outside = (at < 0) | (ptr + size > ends[np.maximum(at, 0)])
    bad = np.flatnonzero(outside | (size <= 0))
    if bad.size:
        j = int(bad[0])
        key = keys[int(np.searchsorted(np.cumsum(counts), j, side="right"))]
        if size[j] <= 0:
            raise ValueError(f"key {key!r}: piece size must be > 0, got {size[j]}")
        raise ValueError(
            f"key {key!r}: piece ({int(ptr[j]):#x}, {size[j]}) is outside registered memory"
        )
    return ptr, size, at


def _counts(keys: Sequence[str], buffers: Buffers) -> list[int]:
    """Pieces per object, once the lists agree with the keys and each other."""
    if not isinstance(buffers, Buffers):
        raise TypeError(f"buffers must be Buffers, got {type(buffers).__name__}")
    if len(keys) != len(buffers.ptrs) or len(keys) != len(buffers.sizes):
        raise ValueError(
            f"{len(keys)} keys but {len(buffers.ptrs)} pointer lists and "
            f"{len(buffers.sizes)} size lists"
        )
    counts = list(map(len, buffers.ptrs))
    if counts != list(map(len, buffers.sizes)):
        raise ValueError("every object needs as many sizes as pointers")
    if 0 in counts:
        raise ValueError(f"key {keys[counts.index(0)]!r} has no pieces")
    return counts


def checked_tensor(memory: object) -> tuple[int, int]:
    """(address, bytes) of a contiguous, non-empty CPU tensor; TypeError/ValueError otherwise."""
    if not isinstance(memory, torch.Tensor):
        raise TypeError(f"register needs a torch.Tensor, got {type(memory).__name__}")
    if memory.device.type != "cpu" or not memory.is_contiguous():
        raise ValueError("register needs a contiguous CPU tensor")
    nbytes = memory.numel() * memory.element_size()
    if nbytes == 0:
        raise ValueError("register needs a non-empty tensor")
    return memory.data_ptr(), nbytes


def check_keys(keys: Sequence[str]) -> list[str]:
    """`keys` as a list; TypeError for one str, ValueError naming an empty or non-str key."""
    if isinstance(keys, str):
        raise TypeError("keys must be a sequence of str, not one str")
    out = list(keys)
    for k in out:
        if not isinstance(k, str) or not k:
            raise ValueError(f"every key must be a non-empty str, got {k!r}")
    return out


def _arrays(regions: list[Region]) -> Arrays:
    return (
        np.array([r.start for r in regions], dtype=np.int64),
        np.array([r.start + r.nbytes for r in regions], dtype=np.int64),
        np.array([r.index for r in regions], dtype=np.int32),
    )
