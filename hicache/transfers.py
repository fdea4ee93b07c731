"""Copies on the engine's stream and their completion.

`Transfers.copy` enqueues a page copy (the CUDA kernel on the engine's stream, or the CPU twin,
which finishes before it returns). `Transfers.then(callback)` marks everything enqueued so far:
the callback runs from `poll` once those copies have completed — on CUDA when an event recorded
after them has fired. Nothing here synchronizes the device or waits.

Copies in both directions go on the same stream, so a load enqueued after a store reads the
stored bytes, and the engine's kernels enqueued after a load see the loaded pages.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import torch

from hicache.kernels import PagedBuffer, copy_pages
from hicache.stats import Histogram


class Completion:
    """Tells whether the copies behind it have finished."""

    __slots__ = ("event",)

    def __init__(self, event: torch.cuda.Event | None) -> None:
        self.event = event

    def done(self) -> bool:
        """Never blocks."""
        return self.event is None or self.event.query()

    def wait(self) -> None:
        """Block until the copies have finished, sleeping (the event is a blocking one) with the
        GIL released. For hicache's worker threads only: never call it on the engine thread."""
        if self.event is not None:
            self.event.synchronize()


DONE = Completion(None)


class Transfers:
    """Enqueues copies and runs callbacks, in order, once the copies before them are done.

    Each copy's duration goes into the histogram given with it: on the CPU the time of the
    copy itself; on CUDA the device time between events recorded around it, read in `poll`
    once the copy has completed (so reading it never waits).
    """

    def __init__(self, device: torch.device, stream: torch.cuda.Stream | None = None) -> None:
        self.device = device
        self._stream = stream
        self._waiting: deque[tuple[Completion, Callable[[], None], _Timing | None]] = deque()
        self._timing: _Timing | None = None  # the copy enqueued since the last `then`
        self._used: torch.cuda.Stream | None = None  # the stream of that copy

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"

    def stream(self) -> torch.cuda.Stream | None:
        """The stream copies go on: the one given at construction, else the current one."""
        if not self.on_cuda:
            return None
        return self._stream or torch.cuda.current_stream(self.device)

    def copy(
        self,
        src: PagedBuffer,
        src_ids: torch.Tensor,
        dst: PagedBuffer,
        dst_ids: torch.Tensor,
        latency: Histogram | None = None,
    ) -> None:
        """Enqueue `copy_pages`. The caller guarantees every id is in range: block ids checked
        by `GpuTier.block_ids`, host slots handed out by the host tier's pool."""
        if not self.on_cuda:
            started = time.perf_counter()
            copy_pages(src, src_ids, dst, dst_ids, ids_in_range=True)
            if latency is not None:
                latency.observe(time.perf_counter() - started)
            return
        stream = self._used = self.stream()  # `then` marks the same stream (asking costs ~20 µs)
        start = None
        if latency is not None:
            start = torch.cuda.Event(enable_timing=True)
            start.record(stream)
        copy_pages(src, src_ids, dst, dst_ids, stream=stream, ids_in_range=True)
        if start is not None:
            self._timing = (latency, start)

    def then(self, callback: Callable[[], None]) -> Completion:
        """Run `callback` from `poll` once everything enqueued so far has completed."""
        if not self.on_cuda:
            callback()
            return DONE
        timing, self._timing = self._timing, None
        stream, self._used = self._used or self.stream(), None
        event = torch.cuda.Event(enable_timing=timing is not None, blocking=True)
        event.record(stream)
        done = Completion(event)
        self._waiting.append((done, callback, timing))
        return done

    def poll(self) -> int:
        """Run the callbacks of finished copies, oldest first. Returns how many ran."""
        ran = 0
        while self._waiting and self._waiting[0][0].done():
            done, callback, timing = self._waiting.popleft()
            if timing is not None:
                latency, start = timing
                latency.observe(start.elapsed_time(done.event) / 1e3)  # both events completed
            callback()
            ran += 1
        return ran

    @property
    def in_flight(self) -> int:
        return len(self._waiting)


_Timing = tuple[Histogram, torch.cuda.Event]
