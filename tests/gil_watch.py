"""`GilWatch`: did a call let go of the GIL?

hicache's engine-thread calls keep the GIL from start to end: a call that releases it (a numpy
operation on a long array, torch's ``Event.record``, a blocking lock) lets any hicache worker that
is waiting for the GIL run first, and the engine waits for it. The watch arms a thread that wants
the GIL during the call, and only then: it runs (and counts) if and only if the call releases it.
A release can be missed (the watcher may not have queued for the GIL yet, or a worker may take
it first), never invented: the switch interval is raised to a minute while the watch is on, so
nothing but a release hands the GIL over (with the usual interval, or a second, a thread starved
on a busy machine would have the GIL taken from it in the middle of a call).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any


class GilWatch:
    def __init__(self) -> None:
        self._armed = threading.Event()
        self._runs = 0
        self._closed = False
        self._interval = sys.getswitchinterval()
        sys.setswitchinterval(60.0)  # no forced hand-over during a watched call
        self._thread = threading.Thread(target=self._watch, daemon=True, name="gil-watch")
        self._thread.start()

    def _watch(self) -> None:
        while True:
            self._armed.wait()
            self._armed.clear()
            if self._closed:
                return
            self._runs += 1

    def released(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[bool, Any]:
        """Call `fn`; True if it let go of the GIL, with its result."""
        before = self._runs
        self._armed.set()
        _hold(0.0005)  # the watcher wakes and queues for the GIL, which this thread holds
        result = fn(*args, **kwargs)
        released = self._runs != before
        while self._runs == before:  # let it through (it disarms itself) before the next call
            time.sleep(0.0001)
        return released, result

    def close(self) -> None:
        self._closed = True
        self._armed.set()
        self._thread.join(5)
        sys.setswitchinterval(self._interval)


def _hold(seconds: float) -> None:
    """Run Python (keeping the GIL) for `seconds`."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass
