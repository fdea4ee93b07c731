"""Coverage marks: named points on the paths that matter, counted while a run counts them.

A mark (FoundationDB calls them code probes) sits in the real code where a path worth testing
is taken: ``mark("store.get.partial")``. A test harness turns counting on (`counting`), runs,
and reads how often each mark was reached, so that a path the simulation claims to exercise
cannot silently stop being exercised (``python -m hicache.testing.sim --coverage`` fails when a
mark of `MARKS` was never reached). When nothing counts, `mark` is a global read and a return.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

MARKS: dict[str, str] = {
    "cache.match": "a match (the store-read figures are per match)",
    "store.get": "a store tier's get issued",
    "store.get.keys": "objects a store tier's get asked for",
    "store.get.keys-back": "objects a get returned whole and verified",
    "store.get.partial": "a get returned a leading run of its objects, not all",
    "fetch.middle-lost-state-present": "a get lost a group inside its run while its state came",
    "fetch.forgotten-while-getting": "a request went away while its fetch's get ran (the get "
    "keeps its slots until it returns)",
    "fetch.deadline-missed": "a request's walk down the store tiers outlived its deadline",
    "tp.load-failed-on-another-rank": "a TP rank's load fell short because another rank's did",
    "keys.images-on-one-token-pages": "a request with images keyed on pages of one token",
    "vllm.store-hit-granted-in-step": "vLLM's scheduler granted a store tier's pages from its "
    "own probe, in the step",
    "codec.decoded": "an object decoded by the codec",
    "codec.encoded-read-without-codec": "an encoded object read by an instance without a codec",
    "codec.raw-read-with-codec": "an object stored without a codec read by one with a codec",
    "codec.odd-size": "an object of an odd number of bytes put under codec: lossless",
    "checksum.mismatch": "a payload's checksum did not match: a miss",
    "store.discard-unreadable": "a get had the store discard objects it found unreadable (changed "
    "at rest, another key), so that they are stored again",
    "disk.record-damaged": "the disk tier found a record damaged at rest: a miss, removed",
    "disk.leftover-removed": "the disk tier, reopened, removed a record an earlier process died "
    "writing",
    "disk.evicted": "the disk tier evicted records to make room",
    "disk.stray-skipped": "the disk tier, listing its directory, skipped entries not its own",
    "sim.two-writers": "puts of two open instances reached one store one after the other",
    "sim.poisoned-get": "a failed get left poison in the buffers of objects it did not return",
    "sim.poisoned-put": "a failed put left its object torn: its header whole, its payload poison",
    "sim.poisoned-load": "a failed load left poison in the blocks it did not fill (vLLM)",
    "store.forgot-missing": "a link found missing an object it had put or read (the tier "
    "dropped it): a later store puts it again",
    "plugin.base-exception": "a store call raised a BaseException (not an Exception)",
    "host.evict.lru": "the host tier evicted by lru",
    "host.evict.arc": "the host tier evicted by arc",
    "host.evict.s3fifo": "the host tier evicted by s3fifo",
    "host.evict.prefix": "the host tier evicted by prefix",
    "host.evict.s3fifo-main-pinned": "s3fifo's main queue passed over a pinned key",
    "write.behind": "a write: behind tier offered a store's groups",
    "write.on_evict": "a write: on_evict tier put groups the host was about to evict",
    "write.off": "a store whose tiers include a write: off tier",
}
"""Every mark's name and what reaching it means."""

_counts: dict[str, int] | None = None
_lock = threading.Lock()


def mark(name: str, n: int = 1) -> None:
    """Count `n` at mark `name` (one of `MARKS`) while counting; nothing otherwise."""
    if _counts is not None:
        with _lock:
            _counts[name] = _counts.get(name, 0) + n


def active() -> bool:
    """Whether marks are being counted (for a mark whose condition costs something to read)."""
    return _counts is not None


@contextlib.contextmanager
def counting() -> Iterator[dict[str, int]]:
    """Count the marks reached in this process until the block ends; yields the counts (a mark
    never reached is absent)."""
    global _counts
    counts: dict[str, int] = {}
    _counts = counts
    try:
        yield counts
    finally:
        _counts = None
