"""Which objects of a store tier a fetch asks for (`Span`): the geometry that the tier chain,
the vLLM scheduler's probe and the trace simulations share.

A store tier holds a sequence's pages in objects of `G` pages (page groups), each named by its
last page's key, so that the name fixes every page before it. The pages past a sequence's last
whole group go in one shorter object, its *tail* (``sequence pages % G`` pages, named the same
way): a request that ends where the stored one ended (the same prompt again, on another
instance) finds all of its pages, not only its whole groups.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    """Objects `[0, objects)` of a fetch: `groups` whole groups from group `first`, then a tail
    object of `tail` pages where `tail` > 0."""

    first: int
    groups: int
    tail: int
    G: int

    @classmethod
    def of(cls, held: int, cap: int, pages: int, G: int, tails: bool = True) -> Span:
        """The objects past a hit of `held` pages of a sequence of `pages` pages, for a hit
        capped at `cap` pages: every whole group from the one holding page `held` that starts
        below the cap (the last may be used for part of its pages), then, where `tails` and the
        cap reaches into the sequence's last partial group, that group's tail."""
        first, last = held // G, min(-(-cap // G), pages // G)
        last = max(first, last)
        tail = pages % G if tails and last == pages // G and cap > last * G else 0
        return cls(first, last - first, tail, G)

    @property
    def objects(self) -> int:
        return self.groups + (self.tail > 0)

    @property
    def first_page(self) -> int:
        return self.first * self.G

    def pages_of(self, run: int) -> int:
        """The pages of the first `run` objects."""
        return min(run, self.groups) * self.G + (self.tail if run > self.groups else 0)

    def ends(self) -> list[int]:
        """The index of each object's last page (which names it), in order."""
        G, first = self.G, self.first_page
        out = [first + (g + 1) * G - 1 for g in range(self.groups)]
        if self.tail:
            out.append(first + self.groups * G + self.tail - 1)
        return out
