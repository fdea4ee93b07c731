"""A simulated device: the engine's stream on the CPU, whose work runs only when the simulation
advances it (`hicache.kernels.completions.Transfers.sim_device`).

Work runs in the order it was queued, as on one CUDA stream: hicache's copies, and the fake
engine's own kernels (its prefill writing KV into the pool, its reads of loaded pages). An
event reads done once the work queued before it has run. Host slots that a queued GPU -> host
copy will fill are known (`pending_host`), so a reader that reaches them early is caught.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

import numpy as np

from hicache.kernels import Route


class SimEvent:
    """Done once the device has run everything queued before it."""

    __slots__ = ("_at", "_device")

    def __init__(self, device: SimDevice, at: int) -> None:
        self._device, self._at = device, at

    def query(self) -> bool:
        return self._device.ran >= self._at

    def synchronize(self) -> None:
        """Block (a worker thread) until the simulation has run the device this far."""
        self._device.wait_for(self._at)


class SimDevice:
    """A FIFO of work. `to_host` is the GPU -> host route (its copies mark host slots pending;
    `state_slots` work does the same for state slots)."""

    def __init__(self) -> None:
        self._work: deque[tuple[Callable[[], None], tuple[str, tuple[int, ...]] | None]] = deque()
        self.queued = 0  # work items ever queued
        self.ran = 0  # work items run
        self.to_host: Route | None = None
        self._waiting: list[tuple[str, int]] = []  # (thread, the count it waits for)
        self._cond = threading.Condition()

    # -- the Transfers' side ------------------------------------------------------------------

    def copy(self, route: Route, src_ids: np.ndarray, dst_ids: np.ndarray) -> None:
        src, dst = src_ids.copy(), dst_ids.copy()  # the caller may reuse its arrays
        fills = ("page", tuple(int(s) for s in dst)) if route is self.to_host else None
        self.run_later(lambda: route.copy(src, dst, 0), fills)

    def event(self) -> SimEvent:
        return SimEvent(self, self.queued)

    # -- the simulation's side ----------------------------------------------------------------

    def run_later(
        self, work: Callable[[], None], fills: tuple[str, tuple[int, ...]] | None = None
    ) -> None:
        """Queue `work` (an engine kernel or a copy); `fills`: the host slots it writes, as
        ("page" | "state", slots)."""
        self._work.append((work, fills))
        self.queued += 1

    def pending_host(self, kind: str = "page") -> set[int]:
        """Host slots of `kind` that queued work will still write."""
        out: set[int] = set()
        for _, fills in self._work:
            if fills is not None and fills[0] == kind:
                out.update(fills[1])
        return out

    def advance(self, n: int | None = None) -> int:
        """Run the next `n` work items (None: all). Returns how many ran."""
        done = 0
        while self._work and (n is None or done < n):
            work, _ = self._work.popleft()
            work()
            done += 1
            with self._cond:
                self.ran += 1
                self._cond.notify_all()
        return done

    @property
    def idle(self) -> bool:
        return not self._work

    @property
    def waiting(self) -> set[str]:
        """The threads blocked in `wait_for` on work not yet run (one whose work has run is not
        blocked, though it may not have woken yet: it will go on)."""
        with self._cond:
            return {name for name, at in self._waiting if self.ran < at}

    def wait_for(self, at: int) -> None:
        entry = (threading.current_thread().name, at)
        with self._cond:
            self._waiting.append(entry)
            try:
                while self.ran < at:
                    self._cond.wait()
            finally:
                self._waiting.remove(entry)
