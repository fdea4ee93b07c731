"""KV events: which page keys a tier gained or lost, for cache-aware routers.

A router that knows which instance holds which prefix can send a conversation's next turn where
its pages already are. hicache reports changes as `KVEvent`s to an optional sink given to
`HiCache(events=...)`: any callable taking one event. `EventQueue` is a ready sink: a bounded
queue a publisher thread drains (when it is full, new events are dropped and counted, so a slow
consumer never holds up the engine thread).

Events are emitted on the engine thread, in the order the books changed:

- ``stored`` / host: pages published in the host tier (written through, or fetched from a
  store tier);
- ``removed`` / host: pages evicted from the host tier;
- ``stored`` / <tier name>: page groups a store tier accepted (keys are the groups' last page
  keys; the tier is named by its `name:`, by default its type: ``disk``, ``mooncake``).
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class KVEvent:
    """Page keys (16 bytes each) that `tier` stored or removed."""

    kind: Literal["stored", "removed"]
    tier: str
    keys: tuple[bytes, ...]


EventSink = Callable[[KVEvent], None]


class EventQueue:
    """A bounded, thread-safe sink: `put` never blocks; `drain` returns what is queued."""

    def __init__(self, maxsize: int = 10_000) -> None:
        self._queue: queue.Queue[KVEvent] = queue.Queue(maxsize=maxsize)
        self.dropped = 0

    def __call__(self, event: KVEvent) -> None:
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            self.dropped += 1

    def drain(self, limit: int | None = None) -> list[KVEvent]:
        out: list[KVEvent] = []
        while limit is None or len(out) < limit:
            try:
                out.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return out


def emit(
    sink: EventSink | None, kind: Literal["stored", "removed"], tier: str, keys: Sequence[bytes]
) -> None:
    """Send one event if there is a sink and anything to report."""
    if sink is not None and keys:
        sink(KVEvent(kind, tier, tuple(keys)))
