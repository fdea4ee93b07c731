"""The lossless codec of store tiers (``codec: lossless``): fewer bytes at rest, the same bytes
back.

KV in bf16/fp16 is far from random: the high byte of each value (sign and most of the
exponent) takes few values. `PLANES16` splits an object's 16-bit values into a plane of low
bytes, stored as they are, and a plane of high bytes, compressed with zstd (level 1); `ZSTD`
compresses the whole object with zstd (8-bit KV, and anything whose size is not a whole number
of 16-bit values). An encoded payload is::

    frame bytes u64 | low plane (PLANES16 only: raw / 2 bytes) | zstd frame | zeros

padded with zeros to a multiple of `ALIGN` bytes (so that the disk tier can move it with
O_DIRECT). An object that would not shrink by at least one `ALIGN` is stored raw (the object
header's `RAW` flag, `hicache.backends.envelope`); the header's checksum always covers the raw
bytes, so a decode that goes wrong fails the check as surely as a flipped byte does.

zstd comes from the ``zstandard`` package (the ``codec`` extra); `problem()` says why the codec
cannot be used here. Encoding and decoding run on the store workers (zstd and the byte planes
release the GIL); one `Codec` serves every thread.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import numpy as np

from hicache.core import native

NONE = 0
PLANES16 = 1
ZSTD = 2
NAMES = {NONE: "none", PLANES16: "planes16+zstd", ZSTD: "zstd"}
ALIGN = 4096
"""Encoded payloads are padded to a multiple of this many bytes."""
LEVEL = 1
"""zstd's level: the fastest of its levels that entropy-codes (what shrinks the high plane)."""
_PREFIX = 8
PLANNED_RATIO = 1.45
"""The ratio the planner assumes for codec: lossless (synthetic bf16 KV, bench/codec.py)."""
PLANNED_DECODE_GBPS = 0.45
"""The raw bytes per second the planner assumes a tier's codec threads decode: what 2 threads did
on the 2-core development machine (bench/results/codec_cpu.json); give your own (decode_gbps=).
"""


def problem() -> str | None:
    """Why `codec: lossless` cannot be used in this process (one line), or None."""
    try:
        import zstandard  # noqa: F401
    except ImportError:
        return (
            "needs the zstandard package: pip install zstandard (hicache is not on the "
            "package index: in its clone, pip install -e '.[codec]')"
        )
    return None


def for_dtype(kv_dtype: str) -> Codec:
    """The lossless codec for KV of `kv_dtype` (a torch dtype's name): byte planes for 16-bit
    values, plain zstd otherwise. ValueError (one line) where zstandard is missing."""
    reason = problem()
    if reason is not None:
        raise ValueError(f"codec: lossless {reason}")
    import torch

    dtype = getattr(torch, kv_dtype, None)
    width = dtype.itemsize if isinstance(dtype, torch.dtype) else 0
    return Codec(PLANES16 if width == 2 else ZSTD)


def view(ptr: int, nbytes: int) -> np.ndarray:
    """A uint8 array over `nbytes` of memory at `ptr` (the caller keeps it mapped)."""
    if not nbytes:
        return np.empty(0, dtype=np.uint8)
    return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_uint8)), (nbytes,))


class Codec:
    """Encodes with codec `ident` (`PLANES16` or `ZSTD`); decodes any of them. Thread-safe."""

    def __init__(self, ident: int) -> None:
        if ident not in (PLANES16, ZSTD):
            raise ValueError(f"unknown codec {ident}")
        self.ident = ident
        self._local = threading.local()

    def _zstd(self) -> Any:
        """This thread's (compressor, decompressor): zstandard's are not shared by threads."""
        pair = getattr(self._local, "zstd", None)
        if pair is None:
            import zstandard

            pair = self._local.zstd = (
                zstandard.ZstdCompressor(level=LEVEL),
                zstandard.ZstdDecompressor(),
            )
        return pair

    def kind(self, raw: int) -> int:
        """The codec an object of `raw` bytes is encoded with (what its header must name):
        byte planes need a whole number of 16-bit values, so an odd size takes plain zstd."""
        return ZSTD if self.ident == PLANES16 and raw % 2 else self.ident

    def scratch(self, nbytes: int, which: str = "gather") -> np.ndarray:
        """`nbytes` of this thread's scratch buffer `which` (grown as needed, never shared by
        threads). The codec uses "plane" itself; "gather" is its callers'."""
        buf = getattr(self._local, which, None)
        if buf is None or buf.size < nbytes:
            buf = np.empty(nbytes, dtype=np.uint8)
            setattr(self._local, which, buf)
        return buf[:nbytes]

    def encode(self, src: np.ndarray, out: np.ndarray) -> int | None:
        """Encode the raw bytes `src` into `out` (at least `src.size` bytes, not overlapping
        `src`) with codec `kind(src.size)`; the bytes written (a multiple of `ALIGN`), or None
        where that would not be less than `src.size` (the object is then stored raw)."""
        raw = src.size
        compress = self._zstd()[0].compress
        if self.kind(raw) == PLANES16:
            half = raw // 2
            hi = self.scratch(half, "plane")
            split(src, out[_PREFIX : _PREFIX + half], hi)
            frame = compress(hi)
            start = _PREFIX + half
        else:
            frame = compress(src)
            start = _PREFIX
        end = start + len(frame)
        stored = -(-end // ALIGN) * ALIGN
        if stored >= raw:
            return None
        out[:_PREFIX] = np.frombuffer(len(frame).to_bytes(_PREFIX, "little"), dtype=np.uint8)
        out[start:end] = np.frombuffer(frame, dtype=np.uint8)
        out[end:stored] = 0
        return stored

    def decode(self, ident: int, src: np.ndarray, dst: np.ndarray) -> bool:
        """Decode payload `src` of codec `ident` into `dst` (its raw size; `src` may lie in the
        same memory); False where it does not decode to exactly `dst.size` bytes."""
        raw = dst.size
        if src.size < _PREFIX or ident not in (PLANES16, ZSTD):
            return False
        frame_len = int.from_bytes(src[:_PREFIX].tobytes(), "little")
        half = raw // 2 if ident == PLANES16 else 0
        start = _PREFIX + half
        if (ident == PLANES16 and raw % 2) or start + frame_len > src.size:
            return False
        want = half if ident == PLANES16 else raw
        try:
            # a new buffer: `src` may lie in `dst`
            got = self._zstd()[1].decompress(src[start : start + frame_len], max_output_size=want)
        except Exception:  # zstandard.ZstdError: any damage is a failed decode
            return False
        if len(got) != want:
            return False
        data = np.frombuffer(got, dtype=np.uint8)
        if ident == ZSTD:
            dst[:] = data
        else:
            lo = self.scratch(half, "plane")
            lo[:] = src[_PREFIX:start]
            merge(lo, data, dst)
        return True


def split(src: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> None:
    """The low and high bytes of the 16-bit values in `src` into `lo` and `hi`."""
    lib = native.library(release_gil=True)
    if lib is None:
        pairs = src.reshape(-1, 2)
        lo[:] = pairs[:, 0]
        hi[:] = pairs[:, 1]
        return
    lib.hicache_planes_split(src.ctypes.data, lo.size, lo.ctypes.data, hi.ctypes.data)


def merge(lo: np.ndarray, hi: np.ndarray, dst: np.ndarray) -> None:
    """The inverse of `split`: 16-bit values from their low and high bytes into `dst`."""
    lib = native.library(release_gil=True)
    if lib is None:
        pairs = dst.reshape(-1, 2)
        pairs[:, 0] = lo
        pairs[:, 1] = hi
        return
    lib.hicache_planes_merge(lo.ctypes.data, hi.ctypes.data, lo.size, dst.ctypes.data)
