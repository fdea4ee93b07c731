"""The cost model: is a page cheaper to read from a tier than to recompute?

Both sides grow with the page count alike, so one page decides for every fetch: a page of a
tier is worth fetching when ``page_bytes / read_rate < page_tokens / prefill_rate``. Each rate
is a moving average that starts from a default and learns from what is measured:

- a tier's read rate from its completed gets (bytes that arrived over the call's time), starting
  from the tier's `read_gbps:` or its backend's default (`StoreTier.read_gbps`);
- the engine's prefill rate from `HiCache.report_prefill` (tokens over seconds after each
  prefill), starting from `policy.prefill_tokens_per_s`.

A tier judged slower than recompute is still asked once in `EXPLORE_EVERY` fetches, so that its
measured rate can recover (a defaulted rate that was too low, a tier that got faster).
Engine thread only.
"""

from __future__ import annotations

EXPLORE_EVERY = 32
"""One fetch in this many that the model would skip is started anyway, to measure the tier."""

WEIGHT = 0.2
"""Weight of a new measurement in the moving averages."""


class Rate:
    """An exponentially weighted moving average of a throughput, in units per second."""

    __slots__ = ("per_s", "samples")

    def __init__(self, per_s: float) -> None:
        self.per_s = per_s
        self.samples = 0

    def observe(self, units: float, seconds: float) -> None:
        """Fold one measurement in (ignored if either side is not positive)."""
        if units <= 0 or seconds <= 0:
            return
        self.per_s += WEIGHT * (units / seconds - self.per_s)
        self.samples += 1


class Verdict:
    """Whether fetching beats recomputing for one tier, with the exploration counted."""

    __slots__ = ("_skipped", "page_bytes", "page_tokens", "prefill", "read")

    def __init__(self, read: Rate, prefill: Rate, page_bytes: int, page_tokens: int) -> None:
        self.read = read
        self.prefill = prefill
        self.page_bytes = page_bytes
        self.page_tokens = page_tokens
        self._skipped = 0

    def worth(self) -> bool:
        """True when a page reads faster than it computes, and once every `EXPLORE_EVERY`
        fetches that would be skipped otherwise."""
        if self.page_bytes * self.prefill.per_s < self.page_tokens * self.read.per_s:
            return True
        self._skipped += 1
        return self._skipped % EXPLORE_EVERY == 0
