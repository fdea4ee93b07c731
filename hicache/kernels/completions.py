"""Copies on the engine's stream and their completion.

`Transfers.copy` enqueues a page copy along a `Route` (on CUDA, on the engine's stream; on the
CPU the copy finishes before it returns). `Transfers.then(callback)` marks everything enqueued so
far: the callback runs from `poll` once those copies have completed — on CUDA when an event
recorded after them has fired. Nothing here synchronizes the device or waits, and nothing here
releases the GIL: the events are made and recorded by hicache's copy extension (torch's
``Event.record`` releases it, which lets a hicache worker that wants the GIL cut into the
engine-thread call).

Events without timing are recorded again once `poll` has seen them complete (making and
destroying one per copy costs more); the completion they leave reads done from then on.

Copies in both directions go on the same stream, so a load enqueued after a store reads the
stored bytes, and the engine's kernels enqueued after a load see the loaded pages. A thread that
reads host slots itself (a store tier's worker) waits first for `Transfers.fence()`: the
completion of every copy enqueued so far, so no slot is read before the copy that fills it.

On the CPU a `Device` may stand in for the stream (`Transfers.sim_device`; the simulation of
`hicache.testing` sets one): copies are then queued on it, run only when it says, and their
completions read done only from then on, as a GPU's do. Unset (the default), the CPU path copies
at once, and the CUDA path never looks at it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from hicache.kernels import Route
from hicache.observability.stats import Histogram

if TYPE_CHECKING:
    from hicache.kernels.cuda import CudaEvent

#: On CUDA one copy in this many is timed (a timing event before it, read once both completed):
#: enough for the latency histograms, and one event fewer for the others.
TIME_EVERY = 8
#: Completed events (without timing) kept to be recorded again by later copies: on the CUDA
#: paths making and destroying an event costs the engine thread more than recording one again.
SPARE_EVENTS = 64


class _Event(Protocol):
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...


class Device(Protocol):
    """A stand-in for a CUDA stream on the CPU: copies run in the order enqueued, when it says."""

    def copy(self, route: Route, src_ids: np.ndarray, dst_ids: np.ndarray) -> None:
        """Queue a copy along `route` (the ids are the caller's: copy them)."""

    def event(self) -> _Event:
        """An event recorded after everything queued so far."""


class Completion:
    """Tells whether the copies behind it have finished."""

    __slots__ = ("event",)

    def __init__(self, event: _Event | None) -> None:
        self.event = event

    def done(self) -> bool:
        """Never blocks."""
        return self.event is None or self.event.query()

    def wait(self) -> None:
        """Block until the copies have finished, sleeping (the event is a blocking one) with the
        GIL released. For hicache's worker threads only: never call it on the engine thread.

        Once `Transfers.poll` has retired the copies it takes the event back for later copies
        (`event` becomes None). A wait that read the event just before may then also wait for
        those later copies: later, never too early."""
        event = self.event
        if event is not None:
            event.synchronize()

    def wait_layer(self, layer: int, stream: torch.cuda.Stream | int | None = None) -> None:
        """Order `stream` after layer `layer`'s copies. A whole load's copies run on the engine's
        stream, so kernels enqueued after them already see every layer: nothing to do (see
        `LayerLoad` for a load that runs beside it)."""


DONE = Completion(None)


class LayerLoad(Completion):
    """A load whose pages arrive layer by layer, on a copy stream beside the engine's.

    `wait_layer(i)` makes the engine's stream wait, on the device, for layer i's copies alone:
    the engine calls it before it computes layer i (or before any kernel reads layer i's
    pages), and never waits on the host. `done()` turns true once the last layer is in. On the
    CPU the copies finished before the load returned, and every wait is a no-op.
    """

    __slots__ = ("_device", "_events", "layers")

    def __init__(self, events: list[CudaEvent], device: int) -> None:
        super().__init__(events[-1] if events else None)
        self._events, self._device = events, device
        self.layers = len(events)

    def wait_layer(self, layer: int, stream: torch.cuda.Stream | int | None = None) -> None:
        """Make `stream` (a stream or its handle; default the device's current stream) wait
        for layer `layer`'s pages. Never blocks the host thread."""
        if self.event is None:  # retired by `Transfers.poll`: every layer is in
            return
        if not 0 <= layer < self.layers:
            raise ValueError(f"layer {layer} is outside the load's {self.layers} layers")
        if stream is None:
            from hicache.kernels.cuda import current_stream_handle

            stream = current_stream_handle(torch.device("cuda", self._device))
        elif isinstance(stream, torch.cuda.Stream):
            stream = stream.cuda_stream
        self._events[layer].block(stream, self._device)


class Transfers:
    """Enqueues copies and runs callbacks, in order, once the copies before them are done.

    Each copy's duration goes into the histogram given with it: on the CPU the time of the copy
    itself, every copy; on CUDA the device time between events recorded around it, one copy in
    `TIME_EVERY`, read in `poll` once the copy has completed (so reading it never waits).
    """

    sim_device: Device | None = None
    """On the CPU: where copies are queued instead of run at once (see the module docstring)."""

    def __init__(self, device: torch.device, stream: torch.cuda.Stream | None = None) -> None:
        self.device = device
        self.on_cuda = device.type == "cuda"
        self._waiting: deque[tuple[Completion, Callable[[], None], _Timing | None]] = deque()
        self._spare: list[CudaEvent] = []  # completed events to record again (`SPARE_EVENTS`)
        self._timing: _Timing | None = None  # the timed copy enqueued since the last `then`
        self._copies = 0
        self._stream: int | None = None  # the handle of the stream given, if one was
        self._used: int | None = None  # the stream of the copies enqueued since the last `then`
        self._side: torch.cuda.Stream | None = None  # the stream of layer-by-layer copies
        self._fork: CudaEvent | None = None  # orders it after the engine's stream
        self._last: Completion = DONE  # the completion `then` made last (`fence`)
        if self.on_cuda:
            from hicache.kernels.cuda import current_stream_handle, event_class

            self._event, self._current = event_class(), current_stream_handle
            self._index = device.index if device.index is not None else torch.cuda.current_device()
            if stream is not None and stream.device.index != self._index:
                raise ValueError(f"the stream is on {stream.device}, the GPU pool on {device}")
            self._stream = stream.cuda_stream if stream is not None else None

    def stream(self) -> int:
        """The handle of the stream copies go on: the one given at construction, else the
        current one (0 on the CPU)."""
        if not self.on_cuda:
            return 0
        return self._stream if self._stream is not None else self._current(self.device)

    def copy(
        self,
        route: Route,
        src_ids: np.ndarray,
        dst_ids: np.ndarray,
        latency: Histogram | None = None,
    ) -> None:
        """Enqueue a copy along `route` (its contract: C-contiguous int32 ids in range; block ids
        checked by `GpuTier.block_ids`, host slots handed out by the host tier's pool)."""
        if not self.on_cuda:
            if self.sim_device is not None:
                self.sim_device.copy(route, src_ids, dst_ids)
                return
            started = time.perf_counter()
            route.copy(src_ids, dst_ids, 0)
            if latency is not None:
                latency.observe(time.perf_counter() - started)
            return
        stream = self._used = self.stream()
        self._copies += 1
        if latency is not None and self._timing is None and self._copies % TIME_EVERY == 1:
            start = self._event(self._index, timing=True)
            start.record(stream, self._index)
            self._timing = (latency, start)
        route.copy(src_ids, dst_ids, stream)

    def copy_layers(
        self,
        routes: Sequence[Route],
        src_ids: np.ndarray,
        dst_ids: np.ndarray,
        callback: Callable[[], None],
        latency: Histogram | None = None,
    ) -> Completion:
        """Copy along `routes` (one per layer, in order) on the copy stream, which first waits
        for the work enqueued so far on the engine's stream; record one event after each layer
        and run `callback` from `poll` once the last layer is in. Returns a `LayerLoad` (on the
        CPU the copies and the callback ran before it returns: `DONE`)."""
        if not self.on_cuda:
            if self.sim_device is not None:
                for r in routes:
                    self.sim_device.copy(r, src_ids, dst_ids)
                return self.then(callback)
            started = time.perf_counter()
            for r in routes:
                r.copy(src_ids, dst_ids, 0)
            if latency is not None:
                latency.observe(time.perf_counter() - started)
            callback()
            return DONE
        if self._side is None:
            self._side = torch.cuda.Stream(device=self.device)  # the layered copies' stream
            self._fork = self._event(self._index)
        side = self._side.cuda_stream
        self._fork.record(self.stream(), self._index)  # recording it again is legal: the
        self._fork.block(side, self._index)  # wait takes the record current at the call
        self._copies += 1
        timing = None
        if latency is not None and self._copies % TIME_EVERY == 1:
            start = self._event(self._index, timing=True)
            start.record(side, self._index)
            timing = (latency, start)
        events = []
        for i, r in enumerate(routes):
            r.copy(src_ids, dst_ids, side)
            last = i == len(routes) - 1
            event = self._event(self._index, timing=timing is not None and last)
            event.record(side, self._index)
            events.append(event)
        load = LayerLoad(events, self._index)
        self._waiting.append((load, callback, timing))
        return load

    def then(self, callback: Callable[[], None]) -> Completion:
        """Run `callback` from `poll` once everything enqueued so far has completed."""
        if not self.on_cuda:
            if self.sim_device is None:
                callback()
                return DONE
            done = Completion(self.sim_device.event())
            self._waiting.append((done, callback, None))
            return done
        timing, self._timing = self._timing, None
        stream = self._used if self._used is not None else self.stream()
        self._used = None
        if timing is None and self._spare:
            event = self._spare.pop()
        else:
            event = self._event(self._index, timing=timing is not None)
        event.record(stream, self._index)
        done = self._last = Completion(event)
        self._waiting.append((done, callback, timing))
        return done

    def fence(self) -> Completion:
        """A completion of every copy enqueued so far on the engine's stream: what a worker that
        reads host slots waits for first (every copy into a slot published so far is covered).
        The last one `then` made where no copy was enqueued since (no new event); on the CPU,
        where a copy finishes before it returns, `DONE` (with a `sim_device`: done once it has
        run the work queued so far)."""
        if not self.on_cuda:
            return DONE if self.sim_device is None else Completion(self.sim_device.event())
        if self._used is None:
            return self._last
        return self.then(_nothing)

    def poll(self) -> int:
        """Run the callbacks of finished copies, oldest first. Returns how many ran."""
        ran = 0
        while self._waiting and self._waiting[0][0].done():
            done, callback, timing = self._waiting.popleft()
            if timing is not None:
                latency, start = timing
                latency.observe(start.elapsed_s(done.event))  # both events completed
            elif len(self._spare) < SPARE_EVENTS:
                # the completion reads done without its event from now on, so recording the
                # event again for later copies cannot change what it answers
                self._spare.append(done.event)
                done.event = None
            callback()
            ran += 1
        return ran

    @property
    def in_flight(self) -> int:
        return len(self._waiting)


_Timing = tuple[Histogram, "CudaEvent"]


def _nothing() -> None:
    """The callback of a `fence`."""
