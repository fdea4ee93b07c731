"""Host memory for the pools: pinned (page-locked) where CUDA is present, plain otherwise."""

from __future__ import annotations

import contextlib

import torch

_PAGE = 4096


class HostMemory:
    """One 1-D uint8 CPU tensor of `nbytes`, page-locked when `pin` is true.

    Pinning registers the tensor's own memory with CUDA (cudaHostRegister) instead of asking
    torch's pinned allocator, which rounds every block up to a power of two (a 48 GiB pool would
    take 64 GiB). Unpinned memory is zeroed, so that every page is mapped before any transfer
    uses it. `close` (or garbage collection of this object) drops the registration; the caller
    keeps this object alive as long as any view of `tensor` is in use.
    """

    def __init__(self, nbytes: int, pin: bool) -> None:
        self.nbytes = nbytes
        # page-aligned (torch's own blocks start 64 bytes into a page), so that the disk tier
        # can move slots with O_DIRECT
        raw = (torch.empty if pin else torch.zeros)(nbytes + _PAGE, dtype=torch.uint8)
        skip = -raw.data_ptr() % _PAGE
        self.tensor = raw[skip : skip + nbytes]
        self.pinned = False
        if pin and nbytes:
            rc = int(torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), nbytes, 0))
            if rc != 0:
                raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with error {rc}")
            self.pinned = True

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit CUDA may be gone already
            self.close()
