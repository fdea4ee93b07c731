"""Copies on the engine's stream that complete late, as CUDA's do, on the CPU.

`LateTransfers` is a `hicache.kernels.completions.Transfers` whose page copies are held, in
order, until the test calls `complete()`: then every held copy moves its bytes and every
completion made so far reads done (and a worker waiting on one wakes). A test installs it with
``monkeypatch.setattr(hicache.cache, "Transfers", LateTransfers)`` before it builds the cache.

The held copies move their bytes at `complete()`, so, as an engine does on a GPU, the test
leaves the blocks it stored from unchanged (not freed, not computed into) until then. Loads by
layer (`copy_layers`) are not held.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np

from hicache.kernels import Route
from hicache.kernels.completions import Completion, Transfers
from hicache.observability.stats import Histogram


class _Mark:
    """The event of a completion: done once `complete()` has run the copies before it."""

    def __init__(self, owner: LateTransfers) -> None:
        self._owner = owner
        self._landed = owner._landed

    def query(self) -> bool:
        return self._landed.is_set()

    def synchronize(self) -> None:
        if not self._landed.is_set():
            self._owner.waiters += 1
        if not self._landed.wait(600):
            raise AssertionError("held copies were never completed (call complete())")


class LateTransfers(Transfers):
    """Holds page copies until `complete()`; completions read done only after it."""

    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.held: list[Callable[[], None]] = []
        self._landed = threading.Event()
        self.waiters = 0
        """Waits (by worker threads) that began before their copies had completed."""

    def copy(
        self,
        route: Route,
        src_ids: np.ndarray,
        dst_ids: np.ndarray,
        latency: Histogram | None = None,
    ) -> None:
        src, dst = src_ids.copy(), dst_ids.copy()  # the caller may reuse its arrays
        self.held.append(lambda: route.copy(src, dst, 0))

    def then(self, callback: Callable[[], None]) -> Completion:
        done = Completion(_Mark(self))
        self._waiting.append((done, callback, None))
        return done

    def fence(self) -> Completion:
        return Completion(_Mark(self))

    def complete(self) -> int:
        """Move the bytes of every held copy, in order; every completion made so far reads
        done from now on. Returns how many copies ran."""
        held, self.held = self.held, []
        for move in held:
            move()
        landed, self._landed = self._landed, threading.Event()
        landed.set()
        return len(held)

    def settle_workers(self, idle: Callable[[], bool], waits: int, timeout: float = 120) -> None:
        """Wait until `waits` worker waits have begun on held copies, or `idle()` (the workers
        finished without waiting): what a worker does with a job it got before `complete()`
        is then done, or waiting."""
        deadline = time.monotonic() + timeout
        while self.waiters < waits and not idle():
            if time.monotonic() > deadline:
                raise AssertionError("the workers neither waited nor finished in time")
            time.sleep(0.002)
