"""Host memory for the pools: pinned (page-locked) where CUDA is present, plain otherwise; in a
file that another process can map (`shared`) where the store's client runs in a process of its
own."""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SharedFile:
    """Where a tensor's bytes lie in a file that another process can map: `fd` (open in this
    process; pass it on with SCM_RIGHTS), `offset` into it and `nbytes` from there."""

    fd: int
    offset: int
    nbytes: int


_shared: dict[int, HostMemory] = {}  # live shared memories by start address
_shared_lock = threading.Lock()


class HostMemory:
    """One 1-D uint8 CPU tensor of `nbytes`, page-locked when `pin` is true.

    Pinning registers the tensor's own memory with CUDA (cudaHostRegister) instead of asking
    torch's pinned allocator, which rounds every block up to a power of two (a 48 GiB pool would
    take 64 GiB). Unpinned memory is zeroed, so that every page is mapped before any transfer
    uses it. With `shared` the bytes are an anonymous memory file (memfd) mapped shared, which
    `shared_file` finds for another process to map. `close` (or garbage collection of this
    object) drops the registration and the file's descriptor; the caller keeps this object
    alive as long as any view of `tensor` is in use.
    """

    def __init__(self, nbytes: int, pin: bool, shared: bool = False) -> None:
        self.nbytes = nbytes
        self.fd: int | None = None
        self._map: mmap.mmap | None = None
        if shared and nbytes:
            self.fd = os.memfd_create("hicache-host", os.MFD_CLOEXEC)
            os.ftruncate(self.fd, nbytes)
            self._map = mmap.mmap(self.fd, nbytes, mmap.MAP_SHARED | _POPULATE)
            self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        else:
            self.tensor = (torch.empty if pin else torch.zeros)(nbytes, dtype=torch.uint8)
        self.pinned = False
        if pin and nbytes:
            rc = int(torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), nbytes, 0))
            if rc != 0:
                raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with error {rc}")
            self.pinned = True
        if self.fd is not None:
            with _shared_lock:
                _shared[self.tensor.data_ptr()] = self

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False
        if self.fd is not None:
            with _shared_lock:
                _shared.pop(self.tensor.data_ptr(), None)
            os.close(self.fd)  # the mapping stays until the last view of the tensor is gone
            self.fd = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit CUDA may be gone already
            self.close()


_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # map every page now, not at its first transfer


def shared_file(tensor: torch.Tensor) -> SharedFile | None:
    """The shared file behind `tensor` (a view inside a live `HostMemory(shared=True)`), or
    None when its bytes are not all inside one."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    with _shared_lock:
        for base, memory in _shared.items():
            if base <= start and end <= base + memory.nbytes and memory.fd is not None:
                return SharedFile(memory.fd, start - base, end - start)
    return None
