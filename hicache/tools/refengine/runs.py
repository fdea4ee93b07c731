"""What the replay's runs share (`hicache.tools.refengine.replay` and its data-parallel ranks,
`hicache.tools.refengine.dp`): the progress line, percentiles, the warm-up and the local store's
size."""

from __future__ import annotations

import statistics
import sys
import time

from hicache.tools.refengine.engine import Engine, Request

LOCAL_STORE_BYTES = 1 << 30
"""The segment of the local Mooncake master that ``--store local`` starts."""


class Progress:
    """Progress on stderr: a one-line bar on a terminal; elsewhere (a pipe, a log file) a line
    as the phase starts, a line at most every `every_s` seconds while it runs (a long phase is
    not silent in a log), and one as it ends."""

    def __init__(self, total: int, label: str, enabled: bool, every_s: float = 30.0) -> None:
        self.total, self.label, self.n = total, label, 0
        self.bar = enabled and sys.stderr.isatty()
        self.lines = enabled and not self.bar
        self.start = time.perf_counter()
        self.every_s, self.last_line = every_s, self.start
        if self.lines:
            print(f"hicache replay: {label}: {total} requests", file=sys.stderr, flush=True)
        self._draw()

    def tick(self, _req: Request | None = None) -> None:
        self.n += 1
        self._draw()
        if not self.lines:
            return
        now = time.perf_counter()
        if self.n == self.total:
            el = now - self.start
            print(f"hicache replay: {self.label}: done in {el:.1f} s", file=sys.stderr, flush=True)
        elif now - self.last_line >= self.every_s:
            self.last_line = now
            print(
                f"hicache replay: {self.label}: {self.n}/{self.total} requests in "
                f"{now - self.start:.0f} s",
                file=sys.stderr,
                flush=True,
            )

    def _draw(self) -> None:
        if not self.bar:
            return
        width = 30
        full = width * self.n // max(self.total, 1)
        bar = "#" * full + "." * (width - full)
        el = time.perf_counter() - self.start
        sys.stderr.write(f"\r{self.label:>9} [{bar}] {self.n}/{self.total} requests {el:6.1f}s")
        if self.n >= self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def percentile(xs: list[float], q: float) -> float:
    """The `q`-th percentile of `xs` (inclusive method); NaN for none."""
    if not xs:
        return float("nan")
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q) - 1]


def warmup(engine: Engine) -> None:
    """Run a short request, then one that starts with it (a hit; with hicache, hicache's: the
    GPU prefix cache is emptied between them), so that first-call costs of the prefill, the
    store and the load do not land in the first measured TTFT."""
    prompt = list(range(1, 2 * engine.memory.page_tokens + 1))
    engine.run([Request("warmup", prompt, 2)])
    if engine.prefix is not None and engine.cache is not None:
        engine.memory.free(engine.prefix.evict(len(engine.prefix)))
    engine.run([Request("warmup-hit", [*prompt, *prompt], 2)])
    engine.finished.clear()
