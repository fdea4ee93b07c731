"""The GIL watcher's controls: it catches calls that let go of the GIL, and only those.

The tests that require "no engine-thread call lets go of the GIL" are only as good as the watch
they use; these prove that it sees a release when there is one. A released GIL is caught only if
the watcher, queued for it, is scheduled before the call takes it back, which a busy (or an idle,
slow-waking) machine may not do within a short release: the controls whose release has a length
therefore try calls that are each twice as long as the last, up to seconds; the one whose call
waits for the watcher must be caught every time. The calls that keep the GIL must never be
reported, however often they are tried.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import numpy as np
import pytest
from gil_watch import GilWatch, _hold


@pytest.fixture
def watch():
    w = GilWatch()
    yield w
    w.close()


def caught_within(watch: GilWatch, calls: Iterable[Callable[[], object]]) -> int | None:
    """The number of calls made until one was caught letting go of the GIL; None if none was."""
    for n, call in enumerate(calls, 1):
        released, _ = watch.released(call)
        if released:
            return n
    return None


def test_a_wait_for_another_thread_is_caught_every_time(watch: GilWatch) -> None:
    """A wait that ends only once another thread has had the GIL (the watcher itself) lets go
    of it by construction."""
    for _ in range(5):
        assert watch.released(watch.ran.wait, 60) == (True, True)


def test_a_sleep_is_caught(watch: GilWatch) -> None:
    sleeps = [0.01 * 2**k for k in range(11)]  # the last 10 s
    assert caught_within(watch, (lambda s=s: time.sleep(s) for s in sleeps)) is not None


def test_a_long_numpy_operation_is_caught(watch: GilWatch) -> None:
    """numpy lets go of the GIL around element loops on large arrays: here a sum over 1 Mi to
    2 Gi elements, a broadcast scalar, so that the length costs time and no memory."""
    sums = []

    def total(n: int) -> None:
        sums.append((n, int(np.add.reduce(np.broadcast_to(np.int64(1), (n,))))))

    assert caught_within(watch, (lambda k=k: total(1 << k) for k in range(20, 32))) is not None
    assert all(n == s for n, s in sums)


def test_python_that_keeps_the_gil_is_not_reported(watch: GilWatch) -> None:
    for _ in range(5):
        assert watch.released(_hold, 0.005) == (False, None)
        assert watch.released(sum, range(10_000)) == (False, sum(range(10_000)))
