"""The scheduler's view of what each TP rank's tiers hold, so that most questions are answered
in the step they are asked.

Each worker sends, in its per-step metadata, the page keys its host tier gained and lost and the
page groups its store tiers accepted (`RankNews`, from hicache's KV events). From them the
scheduler keeps, per rank, the set of host pages and the set of group ends this process wrote
to a store tier. A question is then answered at once when the view can tell the whole answer:

- the host tiers hold a prefix of h pages (h may be 0), and
- no store tier can hold the page after it: no rank has a store tier whose contents this
  process did not write itself (a shared tier such as Mooncake, or a disk tier that held
  records when the worker started), and no page from h on is a group end a store tier took.

Otherwise the question goes to the workers as before (a lower-tier fetch takes a round trip).

The view may be a step behind the workers (their news arrives with the step's output), so an
answer from it is a claim the load checks: the worker matches the pages again when it loads
them, pins them then, and reports any page that went meanwhile through vLLM's
`get_block_ids_with_load_errors`: vLLM recomputes it. A page the view misses is a miss, never
a wrong byte.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hicache.core.keys import KeyChain, as_tokens, chain_seed

LOWER_KEYS_MAX = 1 << 20
"""Store-tier group ends kept per rank; past it the rank's store tiers count as unknown."""


@dataclass
class RankNews:
    """One worker's news for the scheduler: its layout fingerprint (the namespace of its keys),
    whether its store tiers may hold pages it did not write (`lower_unknown`), the host pages
    it gained and lost, and the group ends (last page keys) its store tiers accepted."""

    fingerprint: bytes
    lower_unknown: bool
    stored: list[bytes] = field(default_factory=list)
    removed: list[bytes] = field(default_factory=list)
    lower: list[bytes] = field(default_factory=list)

    def merge(self, later: RankNews) -> None:
        """Append `later` news of the same rank (in the order the books changed)."""
        self.stored += later.stored
        self.removed += later.removed
        self.lower += later.lower
        self.lower_unknown = later.lower_unknown


class _Rank:
    """What one rank's worker reported."""

    __slots__ = ("fingerprint", "forgot_lower", "host", "lower", "lower_unknown")

    def __init__(self, news: RankNews) -> None:
        self.fingerprint = news.fingerprint
        self.host: set[bytes] = set()
        self.lower: set[bytes] = set()
        self.lower_unknown = news.lower_unknown
        self.forgot_lower = False


class TierView:
    """Per TP rank, the host pages and the store-tier group ends the workers reported.

    `ranks`: how many ranks must have reported before the view answers anything (until then
    every question is asked)."""

    def __init__(self, ranks: int, page_tokens: int) -> None:
        self._ranks: dict[int, _Rank] = {}
        self._want = ranks
        self._page = page_tokens

    def update(self, news: dict[int, RankNews]) -> None:
        """Apply one step's news of each rank that sent some."""
        for rank, got in news.items():
            view = self._ranks.get(rank)
            if view is None or view.fingerprint != got.fingerprint:  # a new worker: start afresh
                view = self._ranks[rank] = _Rank(got)
            view.lower_unknown = got.lower_unknown
            view.host.update(got.stored)
            view.host.difference_update(got.removed)
            view.lower.update(got.lower)
            if len(view.lower) > LOWER_KEYS_MAX:  # too many to keep: ask about its tiers
                view.lower.clear()
                view.lower_unknown = view.forgot_lower = True
            view.lower_unknown |= view.forgot_lower

    def hit_pages(
        self, tokens: list[int], salt: str | bytes | None, first: int, cap: int
    ) -> int | None:
        """The pages [first, h) every rank's host tier holds, as h, when the view can tell that
        no store tier holds page h; None when the workers must be asked. `cap`: the last page
        the engine may skip plus one (a hit never passes it). A store tier's group that starts
        before the cap may end past it (the workers fetch it and load its pages up to the
        cap), so every full page of `tokens` from h on is looked for among the group ends.
        Each rank's seed is derived here, per question (one hash): nothing is kept per salt."""
        if self.ready and any(view.lower_unknown for view in self._ranks.values()):
            return None
        runs = self.host_runs(tokens, salt, first, cap)
        if runs is None:
            return None
        hit = cap
        for view, (_, chain, h) in zip(self._ranks.values(), runs):
            hit = min(hit, h)
            if view.lower and any(k in view.lower for k in chain.hash_to(chain.pages)[h:]):
                return None  # a store tier took a group past the host hit: fetch it
        return max(first, hit) if runs else first

    def host_runs(
        self, tokens: list[int], salt: str | bytes | None, first: int, cap: int
    ) -> list[tuple[bytes, KeyChain, int]] | None:
        """Per rank: its fingerprint, the prompt's key chain under its seed, and the page h
        its host tier's run from `first` ends at (at most `cap`); None until every rank has
        reported, [] when nothing lies between `first` and `cap`."""
        if len(self._ranks) < self._want:
            return None
        if cap <= first:
            return []
        arr = as_tokens(tokens)
        out = []
        for view in self._ranks.values():
            chain = KeyChain(chain_seed(view.fingerprint, salt), self._page, arr)
            h, step = first, 16
            while h < cap:  # hash only as far as the host tier holds, in doubling steps
                end = min(cap, h + step)
                keys = chain.hash_to(end)
                while h < end and keys[h] in view.host:
                    h += 1
                if h < end:
                    break
                step *= 2
            out.append((view.fingerprint, chain, h))
        return out

    @property
    def ready(self) -> bool:
        """Whether every rank has reported."""
        return len(self._ranks) >= self._want
