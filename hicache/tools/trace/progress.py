"""A one-line progress bar on stderr for long replays."""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import TextIO


class Progress:
    """Counts `total` steps; when `show`, redraws ``[####....] 42% 12 s`` on `stream` at most
    ten times a second and clears the line at the end."""

    WIDTH = 30

    def __init__(self, total: int, show: bool, stream: TextIO | None = None) -> None:
        self.total = max(1, total)
        self.show = show
        self.stream = stream or sys.stderr
        self.done = 0
        self._start = time.monotonic()
        self._drawn = 0.0

    def advance(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if self.show and (now - self._drawn >= 0.1 or self.done >= self.total):
            self._drawn = now
            frac = min(1.0, self.done / self.total)
            bar = "#" * round(frac * self.WIDTH)
            self.stream.write(f"\r[{bar:<{self.WIDTH}}] {frac:4.0%} {now - self._start:5.0f} s")
            self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        err: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.show and self._drawn:
            self.stream.write("\r" + " " * (self.WIDTH + 14) + "\r")
            self.stream.flush()
