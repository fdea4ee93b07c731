"""Host memory for the pools: pinned (page-locked) where CUDA is present, plain otherwise."""

from __future__ import annotations

import contextlib
import threading

import torch

_PAGE = 4096
ZERO_CHUNK = 256 << 20
"""Bytes zeroed per step, between which an allocation can be cancelled."""


class Cancelled(Exception):
    """The allocation was cancelled (the tier closed, or the interpreter exits)."""


def available_bytes() -> int | None:
    """The memory this machine can still give without swapping (MemAvailable), or None where
    it cannot be read (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class HostMemory:
    """One 1-D uint8 CPU tensor of `nbytes`, page-locked when `pin` is true.

    Pinning registers the tensor's own memory with CUDA (cudaHostRegister) instead of asking
    torch's pinned allocator, which rounds every block up to a power of two (a 48 GiB pool would
    take 64 GiB). Unpinned memory is zeroed, so that every page is mapped before any transfer
    uses it; it is zeroed in steps of `ZERO_CHUNK` bytes, and when `stop` is set between two of
    them the constructor raises `Cancelled`. `close` (or garbage collection of this object)
    drops the registration; the caller keeps this object alive as long as any view of `tensor`
    is in use.
    """

    def __init__(self, nbytes: int, pin: bool, stop: threading.Event | None = None) -> None:
        self.nbytes = nbytes
        # page-aligned (torch's own blocks start 64 bytes into a page), so that the disk tier
        # can move slots with O_DIRECT
        raw = torch.empty(nbytes + _PAGE, dtype=torch.uint8)
        skip = -raw.data_ptr() % _PAGE
        self.tensor = raw[skip : skip + nbytes]
        self.pinned = False
        if pin and nbytes:
            # the whole allocation: torch asks whether a view is pinned at its storage's start
            rc = int(torch.cuda.cudart().cudaHostRegister(raw.data_ptr(), raw.numel(), 0))
            if rc != 0:
                raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with error {rc}")
            self.pinned = True
            return
        flat = self.tensor.numpy()  # numpy's fill runs on this thread alone (no thread pool)
        for start in range(0, nbytes, ZERO_CHUNK):
            if stop is not None and stop.is_set():
                raise Cancelled
            flat[start : start + ZERO_CHUNK].fill(0)

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.untyped_storage().data_ptr())
            self.pinned = False

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit CUDA may be gone already
            self.close()


def describe(nbytes: int) -> str:
    """`nbytes` in GiB or MiB, for messages: '64 GiB', '512 MiB'."""
    if nbytes >= 1 << 30:
        return f"{nbytes / (1 << 30):.3g} GiB"
    return f"{nbytes / (1 << 20):.3g} MiB"
