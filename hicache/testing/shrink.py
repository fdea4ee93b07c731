"""Cut a failing sequence of operations down to one that still fails (delta debugging)."""

from __future__ import annotations

import time
from collections.abc import Callable

from hicache.testing.workload import Op


def shrink(ops: list[Op], fails: Callable[[list[Op]], bool], budget_s: float = 60.0) -> list[Op]:
    """The shortest sequence found within `budget_s` for which `fails` holds, removing chunks of
    halving size (`ops` fails)."""
    deadline = time.monotonic() + budget_s
    chunk = max(1, len(ops) // 2)
    while chunk >= 1 and time.monotonic() < deadline:
        i, cut = 0, False
        while i < len(ops) and time.monotonic() < deadline:
            trial = ops[:i] + ops[i + chunk :]
            if trial and fails(trial):
                ops, cut = trial, True
            else:
                i += chunk
        if not cut:
            chunk //= 2
    return ops
