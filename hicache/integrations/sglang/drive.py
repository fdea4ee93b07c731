"""A driver of the three calls SGLang's cache controller makes to a storage backend, in a
random interleaving of a seed's choosing, checked byte for byte. For tests and the simulation;
imports no SGLang.

SGLang's controller puts a radix node's host pages (`batch_set_v1`, its backup thread), asks
how many leading pages of a prompt's continuation the backend holds (`batch_exists`, its
prefetch thread) and gets that many into fresh host pages (`batch_get_v1`, its prefetch I/O
thread), in batches of at most `STORAGE_BATCH` pages. `Drive` makes the same calls, in one
thread, on prompts that share prefixes, with a `faults` hook between calls, and checks what
the backend answers:

- never a hit it cannot have: `batch_exists` and `batch_get_v1` claim no page never put;
- never a wrong byte: every page `batch_get_v1` reports arrived holds exactly the bytes put
  under its key (each page's bytes are drawn from its key, so a misplaced page shows);
- never a stuck call: each call returns within `call_limit_s`;
- where `faults` is None and nothing was evicted, every page put is found and arrives.

`PlainPool` is a host pool with SGLang's page methods over one plain tensor, for backends
driven without SGLang (`hicache.integrations.sglang.tiers.StoreTiers` through `EnginePages`).
"""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

STORAGE_BATCH = 128
"""Pages a batch at most (SGLang's ``STORAGE_BATCH_SIZE``)."""


class PlainPool:
    """SGLang's host pool methods that the driver and `EnginePages` use, over one tensor of
    `pages` pages of `page_bytes` bytes (``page_first``: a page is one row)."""

    layout = "page_first"
    dtype = torch.uint8

    def __init__(self, pages: int, page_size: int, page_bytes: int) -> None:
        self.page_size = page_size
        self.size = pages * page_size
        self.kv_buffer = torch.zeros(self.size, page_bytes // page_size, dtype=torch.uint8)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self.kv_buffer[index : index + self.page_size]
        return page.flatten() if flat else page

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        """SGLang's address API: each page's one run (address, bytes)."""
        row = self.kv_buffer.stride(0) * self.page_size  # uint8: bytes
        pages = [i // self.page_size for i in indices.tolist()[:: self.page_size]]
        return [self.kv_buffer.data_ptr() + p * row for p in pages], [row] * len(pages)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.kv_buffer[index : index + self.page_size] = data_page.view(self.page_size, -1)


@dataclass
class Tally:
    """What a drive did and saw."""

    puts: int = 0
    exists: int = 0
    gets: int = 0
    pages_put: int = 0
    """Pages the backend said it stored."""
    pages_found: int = 0
    pages_got: int = 0
    """Pages that arrived (each checked byte for byte)."""
    slowest_s: float = 0.0
    problems: list[str] = field(default_factory=list)


class Drive:
    """Random calls `put(keys, host_indices)`, `exists(keys)` and `get(keys, host_indices)` (a
    backend's ``batch_set_v1``, ``batch_exists``, ``batch_get_v1``) on `pool`, whose host pages
    the drive owns. `faults(rng)` runs before each call (None: no faults, and then every page
    put must be found and arrive: give the backend room for them all)."""

    def __init__(
        self,
        put: Callable[[list[str], torch.Tensor], Sequence[bool]],
        exists: Callable[[list[str]], int],
        get: Callable[[list[str], torch.Tensor], Sequence[bool]],
        pool: Any,
        seed: int,
        faults: Callable[[random.Random], None] | None = None,
        prompts: int = 6,
        call_limit_s: float = 60.0,
    ) -> None:
        self._put, self._exists, self._get = put, exists, get
        self.pool = pool
        self.rng = random.Random(seed)
        self.faults = faults
        self.call_limit_s = call_limit_s
        P = pool.page_size
        self.P = P
        self.page_bytes = pool.get_data_page(0).view(torch.uint8).numel()
        self.free = list(range(pool.size // P))
        self.prompts = self._prompts(prompts, seed)
        self.tried: set[str] = set()  # keys ever put (a put that failed may have stored)
        self.stored: set[str] = set()  # keys the backend said it stored
        self.tally = Tally()

    def _prompts(self, n: int, seed: int) -> list[list[str]]:
        """`n` chains of page keys that share prefixes (a tree of prompts), as SGLang names
        pages: hex digests, each chained over the one before."""
        rng = random.Random(seed * 7919 + 1)
        chains: list[list[str]] = []
        for i in range(n):
            head = chains[rng.randrange(len(chains))][: rng.randrange(1, 6)] if chains else []
            chain = list(head)
            for j in range(rng.randrange(4, 3 * STORAGE_BATCH // 2)):
                prev = bytes.fromhex(chain[-1]) if chain else b"seed%d" % seed
                chain.append(hashlib.sha256(prev + b"%d/%d" % (i, j)).hexdigest())
            chains.append(chain)
        return chains

    def content(self, key: str) -> np.ndarray:
        """The bytes of the page named `key`."""
        seed = int.from_bytes(bytes.fromhex(key)[:8], "little")
        return np.random.default_rng(seed).integers(0, 256, self.page_bytes, dtype=np.uint8)

    def run(self, steps: int) -> Tally:
        for _ in range(steps):
            if self.faults is not None:
                self.faults(self.rng)
            op = self.rng.choice((self.put, self.put, self.exists, self.get, self.get))
            op()
        return self.tally

    # -- the three calls ------------------------------------------------------------------------

    def _span(self) -> list[str]:
        """A batch of a prompt's keys, as SGLang asks for them: from a page on, at most
        `STORAGE_BATCH`."""
        chain = self.rng.choice(self.prompts)
        start = self.rng.randrange(len(chain))
        return chain[start : start + self.rng.randrange(1, STORAGE_BATCH + 1)]

    def _pages(self, n: int) -> tuple[list[int], torch.Tensor]:
        pages = self.rng.sample(self.free, min(n, len(self.free)))
        slots = torch.tensor([p * self.P + t for p in pages for t in range(self.P)])
        return pages, slots

    def put(self) -> None:
        keys = self._span()
        pages, slots = self._pages(len(keys))
        keys = keys[: len(pages)]
        for key, page in zip(keys, pages):
            data = torch.from_numpy(self.content(key))
            self.pool.set_from_flat_data_page(page * self.P, data.view(self.pool.dtype))
        self.tried.update(keys)
        ok = self._timed(lambda: self._put(keys, slots))
        self.tally.puts += 1
        for key, done in zip(keys, ok):
            if done:
                self.stored.add(key)
                self.tally.pages_put += 1

    def exists(self) -> None:
        keys = self._span()
        n = self._timed(lambda: self._exists(keys))
        self.tally.exists += 1
        self.tally.pages_found += n
        self._claims("exists", keys[:n])
        if self.faults is None and n != self._leading_stored(keys):
            self._problem(f"exists found {n} of {self._leading_stored(keys)} stored pages")

    def get(self) -> None:
        keys = self._span()
        pages, slots = self._pages(len(keys))
        keys = keys[: len(pages)]
        stale = torch.full((self.page_bytes,), 0xA5, dtype=torch.uint8).view(self.pool.dtype)
        for page in pages:  # what a page holds before: never to pass for a hit
            self.pool.set_from_flat_data_page(page * self.P, stale)
        ok = list(self._timed(lambda: self._get(keys, slots)))
        self.tally.gets += 1
        arrived = ok.index(False) if False in ok else len(ok)
        self._claims("get", keys[:arrived])
        for key, page in zip(keys[:arrived], pages):
            got = self.pool.get_data_page(page * self.P).view(torch.uint8).numpy()
            if not np.array_equal(got, self.content(key)):
                self._problem(f"get: page {key[:12]} arrived with other bytes")
        self.tally.pages_got += arrived
        if self.faults is None and arrived != self._leading_stored(keys):
            self._problem(f"get brought {arrived} of {self._leading_stored(keys)} stored pages")

    # -- checks ---------------------------------------------------------------------------------

    def _timed(self, call: Callable[[], Any]) -> Any:
        start = time.monotonic()
        out = call()
        took = time.monotonic() - start
        self.tally.slowest_s = max(self.tally.slowest_s, took)
        if took > self.call_limit_s:
            self._problem(f"a call took {took:.1f} s")
        return out

    def _claims(self, what: str, keys: list[str]) -> None:
        never = [k for k in keys if k not in self.tried]
        if never:
            self._problem(f"{what} claimed {len(never)} pages never put")

    def _leading_stored(self, keys: list[str]) -> int:
        n = 0
        for key in keys:
            if key not in self.stored:
                break
            n += 1
        return n

    def _problem(self, line: str) -> None:
        self.tally.problems.append(line)
