"""`GilWatch`: did a call let go of the GIL?

hicache's engine-thread calls keep the GIL from start to end: a call that releases it (a numpy
operation on a long array, torch's ``Event.record``, a blocking lock) lets any hicache worker that
is waiting for the GIL run first, and the engine waits for it. The watch arms a thread that wants
the GIL during the call, and only then: it runs (and counts) if and only if the call releases it.

Arming does not depend on timing: the watcher sleeps in a ``read`` of a pipe (through ctypes,
without the GIL), and the calling thread, keeping the GIL, writes the byte that wakes it and
waits until the byte has landed in the watcher's buffer and the watcher sleeps again, which it
can then only do queued for the GIL. A release can still be missed (once released, the
watcher must be scheduled before the call takes the GIL back, and a hicache worker may take it
first), never invented: the switch interval is raised to a minute while the watch is on, so
nothing but a release hands the GIL over (with the usual interval, or a second, a thread starved
on a busy machine would have the GIL taken from it in the middle of a call).
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

_WITH_GIL = ctypes.PyDLL(None)  # libc calls that keep the GIL (the arming thread's)
_WITHOUT_GIL = ctypes.CDLL(None, use_errno=True)  # libc calls that let go of it (the watcher's)
for _lib in (_WITH_GIL, _WITHOUT_GIL):
    _lib.read.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
    _lib.write.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
    _lib.read.restype = _lib.write.restype = ctypes.c_ssize_t
_WITH_GIL.open.argtypes = [ctypes.c_char_p, ctypes.c_int]

ARM_TIMEOUT_S = 60.0
"""How long `released` waits for the watcher to queue for the GIL before it gives up."""


class GilWatch:
    def __init__(self) -> None:
        self.runs = 0
        """How many times the watcher has had the GIL (once per watched call)."""
        self.ran = threading.Event()
        """Set by the watcher when it has had the GIL in the current watched call."""
        self._closed = False
        self._rfd, self._wfd = os.pipe()
        self._woken = ctypes.create_string_buffer(1)
        self._interval = sys.getswitchinterval()
        sys.setswitchinterval(60.0)  # no forced hand-over during a watched call
        self._thread = threading.Thread(target=self._watch, daemon=True, name="gil-watch")
        self._thread.start()
        self._stat = f"/proc/self/task/{self._thread.native_id}/stat".encode()

    def _watch(self) -> None:
        while True:
            # the kernel copies the byte into _woken before read returns; then this thread
            # queues for the GIL
            if _WITHOUT_GIL.read(self._rfd, self._woken, 1) != 1 or self._closed:
                return
            self.runs += 1
            self.ran.set()

    def released(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[bool, Any]:
        """Call `fn`; True if it let go of the GIL, with its result."""
        before = self.runs
        self.ran.clear()
        self._arm()
        try:
            result = fn(*args, **kwargs)
            released = self.runs != before
        finally:
            while self.runs == before:  # let it through before the next call
                time.sleep(0.0001)
        return released, result

    def _arm(self) -> None:
        """Wake the watcher and return once it waits for the GIL, keeping the GIL throughout."""
        self._woken.raw = b"\0"
        if _WITH_GIL.write(self._wfd, b"w", 1) != 1:
            raise OSError("gil watch: cannot write to its pipe")
        deadline = time.monotonic() + ARM_TIMEOUT_S
        while self._woken.raw != b"w" or not self._sleeping():
            if time.monotonic() > deadline:
                raise TimeoutError(f"gil watch: the watcher did not wake in {ARM_TIMEOUT_S} s")

    def _sleeping(self) -> bool:
        """Whether the watcher thread sleeps (state S in /proc), read without letting go of the
        GIL. After its read has returned, it can only sleep waiting for the GIL."""
        fd = _WITH_GIL.open(self._stat, os.O_RDONLY)
        if fd < 0:
            return True  # no /proc: the byte's arrival is all the arming waits for
        try:
            buf = ctypes.create_string_buffer(512)
            n = _WITH_GIL.read(fd, buf, 511)
        finally:
            _WITH_GIL.close(fd)
        # "tid (name) S ...": the state follows the last parenthesis
        return buf.raw[: max(n, 0)].rpartition(b")")[2][:2] == b" S"

    def close(self) -> None:
        self._closed = True
        os.write(self._wfd, b"x")
        self._thread.join(5)
        os.close(self._rfd)
        os.close(self._wfd)
        sys.setswitchinterval(self._interval)


def _hold(seconds: float) -> None:
    """Run Python (keeping the GIL) for `seconds`."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass
