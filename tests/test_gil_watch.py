"""The GIL watcher's controls: it catches calls that let go of the GIL, and only those.

The tests that require "no engine-thread call lets go of the GIL" are only as good as the watch
they use; these prove that it sees a release when there is one.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from gil_watch import GilWatch, _hold


@pytest.fixture
def watch():
    w = GilWatch()
    yield w
    w.close()


def test_a_sleep_lets_go_of_the_gil_and_is_caught(watch: GilWatch) -> None:
    assert watch.released(time.sleep, 0.01) == (True, None)


def test_a_blocking_wait_is_caught(watch: GilWatch) -> None:
    never = threading.Event()
    assert watch.released(never.wait, 0.01) == (True, False)


def test_a_long_numpy_operation_is_caught(watch: GilWatch) -> None:
    """numpy lets go of the GIL around element loops on large arrays."""
    a = np.ones(8 << 20, dtype=np.float32)
    released, total = watch.released(np.add, a, a)
    assert released and float(total[0]) == 2.0


def test_python_that_keeps_the_gil_is_not_reported(watch: GilWatch) -> None:
    for _ in range(5):
        assert watch.released(_hold, 0.005) == (False, None)
        assert watch.released(sum, range(10_000)) == (False, sum(range(10_000)))
