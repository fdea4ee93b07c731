"""A model-less engine that replays prompts through a real `HiCache` and checks every load.

The engine owns a page-first uint8 KV pool on the CPU and runs each request the way an engine
embeds hicache: match, allocate, load, check, prefill, store, release, poll. Its "model" writes,
for page i of a prompt, bytes that depend on every token up to the page's end: a BLAKE2b chain
over the pages' tokens, unrelated to hicache's SHA-256 page keys. Before a load the blocks it
fills are overwritten with a poison pattern, so a page that was not copied, or came from another
prefix, shows up as wrong bytes.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from hicache import HiCache, HiCacheConfig, Layout, Match, PagedBuffer

POISON = 0xA5
"""Byte written into blocks before a load: a correct load overwrites all of it."""

PENDING_WAIT_S = 5.0
"""How long the replay asks again while a match is pending (a store tier lookup in flight)."""

SETTLE_WAIT_S = 30.0
"""How long a settling replay waits at most for the store tiers' writes after a request."""


def truth_pages(tokens: np.ndarray, page_tokens: int, page_bytes: int) -> np.ndarray:
    """[full pages, page_bytes] uint8: what the model writes for each full page of `tokens`.

    Page i's bytes are a BLAKE2b chain over pages 0..i (so they name the whole prefix) repeated
    to `page_bytes` (a multiple of 16).
    """
    n = tokens.shape[0] // page_tokens
    if n == 0:
        return np.zeros((0, page_bytes), dtype=np.uint8)
    data = memoryview(np.ascontiguousarray(tokens[: n * page_tokens], dtype="<i4")).cast("B")
    size = page_tokens * 4
    digests, prev = [], b"kv"
    blake = hashlib.blake2b
    for i in range(n):
        prev = blake(data[i * size : (i + 1) * size], digest_size=16, key=prev).digest()
        digests.append(prev)
    rows = np.frombuffer(b"".join(digests), dtype=np.uint8).reshape(n, 16)
    return np.tile(rows, (1, page_bytes // 16))


@dataclass
class Timings:
    """CPU time of the engine thread in the cache's calls over a replay (`time.thread_time_ns`:
    work other threads do meanwhile is not counted), per call (nanoseconds) and in pages."""

    match_ns: list[int] = field(default_factory=list)
    match_pages: list[int] = field(default_factory=list)
    """Full pages of each matched prompt (all of them are hashed and looked up)."""
    store_ns: list[int] = field(default_factory=list)
    store_pages: list[int] = field(default_factory=list)
    """Full pages of each store call (all of them are looked up, the missing ones copied)."""
    load_ns: list[int] = field(default_factory=list)
    load_pages: list[int] = field(default_factory=list)


@dataclass
class Outcome:
    """What one request got: its final match and the tokens it skipped (0 if nothing loaded)."""

    match: Match
    prompt_tokens: int
    hit_tokens: int
    wrong_bytes: int


class ReplayEngine:
    """Embeds a `HiCache` over a CPU pool of `num_blocks` pages of `layout.page_bytes`.

    One request runs at a time, in blocks 0..k-1 of the pool; `num_blocks` must cover the
    longest prompt. `settle`: after each request, wait until the store tiers have no work
    queued or running (their writes done), so that the next request sees them: a replay whose
    outcome does not depend on the machine's speed. Call `close` at the end.
    """

    def __init__(
        self, config: HiCacheConfig, layout: Layout, num_blocks: int, settle: bool = False
    ) -> None:
        if layout.segments:
            raise ValueError("the replay engine uses a page-first pool: give page_bytes")
        if layout.page_bytes % 16:
            raise ValueError(f"page_bytes must be a multiple of 16, got {layout.page_bytes}")
        if layout.state_bytes:
            raise ValueError("the replay engine has no state hooks: use state_bytes 0")
        self.layout = layout
        self.pool = torch.zeros(num_blocks, layout.page_bytes, dtype=torch.uint8)
        self.cache = HiCache(config, PagedBuffer.page_first(self.pool), layout=layout)
        self.cache.wait_ready()
        self.blocks = torch.arange(num_blocks, dtype=torch.int64)
        self.timings = Timings()
        self.wrong_bytes = 0
        self.settle = settle
        self.requests = 0
        self.timeouts = 0
        """Matches still pending after PENDING_WAIT_S; those requests were recomputed."""

    def run(self, tokens: np.ndarray) -> Outcome:
        """One request with prompt `tokens` (int32): match, load, check, prefill, store, release."""
        P, page_bytes = self.layout.page_tokens, self.layout.page_bytes
        n_tokens = tokens.shape[0]
        n_full = n_tokens // P
        n_blocks = -(-n_tokens // P)
        if n_blocks > self.pool.shape[0]:
            raise ValueError(f"a prompt of {n_tokens} tokens needs {n_blocks} blocks")
        rid = f"r{self.requests}"
        self.requests += 1
        cache, t = self.cache, self.timings
        blocks = self.blocks[:n_blocks]

        t0 = time.thread_time_ns()
        m = cache.match(rid, tokens)
        t.match_ns.append(time.thread_time_ns() - t0)
        t.match_pages.append(n_full)
        m = self._settle(rid, tokens, m)
        if m.pending:  # the store tiers too slow to answer: recompute, as an engine would
            self.timeouts += 1

        truth = truth_pages(tokens, P, page_bytes)
        pool = self.pool.numpy()
        wrong = 0
        try:
            if m.load_pages and not m.pending:
                first, end = m.first_page, m.first_page + m.load_pages
                pool[first:end] = POISON
                t0 = time.thread_time_ns()
                cache.load(m, blocks[first:])
                t.load_ns.append(time.thread_time_ns() - t0)
                t.load_pages.append(m.load_pages)
                cache.poll()
                wrong = int(np.count_nonzero(pool[first:end] != truth[first:end]))
            hit_pages = m.hit_tokens // P if m.load_pages and not m.pending else 0
            pool[hit_pages:n_full] = truth[hit_pages:]  # the prefill
            t0 = time.thread_time_ns()
            cache.store(rid, tokens, blocks)
            t.store_ns.append(time.thread_time_ns() - t0)
            t.store_pages.append(n_full)
            cache.poll()
        finally:
            cache.release(rid)
            cache.poll()
            if self.settle:
                self._settle_writes()
        self.wrong_bytes += wrong
        return Outcome(m, n_tokens, hit_pages * P, wrong)

    def _settle(self, rid: str, tokens: np.ndarray, m: Match) -> Match:
        """Ask again while the match is pending (a store tier lookup in flight), up to
        PENDING_WAIT_S."""
        deadline = time.monotonic() + PENDING_WAIT_S
        while m.pending and time.monotonic() < deadline:
            time.sleep(0.0002)
            self.cache.poll()
            m = self.cache.match(rid, tokens)
        return m

    def _settle_writes(self) -> None:
        deadline = time.monotonic() + SETTLE_WAIT_S
        while not self.cache.tiers_idle and time.monotonic() < deadline:
            time.sleep(0.0002)
            self.cache.poll()

    def close(self) -> None:
        self.cache.close()
