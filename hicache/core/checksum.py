"""The checksum of a stored object's bytes: 64 bits, over pieces of memory, seeded.

The bytes of the pieces, in order, are one stream of little-endian 64-bit words ``w_i`` (the
last zero-padded); ``sum = SUM_i mix(w_i ^ (i * GOLDEN)) mod 2**64`` and the checksum is
``mix(sum + mix(nbytes ^ seed))``, where `mix` is a bijection of 64-bit words (two multiplies).
A change of any one word always changes it; any other change goes unnoticed with a chance of
about 2**-64. Every term is independent of the others, so the compiled loop (``checksum.c``,
released GIL) runs at memory speed without special instructions, and numpy computes the same
value where the C helpers are not built (``HICACHE_NO_NATIVE=1``), slower.
"""

from __future__ import annotations

import ctypes
from array import array
from collections.abc import Sequence

import numpy as np

from hicache.core import native

GOLDEN = 0x9E3779B97F4A7C15
MIXER = 0xD6E8FEB86659FD93
_MASK = (1 << 64) - 1
_CHUNK_WORDS = 1 << 17
"""Words the numpy path mixes at a time (1 MiB)."""


def checksum(ptrs: Sequence[int], sizes: Sequence[int], seed: int = 0) -> int:
    """The checksum of the bytes at `ptrs[k]` (`sizes[k]` bytes each), in order. The caller
    keeps that memory mapped and unchanged during the call."""
    lib = native.library(release_gil=True)
    if lib is None:
        return checksum_numpy(ptrs, sizes, seed)
    at = array("Q", ptrs)
    n = array("Q", sizes)
    return lib.hicache_checksum(at.buffer_info()[0], n.buffer_info()[0], len(at), seed & _MASK)


def checksum_bytes(data: bytes | bytearray | memoryview, seed: int = 0) -> int:
    """`checksum` of one buffer (tests, tools)."""
    view = np.frombuffer(data, dtype=np.uint8)
    if not view.size:
        return checksum([], [], seed)
    return checksum([view.ctypes.data], [view.size], seed)


def _mix(x: np.ndarray) -> np.ndarray:
    """`mix` of every element of a uint64 array, in place."""
    x ^= x >> np.uint64(32)
    x *= np.uint64(MIXER)
    x ^= x >> np.uint64(32)
    x *= np.uint64(MIXER)
    x ^= x >> np.uint64(32)
    return x


def _mix_int(x: int) -> int:
    return int(_mix(np.array([x & _MASK], dtype=np.uint64))[0])


def checksum_numpy(ptrs: Sequence[int], sizes: Sequence[int], seed: int = 0) -> int:
    """`checksum` computed with numpy (the path without the C helpers)."""
    data = b"".join(ctypes.string_at(int(p), int(s)) for p, s in zip(ptrs, sizes, strict=True))
    nbytes = len(data)
    data += bytes(-nbytes % 8)
    words = np.frombuffer(data, dtype="<u8")
    total = np.uint64(0)
    with np.errstate(over="ignore"):
        for start in range(0, words.size, _CHUNK_WORDS):
            chunk = words[start : start + _CHUNK_WORDS]
            keys = np.arange(start, start + chunk.size, dtype=np.uint64) * np.uint64(GOLDEN)
            total += _mix(chunk ^ keys).sum(dtype=np.uint64)
    return _mix_int(int(total) + _mix_int(nbytes ^ (seed & _MASK)))
