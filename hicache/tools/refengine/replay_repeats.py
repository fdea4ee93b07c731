"""``hicache replay --repeats N``: the comparison made N times over, and its figures folded into
medians with their ranges.

One repetition's figures (the engine alone, the engine + hicache, and the ratios between them)
move by a fifth from run to run: a p50 over a few requests that include waiting behind another
conversation's turn is a noisy number. `fold` turns the repetitions into one result with the
same keys, each figure the median over the repetitions, and `spread` gives each headline
figure's smallest and largest value, which the report prints beside the median and the JSON
file keeps (``range``, ``per_repeat``)."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["HEADLINE", "fold", "spread"]

HEADLINE = (
    "ttft_p50_off_s",
    "ttft_p50_on_s",
    "ttft_p90_off_s",
    "ttft_p90_on_s",
    "ttft_p50_speedup",
    "last_turn_ttft_off_s",
    "last_turn_ttft_on_s",
    "last_turn_speedup",
    "e2e_off_s",
    "e2e_on_s",
    "cached_token_share",
)
"""The figures a repeated replay reports as a median and a range (each a number in every
repetition's result)."""


def fold(reps: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One result from the repetitions' results (each `hicache replay`'s result for one run):
    every number the median of its values, every list of numbers of one length the median
    element by element, every mapping folded key by key, ``identical`` true only where every
    repetition's answers were, the request counts summed, anything else the last repetition's.
    Adds ``repeats`` (their number), ``range`` (`spread`) and ``per_repeat`` (each one's
    headline figures). Raises ValueError for no repetitions."""
    if not reps:
        raise ValueError("fold needs at least one repetition")
    out = _fold(list(reps), statistics.median)
    out["identical"] = all(r["identical"] for r in reps)
    out["identical_requests"] = sum(r["identical_requests"] for r in reps)
    out["requests"] = sum(r["requests"] for r in reps)
    out["repeats"] = len(reps)
    out["range"] = spread(reps)
    out["per_repeat"] = [{k: r[k] for k in HEADLINE} for r in reps]
    return out


def spread(reps: Sequence[dict[str, Any]]) -> dict[str, list[float]]:
    """Each headline figure's [smallest, largest] value over the repetitions."""
    return {k: [min(r[k] for r in reps), max(r[k] for r in reps)] for k in HEADLINE}


def _fold(values: list[Any], median: Callable[[list[float]], float]) -> Any:
    last = values[-1]
    if isinstance(last, bool) or not all(type(v) is type(last) for v in values):
        return last
    if isinstance(last, (int, float)):
        return median(values)
    if isinstance(last, dict):
        keys = [k for k in last if all(k in v for v in values)]
        return {k: _fold([v[k] for v in values], median) for k in keys}
    if (
        isinstance(last, list)
        and all(len(v) == len(last) for v in values)
        and all(isinstance(x, (int, float)) and not isinstance(x, bool) for v in values for x in v)
    ):
        return [median(list(col)) for col in zip(*values)]
    return last
