"""A thread-safe circuit breaker for calls to a remote service.

The breaker protects callers from a service that is down: after `failure_threshold`
consecutive failures it *opens* and refuses calls at once (each refusal is counted). Once
`reset_timeout_s` has passed it lets exactly one call through as a probe (*half-open*); the
probe's success closes the breaker, its failure opens it again for another interval.

Contract:

- `allow()` never blocks (one short lock) and never sleeps; it returns True when the caller may
  go ahead. A caller that got True must report the outcome with `record_success()` or
  `record_failure()`.
- A probe whose outcome is never reported (the caller died) does not wedge the breaker: after
  another `reset_timeout_s` a new probe is let through.
- Time comes from the injected `clock` (seconds, monotonic), so tests drive it without sleeping.

The module knows nothing about any particular service.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


class BreakerState(str, enum.Enum):
    """Where the breaker stands."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True)
class BreakerStats:
    """A snapshot of the breaker's counters."""

    state: BreakerState
    consecutive_failures: int
    failures: int
    successes: int
    refused: int
    opened: int
    probes: int


class CircuitBreaker:
    """Counts consecutive failures and refuses calls while the service looks down."""

    def __init__(
        self,
        failure_threshold: int,
        reset_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(failure_threshold, bool) or not isinstance(failure_threshold, int):
            raise TypeError(f"failure_threshold must be an int, got {failure_threshold!r}")
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold}")
        if not isinstance(reset_timeout_s, (int, float)) or isinstance(reset_timeout_s, bool):
            raise TypeError(f"reset_timeout_s must be a number, got {reset_timeout_s!r}")
        if not reset_timeout_s > 0:
            raise ValueError(f"reset_timeout_s must be > 0, got {reset_timeout_s}")
        self._threshold = failure_threshold
        self._reset_timeout = float(reset_timeout_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self.closed = True
        """Whether the breaker is closed: a plain attribute, kept with the state under the lock
        and read without it (it may be a moment stale), for the engine thread, which must never
        wait on a lock."""
        self._consecutive = 0
        self._opened_at = 0.0
        self._probe_at = 0.0
        self._failures = 0
        self._successes = 0
        self._refused = 0
        self._opened = 0
        self._probes = 0

    @property
    def state(self) -> BreakerState:
        """The current state (an OPEN breaker whose interval has passed still reads OPEN
        until a caller takes the probe)."""
        with self._lock:
            return self._state

    def allow(self) -> bool:
        """True when a call may go ahead now; False (counted as refused) otherwise."""
        with self._lock:
            if self._state is BreakerState.CLOSED:
                return True
            now = self._clock()
            if self._state is BreakerState.OPEN:
                if now - self._opened_at >= self._reset_timeout:
                    self._state, self.closed = BreakerState.HALF_OPEN, False
                    self._probe_at = now
                    self._probes += 1
                    return True
                self._refused += 1
                return False
            # HALF_OPEN: one probe is out; let another through only if it was lost.
            if now - self._probe_at >= self._reset_timeout:
                self._probe_at = now
                self._probes += 1
                return True
            self._refused += 1
            return False

    def record_success(self) -> None:
        """Report a call that reached the service: closes the breaker."""
        with self._lock:
            self._successes += 1
            self._consecutive = 0
            self._state, self.closed = BreakerState.CLOSED, True

    def record_failure(self) -> None:
        """Report a call that failed because of the service (unreachable, timed out)."""
        with self._lock:
            self._failures += 1
            self._consecutive += 1
            if self._state is BreakerState.HALF_OPEN or (
                self._state is BreakerState.CLOSED and self._consecutive >= self._threshold
            ):
                self._state, self.closed = BreakerState.OPEN, False
                self._opened_at = self._clock()
                self._opened += 1
            elif self._state is BreakerState.OPEN:
                # A call admitted before the breaker opened failed late: restart the interval.
                self._opened_at = self._clock()

    def reset(self) -> None:
        """Close the breaker and clear the failure run (for example after a fresh connection)."""
        with self._lock:
            self._consecutive = 0
            self._state, self.closed = BreakerState.CLOSED, True

    def stats(self) -> BreakerStats:
        """A consistent snapshot of the counters."""
        with self._lock:
            return BreakerStats(
                state=self._state,
                consecutive_failures=self._consecutive,
                failures=self._failures,
                successes=self._successes,
                refused=self._refused,
                opened=self._opened,
                probes=self._probes,
            )
