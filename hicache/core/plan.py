"""Partial fetch: compute the head of a hit while a slow tier sends its tail.

A hit of H tokens in a tier that reads B bytes/s costs ``H / page_tokens * page_bytes / B`` to
fetch; recomputing it costs the engine's prefill of [0, H). When the two are of the same order,
neither is best: the engine prefills [0, k) while the tier sends the pages of [k, H), and both
finish together. KV at positions >= k does not depend on how [0, k) was produced, so the result
is exact (for sliding-window layers the state at H, stored with the pages, replaces the window
the head left). `plan_fetch` picks k; "fetch all" (k = computed) and "recompute all" (k = H) are
its end points.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefillSpeed:
    """How fast the engine prefills: `tokens_per_s` at no context, slowed by attention over the
    context (`context_s_per_token2`: extra seconds per token per token of context before it), so
    that [a, b) takes ``(b - a) / tokens_per_s + context_s_per_token2 * (b*b - a*a) / 2``."""

    tokens_per_s: float
    context_s_per_token2: float = 0.0

    def __post_init__(self) -> None:
        if not self.tokens_per_s > 0 or self.context_s_per_token2 < 0:
            raise ValueError(
                f"prefill speed needs tokens_per_s > 0 and context_s_per_token2 >= 0, got "
                f"{self.tokens_per_s} and {self.context_s_per_token2}"
            )

    def seconds(self, start: int, end: int) -> float:
        """Seconds to prefill tokens [start, end)."""
        return (end - start) / self.tokens_per_s + self.context_s_per_token2 * (
            end * end - start * start
        ) / 2

    @classmethod
    def fit(cls, a: tuple[int, float], b: tuple[int, float]) -> PrefillSpeed:
        """The speed through two measurements (tokens prefilled from position 0, seconds), for
        example 2K and 32K tokens. Where the longer one is less than linear in the tokens (a
        fixed cost per call dominates the shorter), the average speed of the longer one, with
        no context term: the plan then errs towards the longer prefills it is used for."""
        (n1, t1), (n2, t2) = sorted((a, b))
        if n1 <= 0 or n1 == n2 or t1 <= 0 or t2 <= 0:
            raise ValueError(f"fit needs two distinct positive measurements, got {a} and {b}")
        # t = n / r + c n^2 / 2  ->  t / n = 1 / r + c n / 2
        c = 2 * (t2 / n2 - t1 / n1) / (n2 - n1)
        if c <= 0:
            return cls(n2 / t2)
        return cls(1 / (t1 / n1 - c * n1 / 2), c) if t1 / n1 > c * n1 / 2 else cls(n2 / t2)


@dataclass(frozen=True)
class Plan:
    """Which part of a hit to recompute and which to fetch, and the times the model expects."""

    computed_tokens: int
    head_tokens: int
    """k: the engine prefills [computed_tokens, k) and fetches [k, hit_tokens)."""
    hit_tokens: int
    head_s: float
    fetch_s: float

    @property
    def fetch_tokens(self) -> int:
        return self.hit_tokens - self.head_tokens

    @property
    def finish_s(self) -> float:
        """When both parts are done, from the start, as the model sees it."""
        return max(self.head_s, self.fetch_s)

    @property
    def kind(self) -> str:
        """ "fetch_all", "recompute_all" or "split"."""
        if self.head_tokens == self.computed_tokens:
            return "fetch_all"
        return "recompute_all" if self.head_tokens == self.hit_tokens else "split"


def plan_fetch(
    hit_tokens: int,
    *,
    page_tokens: int,
    page_bytes: int,
    read_bytes_per_s: float,
    prefill: PrefillSpeed,
    computed_tokens: int = 0,
    latency_s: float = 0.0,
) -> Plan:
    """The split k (a page boundary in [computed_tokens, hit_tokens]) that minimizes
    ``max(prefill of [computed_tokens, k), fetch of [k, hit_tokens))``, with the fetch of
    ``pages * page_bytes / read_bytes_per_s + latency_s`` (nothing to fetch costs nothing).
    The prefill grows with k and the fetch shrinks, so the best k is where they cross: found by
    bisection over the pages, O(log pages)."""
    if page_tokens <= 0 or page_bytes <= 0 or not read_bytes_per_s > 0 or latency_s < 0:
        raise ValueError(
            "plan_fetch needs page_tokens > 0, page_bytes > 0, read_bytes_per_s > 0 and "
            f"latency_s >= 0, got {page_tokens}, {page_bytes}, {read_bytes_per_s}, {latency_s}"
        )
    if computed_tokens % page_tokens or hit_tokens % page_tokens:
        raise ValueError(
            f"computed_tokens={computed_tokens} and hit_tokens={hit_tokens} must be multiples of "
            f"page_tokens={page_tokens}"
        )
    if not 0 <= computed_tokens <= hit_tokens:
        raise ValueError(f"need 0 <= computed_tokens={computed_tokens} <= hit_tokens={hit_tokens}")
    lo, hi = computed_tokens // page_tokens, hit_tokens // page_tokens

    def head(page: int) -> float:
        return prefill.seconds(computed_tokens, page * page_tokens)

    def fetch(page: int) -> float:
        return 0.0 if page == hi else latency_s + (hi - page) * page_bytes / read_bytes_per_s

    # the first page boundary where the head takes at least as long as the fetch
    a, b = lo, hi
    while a < b:
        mid = (a + b) // 2
        if head(mid) >= fetch(mid):
            b = mid
        else:
            a = mid + 1
    best = min({a, max(lo, a - 1), lo, hi}, key=lambda p: (max(head(p), fetch(p)), -p))
    return Plan(computed_tokens, best * page_tokens, hit_tokens, head(best), fetch(best))
