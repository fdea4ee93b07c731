"""A Mooncake-format request trace and the prompts it stands for.

A trace is JSON Lines (plain, or gzip-compressed when the name ends in ``.gz``), one request a
line::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 2353]}

Optional fields: `session` (a client's session or cache key) and `stop` (the stop reason of the
request's own answer, e.g. ``tool_use`` or ``end_turn``); both are carried on each request.

`hash_ids` name the prompt's blocks of `block_tokens` (512) tokens, each id standing for the
whole prefix up to the end of its block: equal ids mean equal prefixes. The last block may be
partial. Requests are replayed in timestamp order (ties keep file order); only the order matters.

`prompt_tokens` turns a request into token ids: every id becomes `block_tokens` pseudo-random
token ids that depend on the id alone, and the prompt is cut at `input_length`. `page_ids` names
each full page of a prompt by the trace's own ids (no hashing), for the simulators.
"""

from __future__ import annotations

import gzip
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hicache.tools.trace.simulate import (
    FarthestNextUse,
    OracleSim,
    PolicySim,
    SimResult,
    next_uses,
)

BLOCK_TOKENS = 512
"""Tokens per hash id in the Mooncake traces."""

DEFAULT_FRACTIONS = (0.02, 0.05, 0.1, 0.25, 1.0)
"""Host capacities of `hicache trace --sweep`, as fractions of the trace's distinct pages."""

VOCAB = 128_000
"""Token ids are drawn from [0, VOCAB)."""


@dataclass(frozen=True)
class TraceRequest:
    """One line of a trace."""

    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    session: str = ""
    """The session the request belongs to ("" when the trace does not say)."""
    stop: str = ""
    """The stop reason of this request's answer ("" when the trace does not say)."""


def open_trace(path: str | Path, mode: str = "rt"):  # type: ignore[no-untyped-def]
    """A text stream of a trace file, gzip-compressed when its name ends in ``.gz``."""
    if str(path).endswith(".gz"):
        return gzip.open(path, mode, encoding="utf-8")
    return open(path, mode, encoding="utf-8")


def read_trace(
    path: str | Path, limit: int | None = None, block_tokens: int = BLOCK_TOKENS
) -> list[TraceRequest]:
    """The requests of a trace file in replay order (by timestamp, ties in file order).

    `limit` keeps the first `limit` requests of that order. Raises ValueError naming the line of
    any malformed request: a missing field, a negative length, or hash_ids that do not cover
    input_length in blocks of `block_tokens` tokens.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    out: list[TraceRequest] = []
    try:
        with open_trace(path) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                out.append(_parse(line, f"{path}:{lineno}", block_tokens))
    except (gzip.BadGzipFile, EOFError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not a readable trace ({err})") from None
    out.sort(key=lambda r: r.timestamp)  # stable: ties keep file order
    return out if limit is None else out[:limit]


def _parse(line: str, where: str, block_tokens: int) -> TraceRequest:
    try:
        obj = json.loads(line)
        req = TraceRequest(
            timestamp=float(obj["timestamp"]),
            input_length=int(obj["input_length"]),
            output_length=int(obj.get("output_length", 0)),
            hash_ids=tuple(int(h) for h in obj["hash_ids"]),
            session=str(obj.get("session") or ""),
            stop=str(obj.get("stop") or ""),
        )
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{where}: not a trace request ({type(err).__name__}: {err})") from None
    if req.input_length <= 0:
        raise ValueError(f"{where}: input_length must be positive, got {req.input_length}")
    blocks = -(-req.input_length // block_tokens)
    if len(req.hash_ids) != blocks:
        raise ValueError(
            f"{where}: input_length {req.input_length} needs {blocks} hash ids of "
            f"{block_tokens} tokens, got {len(req.hash_ids)}"
        )
    if any(h < 0 for h in req.hash_ids):
        raise ValueError(f"{where}: hash ids must be >= 0")
    top = max_hash_id(block_tokens)
    if any(h > top for h in req.hash_ids):
        raise ValueError(f"{where}: hash id {max(req.hash_ids)} is too large (at most {top})")
    return req


def max_hash_id(block_tokens: int = BLOCK_TOKENS) -> int:
    """The largest hash id a trace may use: `page_ids` must fit in a signed 64-bit integer."""
    return (2**63 - 1 - block_tokens) // (block_tokens + 1)


_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def block_tokens_of(hash_ids: np.ndarray, block_tokens: int = BLOCK_TOKENS) -> np.ndarray:
    """[len(hash_ids), block_tokens] int32 token ids: a fixed function of (id, position)."""
    ids = np.asarray(hash_ids, dtype=np.uint64)[:, None]
    pos = np.arange(block_tokens, dtype=np.uint64)[None, :]
    x = ids * np.uint64(block_tokens) + pos + _GOLDEN  # splitmix64 of (id, position)
    x = (x ^ (x >> np.uint64(30))) * _MIX1
    x = (x ^ (x >> np.uint64(27))) * _MIX2
    x = x ^ (x >> np.uint64(31))
    return (x % np.uint64(VOCAB)).astype(np.int32)


def prompt_tokens(req: TraceRequest, block_tokens: int = BLOCK_TOKENS) -> np.ndarray:
    """The request's prompt as int32 token ids, `input_length` long."""
    ids = np.asarray(req.hash_ids, dtype=np.uint64)
    return block_tokens_of(ids, block_tokens).reshape(-1)[: req.input_length]


def page_ids(req: TraceRequest, page_tokens: int, block_tokens: int = BLOCK_TOKENS) -> list[int]:
    """One integer per full page of the prompt that names the page's whole prefix.

    Page i ends at token e = (i + 1) * page_tokens, inside block b = (e - 1) // block_tokens.
    Block b's hash id names the prefix up to the block's end, so (hash id of b, e - b *
    block_tokens) names the prefix up to e: two pages get the same id exactly when their
    prefixes are equal. Works for any page_tokens, shorter or longer than a block.
    """
    n = req.input_length // page_tokens
    if n == 0:
        return []
    ends = np.arange(1, n + 1, dtype=np.int64) * page_tokens
    blocks = (ends - 1) // block_tokens
    offsets = ends - blocks * block_tokens  # 1 .. block_tokens
    ids = np.asarray(req.hash_ids, dtype=np.int64)[blocks]
    return (ids * (block_tokens + 1) + offsets).tolist()


def flat_page_ids(
    requests: list[TraceRequest], page_tokens: int, block_tokens: int = BLOCK_TOKENS
) -> tuple[np.ndarray, np.ndarray]:
    """`page_ids` of every request at once: (ids, starts), int64 arrays where request r's page
    ids are ``ids[starts[r]:starts[r + 1]]`` (the same numbers as `page_ids`)."""
    lengths = np.fromiter((r.input_length for r in requests), np.int64, len(requests))
    n_ids = np.fromiter((len(r.hash_ids) for r in requests), np.int64, len(requests))
    hashes = np.fromiter((h for r in requests for h in r.hash_ids), np.int64, int(n_ids.sum()))
    hash_start = np.zeros(len(requests), np.int64)
    np.cumsum(n_ids[:-1], out=hash_start[1:])
    n_pages = lengths // page_tokens
    starts = np.zeros(len(requests) + 1, np.int64)
    np.cumsum(n_pages, out=starts[1:])
    owner = np.repeat(np.arange(len(requests)), n_pages)
    ends = (np.arange(starts[-1], dtype=np.int64) - starts[owner] + 1) * page_tokens
    blocks = (ends - 1) // block_tokens
    ids = hashes[hash_start[owner] + blocks] * (block_tokens + 1) + (ends - blocks * block_tokens)
    return ids, starts


@dataclass
class Workload:
    """A trace prepared once: its requests and the page ids of every prompt.

    `ids`/`starts` hold every prompt's page ids in one array (request r's are
    ``ids[starts[r]:starts[r + 1]]``); `dense` numbers the distinct pages 0, 1, ... in the
    order of their ids (what the compiled simulations take); `pages` is the same as lists."""

    requests: list[TraceRequest]
    page_tokens: int
    block_tokens: int = BLOCK_TOKENS
    ids: np.ndarray = field(init=False, repr=False)
    starts: np.ndarray = field(init=False, repr=False)
    tokens: np.ndarray = field(init=False, repr=False)
    """Prompt tokens of each request (int64)."""
    _dense: tuple[np.ndarray, int] | None = field(default=None, init=False, repr=False)
    _pages: list[list[int]] | None = field(default=None, init=False, repr=False)
    _next_uses: list | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.ids, self.starts = flat_page_ids(self.requests, self.page_tokens, self.block_tokens)
        self.tokens = np.fromiter((r.input_length for r in self.requests), np.int64)

    @property
    def pages(self) -> list[list[int]]:
        """Each prompt's page ids as a list (built on first use)."""
        if self._pages is None:
            flat, s = self.ids.tolist(), self.starts.tolist()
            self._pages = [flat[a:b] for a, b in itertools.pairwise(s)]
        return self._pages

    @property
    def dense(self) -> tuple[np.ndarray, int]:
        """(int32 dense page numbers parallel to `ids`, how many distinct pages)."""
        if self._dense is None:
            uniq, inverse = np.unique(self.ids, return_inverse=True)
            self._dense = (inverse.astype(np.int32), len(uniq))
        return self._dense

    @property
    def prompt_tokens(self) -> int:
        return int(self.tokens.sum())

    @property
    def unique_pages(self) -> int:
        return self.dense[1]

    @property
    def visits(self) -> int:
        """Page visits over the trace: every full page of every prompt."""
        return int(self.starts[-1])

    @property
    def max_blocks(self) -> int:
        return max((-(-r.input_length // self.page_tokens) for r in self.requests), default=1)

    def simulate(self, sim: PolicySim | OracleSim) -> SimResult:
        for req, ids in zip(self.requests, self.pages):
            sim.request(ids, req.input_length)
        return sim.result

    def offline(self, capacity: int, min_recompute_tokens: int = 1) -> SimResult:
        """The offline reference (farthest next use first) at `capacity` pages."""
        if self._next_uses is None:
            self._next_uses = next_uses(self.pages)
        policy = FarthestNextUse(capacity)
        sim = PolicySim(capacity, self.page_tokens, min_recompute_tokens, policy)
        for req, ids, upcoming in zip(self.requests, self.pages, self._next_uses):
            policy.upcoming = upcoming
            sim.request(ids, req.input_length)
        return sim.result
