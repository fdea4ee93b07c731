"""The engine's GPU prefix cache: full pages of finished sequences kept in its own block pool.

As in vLLM and SGLang, a page that a finished request computed stays in its block after the
request ends, found by its tokens (and everything before them): a later request whose prompt
starts with the same pages takes those blocks into its block table instead of recomputing them.
Pages are immutable once full, so blocks are shared by reference; a block in use by a running
request is pinned, the others are evicted least recently used first (a sequence's tail before its
head, so that what survives is still a prefix) when the pool needs blocks or the cache is at its
size.

A page is keyed by its tokens and its parent page (a trie), so a hit is exact. Models with
sliding-window layers keep no GPU prefix cache: a hit there would also need the rings' state at
the page boundary, which the engine does not keep.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(eq=False)
class _Page:
    key: tuple
    block: int
    parent: _Page | None
    refs: int = 0
    children: int = 0


@dataclass
class PrefixHit:
    """The cached pages a request uses, pinned until `PrefixCache.finish`."""

    pages: list[_Page] = field(default_factory=list)

    @property
    def blocks(self) -> list[int]:
        return [p.block for p in self.pages]


class PrefixCache:
    """At most `max_blocks` blocks of the pool kept for prefix hits, LRU."""

    def __init__(self, page_tokens: int, max_blocks: int) -> None:
        if page_tokens < 1 or max_blocks < 0:
            raise ValueError("page_tokens must be positive and max_blocks not negative")
        self.page_tokens = page_tokens
        self.max_blocks = max_blocks
        self._pages: OrderedDict[tuple, _Page] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._pages)

    def lookup(self, tokens: Sequence[int], salt: str | None = None) -> PrefixHit:
        """The longest run of cached leading pages of `tokens` that leaves at least one token to
        compute; its pages are pinned (they are not evicted) until `finish`."""
        P = self.page_tokens
        hit = PrefixHit()
        parent: _Page | None = None
        for i in range((len(tokens) - 1) // P):
            page = self._pages.get(self._key(parent, tokens, i, salt))
            if page is None:
                break
            page.refs += 1
            hit.pages.append(page)
            parent = page
        for page in reversed(hit.pages):  # the head is used last: evicted after the tail
            self._pages.move_to_end(page.key)
        return hit

    def unpin(self, hit: PrefixHit) -> None:
        """Give back the pins of a hit that was not used (the request did not start)."""
        for page in hit.pages:
            page.refs -= 1
        hit.pages = []

    def finish(
        self, tokens: Sequence[int], blocks: Sequence[int], hit: PrefixHit, salt: str | None = None
    ) -> list[int]:
        """A request ends: `blocks[i]` holds page i of `tokens` (its KV). Its full pages are kept
        (or found kept already), its hit's pins are given back; returns the blocks to free."""
        P = self.page_tokens
        n_full = min(len(tokens) // P, len(blocks))
        kept: set[int] = set()
        evicted: list[int] = []
        parent: _Page | None = None
        touched: list[_Page] = []
        for i in range(n_full):
            key = self._key(parent, tokens, i, salt)
            page = self._pages.get(key)
            if page is None:
                if not self._make_room(evicted, spare=parent):
                    break
                page = _Page(key, blocks[i], parent)
                self._pages[key] = page
                if parent is not None:
                    parent.children += 1
            if page.block == blocks[i]:
                kept.add(blocks[i])
            touched.append(page)
            parent = page
        self.unpin(hit)
        for page in reversed(touched):
            self._pages.move_to_end(page.key)
        return [b for b in blocks if b not in kept] + evicted

    def evict(self, n: int) -> list[int]:
        """Up to `n` unpinned blocks taken back from the cache (for the pool), LRU first."""
        out: list[int] = []
        while len(out) < n:
            page = self._victim()
            if page is None:
                break
            out.append(self._drop(page))
        return out

    # -- internals --------------------------------------------------------------------------

    def _key(self, parent: _Page | None, tokens: Sequence[int], i: int, salt: str | None) -> tuple:
        P = self.page_tokens
        return (id(parent) if parent is not None else salt, tuple(tokens[i * P : (i + 1) * P]))

    def _make_room(self, evicted: list[int], spare: _Page | None) -> bool:
        """Evict until one more page fits (never `spare`, the parent of the page to come)."""
        while len(self._pages) >= self.max_blocks:
            page = self._victim(spare)
            if page is None:
                return False
            evicted.append(self._drop(page))
        return True

    def _victim(self, spare: _Page | None = None) -> _Page | None:
        for page in self._pages.values():
            if page.refs == 0 and page.children == 0 and page is not spare:
                return page
        return None

    def _drop(self, page: _Page) -> int:
        del self._pages[page.key]
        if page.parent is not None:
            page.parent.children -= 1
        return page.block
