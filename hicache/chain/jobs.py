"""What a store tier's worker does with a job: the part of a fetch or a put that needs no books.

The engine thread decides (`hicache.chain.link.StoreLink`: which groups, which slots, which
pins) and hands a `Job` over; a worker finishes it from what the job carries: it hashes the
pages the engine thread left, names the objects, finds their bytes in the host pools, and makes
the one store call. It reads the pools' memory, never their slot books or the job's leases, so
it can run on any thread; `StoreLink` runs it on its worker threads.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol

import numpy as np
import torch

from hicache.backends import codec as codecs
from hicache.backends.base import Buffers, StoreTier
from hicache.backends.crypt import KEY_MISS, Keyring, TenantKey
from hicache.backends.envelope import (
    CORRUPT,
    HEADER,
    RAW,
    Envelopes,
    contiguous,
    seed,
    signed,
)
from hicache.core.checksum import checksum
from hicache.core.keys import page_keys, store_key
from hicache.core.marks import active, mark
from hicache.core.slots import Lease
from hicache.errors import HiCacheError
from hicache.kernels import PagedBuffer
from hicache.kernels.completions import DONE, Completion

_NO_BUFFERS = Buffers([], [])  # a probe's (read by nobody)
STAGED_OBJECTS = 8
"""Objects a put of a tier with a codec encodes at a time (its staging memory holds them)."""
READ_CHUNK_BYTES = 64 << 20
"""A get of a tier with a codec and codec threads (`codec_threads` > 1) reads its objects in
calls of about this many bytes (of their buffers; at least one object each), one call after
another; each call's objects decode on the codec threads while the next call reads. With one
codec thread a get is one call, decoded on the worker thread after it."""

log = logging.getLogger("hicache.chain")


class Slots(Protocol):
    capacity: int


class SlotMemory(Protocol):
    """The memory a `JobRunner` finds its objects' bytes in: page slot ``i`` is page ``i`` of
    `pages` (read once the memory exists, at the first job), state slot ``i`` is `state(i)`;
    `page_slots.capacity` and `state_slots.capacity` count them. `HostTier` is one; an engine's
    own host pool is another (`hicache.integrations.sglang`)."""

    @property
    def pages(self) -> PagedBuffer: ...

    def state(self, slot: int) -> torch.Tensor: ...

    @property
    def page_slots(self) -> Slots: ...

    @property
    def state_slots(self) -> Slots: ...


@dataclass
class Job:
    """One call for a worker. The engine thread fills in keys and slots; the worker names the
    objects and finds their bytes (`names`, `buffers`), so that the engine thread does not."""

    kind: str  # "probe" | "get" | "put"
    ends: list[bytes] = field(default_factory=list)
    """Keys of the page groups' last pages (a group is named by it), in order."""
    state_ends: list[bytes] = field(default_factory=list)
    """Keys of the pages whose boundary states the call moves, after the groups."""
    page_slots: list[int] = field(default_factory=list)
    """Host slots of the groups' pages, `G` per group (gets and puts)."""
    state_slots: list[int] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    """Object names (groups, then states), made by the worker."""
    buffers: Buffers = _NO_BUFFERS
    """Where the objects lie in the host pools, found by the worker for a get or a put."""
    fetch: Any = None
    """For a probe or a get: the engine thread's `hicache.chain.fetch.Fetch` (the worker never
    reads it)."""
    leases: tuple[Lease, ...] = ()
    """For a put: the pins on its page (and state) slots, held until its call has returned
    (released by the engine thread)."""
    groups: int = 0
    """For a get: how many page objects it reads (a state, if any, comes after them)."""
    tail: int = 0
    """Pages of its last page object where that is a tail, shorter than a group
    (`hicache.core.span`); 0: every page object is a whole group."""
    unprobed: bool = False
    """A get asked without an exists: a missing group ends the hit and is no failure."""
    ready: Completion = DONE
    """For a put: a fence made when it was queued (every copy into its slots is before it);
    the worker waits for it before reading."""
    hash_from: tuple[bytes, np.ndarray] | None = None
    """For a fetch's first job, when it has pages past `ENGINE_PREP_PAGES`: the key before them
    and their tokens (int32; a view of the request's `KeyChain.tokens`, never changed in
    place), for the worker to hash."""
    page_keys: list[bytes] = field(default_factory=list)
    """For a fetch's first job: the keys of its pages (those after `hash_from` added by the
    worker)."""
    corrupt: int = 0
    """For a get: objects that arrived and did not verify (`hicache.backends.envelope`)."""
    seed: bytes = b""
    """The chain seed of the request (the namespace, `hicache.core.keys.chain_seed`) whose
    objects it moves: it picks the tenant's key, if any (`hicache.backends.crypt`). b"": no
    tenant's (stored plain)."""
    key_misses: int = 0
    """For a get: objects that arrived and did not open under the tenant's key (or were
    encrypted where no key is here)."""
    started: float = 0.0
    finished: float = 0.0
    worker: int = 0
    """For a fetch job: the fetch worker it was queued for."""


class JobRunner:
    """Runs jobs against `store`, naming objects under `key_prefix` and `fingerprint` in groups
    of `group_pages` pages (see `hicache.core.keys.store_key`). Holds no state a job changes: one
    `JobRunner` serves every worker thread."""

    def __init__(
        self,
        store: StoreTier,
        host: SlotMemory,
        key_prefix: str,
        fingerprint: bytes,
        group_pages: int,
        page_tokens: int,
        states: bool,
        codec: codecs.Codec | None = None,
        codec_threads: int = 1,
        read_chunk_bytes: int = READ_CHUNK_BYTES,
        keyring: Keyring | None = None,
        owners: Mapping[bytes, str] | None = None,
    ) -> None:
        self.store = store
        self.host = host
        self.G = group_pages
        self.page_tokens = page_tokens
        self.states = states
        """Whether the layout has states (a probe then asks for the state at each group end)."""
        self.key_prefix = key_prefix
        self.owners: Mapping[bytes, str] = owners or {}
        """The tenant each chain seed's objects are named under (`hicache.core.shares.owners`;
        a seed not here: no tenant's)."""
        self._names = self._prefixes(fingerprint)
        """The names' prefixes by tenant: of an object of `g` pages, ``_names[t][0][g]``; of a
        state, ``_names[t][1]`` (one dict, replaced whole by `rename`)."""
        self.envelopes = Envelopes(host.page_slots.capacity, host.state_slots.capacity)
        """The objects' headers (registered with the store beside the host pools)."""
        self.codec = codec
        """Encodes what a put writes (None: objects are stored raw)."""
        self.decoder = codec
        """Decodes what a get reads: any tier that reads objects shorter than their buffers
        decodes encoded objects where zstandard is here, whatever it writes."""
        if codec is None and store.reads_prefix and codecs.problem() is None:
            self.decoder = codecs.Codec(codecs.ZSTD)
        self._pool = (
            ThreadPoolExecutor(codec_threads, thread_name_prefix="hicache-codec")
            if self.decoder is not None and codec_threads > 1
            else None
        )
        self.read_chunk_bytes = read_chunk_bytes
        """With a codec: the bytes a get reads per call (`READ_CHUNK_BYTES`)."""
        self._staging: torch.Tensor | None = None
        self.keyring = keyring if keyring else None
        """The encrypted tenants' keys (None: every object is stored plain)."""

    def memory(self) -> list[torch.Tensor]:
        """What the store registers beside the host pools: the headers and, with a codec, the
        staging memory that a put encodes (or encrypts) into (made now: the host pools exist by
        then)."""
        if self.codec is None and self.keyring is None:
            return [self.envelopes.memory]
        state = self.host.state(0).numel() if self.states else 0
        page = self.host.pages.page_bytes
        # room for a cipher's update_into past the object (it asks for 15 bytes more)
        slack = 16 if self.keyring is not None else 0
        slot = -(-(max(self.G * page, state) + slack) // codecs.ALIGN) * codecs.ALIGN
        raw = torch.empty(STAGED_OBJECTS * slot + codecs.ALIGN, dtype=torch.uint8)
        skip = -raw.data_ptr() % codecs.ALIGN  # aligned, so that the disk tier can use O_DIRECT
        self._staging = raw[skip : skip + STAGED_OBJECTS * slot].view(STAGED_OBJECTS, slot)
        return [self.envelopes.memory, raw]

    def close(self) -> None:
        """Stop the codec threads (after the jobs have ended)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def _map(self, fn: Callable[..., Any], *args: Iterable[Any]) -> list[Any]:
        """`fn` over the objects' arguments, on the codec threads where there are any."""
        if self._pool is None:
            return list(map(fn, *args))
        return list(self._pool.map(fn, *args))

    def run(self, job: Job) -> list[bool] | list[int]:
        """Finish `job` and make its call: `exists` answers (a bool per object), a get's or a
        put's codes (per object, negative on failure), as plain lists of one entry per object.
        A put waits for its host copy (`job.ready`) first and writes each object's header; a
        get checks them, and its codes count the payload's bytes (`CORRUPT` for an object that
        did not verify, counted in `job.corrupt`). Raises what the store raises, and
        `BadResult` for an answer of the wrong length or type (a failed call)."""
        if job.hash_from is not None:
            self._hash(job)
        if job.page_keys and not job.ends:  # a fetch's first job: name its groups
            self._name_groups(job)
        self._place(job)
        if job.kind == "probe":
            return [c != 0 for c in _answer(self.store.exists(job.names), job)]
        if job.kind == "get":
            mark("store.get")
            if self.codec is not None and self._pool is not None:
                checked = self._get_overlapped(job, self._pool)
            else:
                checked = self._check(
                    job, _answer(self.store.get_into(job.names, job.buffers), job)
                )
            self._discard(job.names, checked)
            return checked
        # an object the store holds already is not sent again: it answers 0
        job.ready.wait()  # the host copy of the pages (a CUDA event; released GIL)
        seal, buffers = self.envelopes.seal, job.buffers
        key = self._key(job)
        if self.codec is not None or key is not None:
            return _answer(self._put_encoded(job.names, buffers, key), job)
        for name, ptrs, sizes in zip(job.names, buffers.ptrs, buffers.sizes):
            seal(name, ptrs, sizes)
        return _answer(self.store.put_from(job.names, buffers), job)

    def _discard(self, names: list[str], codes: list[int]) -> None:
        """Have the store remove the objects a get found unreadable (`CORRUPT`, `KEY_MISS`), so
        that the request's recomputed pages are stored again under their names; a failure to
        remove is logged and changes nothing else (the get's codes stand)."""
        bad = [n for n, c in zip(names, codes) if c in (CORRUPT, KEY_MISS)]
        if not bad:
            return
        mark("store.discard-unreadable")
        try:
            self.store.discard(bad)
        except Exception as err:  # whatever the store raises: the objects stay, misses
            log.warning("hicache: discarding %d unreadable objects failed: %r", len(bad), err)

    def _key(self, job: Job) -> TenantKey | None:
        """The key of the tenant whose objects `job` moves (None: they are stored plain)."""
        return None if self.keyring is None else self.keyring.key_for(job.seed)

    def _put_encoded(
        self, names: list[str], buffers: Buffers, key: TenantKey | None = None
    ) -> list[int]:
        """Put the objects encoded (with the codec, if any, then encrypted with `key`, if any),
        `STAGED_OBJECTS` at a time (a call each)."""
        codes: list[int] = []
        for at in range(0, len(names), STAGED_OBJECTS):
            part = slice(at, at + STAGED_OBJECTS)
            args = [names[part], buffers.ptrs[part], buffers.sizes[part], range(STAGED_OBJECTS)]
            if key is not None:  # (a plain object's encode takes no key: four arguments)
                args.append([key] * len(names[part]))
            pieces = self._map(self._encode, *args)
            ptrs, sizes = [p for p, _ in pieces], [s for _, s in pieces]
            codes += self.store.put_from(names[part], Buffers(ptrs, sizes))
        return codes

    def _encode(
        self, name: str, ptrs: list[int], sizes: list[int], k: int, key: TenantKey | None = None
    ) -> tuple[list[int], list[int]]:
        """Encode object `name` (header first, then its raw pieces) into staging slot `k` (with
        the codec, if any, then encrypted with `key`, if any); write its header; the pieces to
        put (its own where it is neither encrypted nor shrunk)."""
        codec, staging = self.codec, self._staging
        if staging is None:  # memory() made it before the first put
            raise RuntimeError("a put before the staging memory was registered")
        raw = sum(sizes) - HEADER
        value = checksum(ptrs[1:], sizes[1:], seed(name))
        row = staging[k].numpy()
        kind, flags, stored = 0, 0, raw  # codecs.NONE: as it is
        src: np.ndarray | None = None  # the payload to encrypt
        if codec is not None:
            if raw % 2:
                mark("codec.odd-size")
            plain = contiguous(ptrs[1:], sizes[1:], raw)
            # encrypted: encoded into a scratch first (the cipher writes the staging row)
            out = codec.scratch(raw, "coded") if key is not None else row[:raw]
            encoded = codec.encode(plain, out)
            kind = codec.kind(raw) if encoded is not None else codec.ident
            flags, stored = (0, encoded) if encoded is not None else (RAW, raw)
            src = out[:encoded] if encoded is not None else plain
            if key is None:
                if encoded is None:
                    self.envelopes.write(ptrs[0], kind, flags, raw, raw, value)
                    return ptrs, sizes
                self.envelopes.write(ptrs[0], kind, flags, raw, stored, value)
                return [ptrs[0], row.ctypes.data], [HEADER, stored]
        if key is None:  # neither codec nor key: _put_encoded is not called
            raise RuntimeError("an object to stage without a codec or a key")
        if src is None:
            src = contiguous(ptrs[1:], sizes[1:], raw)
        aad = signed(name, kind, flags, raw, stored, value, key.id)
        nonce, tag = key.seal(src, row[: stored + 15], aad)
        self.envelopes.write(ptrs[0], kind, flags, raw, stored, value, (key.id, nonce, tag))
        mark("crypt.sealed")
        return [ptrs[0], row.ctypes.data], [HEADER, stored]

    def _check(self, job: Job, codes: list[int]) -> list[int]:
        """A get's codes with each object's header checked (the store's own codes beyond the
        job's objects, if it gave more, are left for the engine thread to judge)."""
        n = min(len(codes), len(job.names))
        buffers = job.buffers
        checked = self._map(
            self._check_one, job.names[:n], buffers.ptrs[:n], buffers.sizes[:n], codes[:n],
            [self._key(job)] * n,
        )  # fmt: skip
        job.corrupt += checked.count(CORRUPT)
        job.key_misses += checked.count(KEY_MISS)
        return checked + list(codes[n:])

    def _get_overlapped(self, job: Job, pool: ThreadPoolExecutor) -> list[int]:
        """A get of a tier with a codec: its objects read in calls of about `read_chunk_bytes`,
        one after another, each object checked (and decoded) on the codec threads as soon as
        its call has returned, while the next call reads. Codes as `_check`'s. Where a call
        raises, the checks already started finish before it is raised (they write into the
        job's slots, which the engine thread frees after a failed get)."""
        names, buffers, key = job.names, job.buffers, self._key(job)
        checks: list[Future[int]] = []
        try:
            for part in _chunks(buffers.sizes, self.read_chunk_bytes):
                ptrs, sizes = buffers.ptrs[part], buffers.sizes[part]
                out = self.store.get_into(names[part], Buffers(ptrs, sizes, buffers.span))
                codes = _codes(out, job.kind, len(ptrs))
                for args in zip(names[part], ptrs, sizes, codes):
                    checks.append(pool.submit(self._check_one, *args, key))
        except BaseException:
            wait_all(checks)
            raise
        checked = [c.result() for c in checks]
        job.corrupt += checked.count(CORRUPT)
        job.key_misses += checked.count(KEY_MISS)
        return checked

    def _check_one(
        self, name: str, ptrs: list[int], sizes: list[int], code: int, key: TenantKey | None = None
    ) -> int:
        out = self.envelopes.check(name, ptrs, sizes, code, self.decoder, key)
        if out >= 0 and active():  # instances with and without a codec on one store
            encoded = self.envelopes.encoded(ptrs[0])
            if encoded and self.codec is None:
                mark("codec.encoded-read-without-codec")
            elif not encoded and self.codec is not None:
                mark("codec.raw-read-with-codec")
        return out

    def _hash(self, job: Job) -> None:
        """Hash the pages of a fetch that the engine thread left (`hash_from`). The hashing
        releases the GIL."""
        prev, tokens = job.hash_from  # type: ignore[misc]
        keys = page_keys(prev, tokens, self.page_tokens, release_gil=True)
        job.page_keys = job.page_keys + keys  # a new list: the engine thread holds the old one

    def _name_groups(self, job: Job) -> None:
        """A fetch's first job: its groups' ends from its page keys (and, for a probe of a
        state layout, the state at every group end too)."""
        job.ends = job.page_keys[self.G - 1 :: self.G]
        if job.tail:
            job.ends.append(job.page_keys[-1])
        if job.kind == "probe" and self.states:
            job.state_ends = job.ends

    def _prefixes(self, fingerprint: bytes) -> dict[str, tuple[list[str], str]]:
        out = {}
        for tenant in {"", *self.owners.values()}:
            groups = [
                store_key(self.key_prefix, fingerprint, b"", g, tenant) for g in range(self.G + 1)
            ]
            out[tenant] = groups, store_key(self.key_prefix, fingerprint, b"", None, tenant)
        return out

    def rename(self, fingerprint: bytes) -> None:
        """Name the objects of the jobs placed from now on under `fingerprint` (an engine whose
        weights changed in place: its old pages are never read again); jobs placed before keep
        their names (their bytes are the old weights')."""
        self._names = self._prefixes(fingerprint)

    def _place(self, job: Job) -> None:
        """The names of a job's objects and, for a get or a put, where their bytes lie."""
        # one read: a `rename` meanwhile names the next job
        groups, states = self._names[self.owners.get(job.seed, "")]
        job.names = [groups[self.G] + k.hex() for k in job.ends]
        if job.tail:
            job.names[len(job.ends) - 1] = groups[job.tail] + job.ends[-1].hex()
        job.names += [states + k.hex() for k in job.state_ends]
        if job.kind != "probe":
            job.buffers = self._buffers(job.page_slots, job.state_slots)

    @cached_property
    def _page_rows(self) -> list[tuple[int, int, int]]:
        """Per segment of the pages: address of slot 0's row, bytes between slots, bytes of a
        row (once the pool exists)."""
        return [(s.data_ptr(), s.stride(0), s.shape[1]) for s in self.host.pages.segments]

    def _buffers(self, page_slots: list[int], state_slots: list[int] | tuple[()] = ()) -> Buffers:
        """Where the objects lie: each its header (`envelopes`), then its bytes in the host
        pools: a page group per `G` consecutive entries of `page_slots` (laid out by
        `group_pieces`; the last may be a tail, shorter), then one state per entry of
        `state_slots`."""
        G = self.G
        rows = self._page_rows
        if len(rows) == 1:
            pieces = group_pieces(rows[0], G, page_slots)
        else:
            pieces = segmented_pieces(rows, G, page_slots)
        header = self.envelopes.page_header
        # by its last slot: groups that share their first page (prompts that part in the
        # group) are put at once from the same first slot, but a last page names its group
        lasts = page_slots[G - 1 :: G] + (page_slots[-1:] if len(page_slots) % G else [])
        for ptrs, sizes, last in zip(pieces.ptrs, pieces.sizes, lasts):
            ptrs.insert(0, header(last))
            sizes.insert(0, HEADER)
        for slot in state_slots:
            row = self.host.state(slot)
            pieces.ptrs.append([self.envelopes.state_header(slot), row.data_ptr()])
            pieces.sizes.append([HEADER, row.numel()])
        return Buffers(pieces.ptrs, pieces.sizes)


class BadResult(HiCacheError):
    """A store tier answered a call with a result of the wrong length or type."""


def _answer(out: object, job: Job) -> list[int]:
    """A store call's answer as a list of ints, one per object of `job` (bools and numpy
    integers are ints); `BadResult` where it is not a sequence of as many integers."""
    return _codes(out, job.kind, len(job.names))


def _codes(out: object, kind: str, n: int) -> list[int]:
    """`out`, the answer of a `kind` call for `n` objects, as `_answer` takes it."""
    if isinstance(out, str | bytes) or not isinstance(out, Sequence | np.ndarray):
        raise BadResult(f"{kind}: the store returned {type(out).__name__}, not a list")
    if len(out) != n:
        raise BadResult(f"{kind}: the store returned {len(out)} results for {n} objects")
    if not all(isinstance(c, _INTEGERS) for c in out):
        kinds = sorted({type(c).__name__ for c in out})
        raise BadResult(f"{kind}: the store returned {', '.join(kinds)}, not ints")
    return [int(c) for c in out]


def _chunks(sizes: list[list[int]], nbytes: int) -> list[slice]:
    """Consecutive runs of the objects whose pieces are `sizes`, each of at least `nbytes`
    (the last may be fewer) or one object, covering them all in order."""
    parts: list[slice] = []
    start, held = 0, 0
    for i, pieces in enumerate(sizes):
        held += sum(pieces)
        if held >= nbytes:
            parts.append(slice(start, i + 1))
            start, held = i + 1, 0
    if start < len(sizes):
        parts.append(slice(start, len(sizes)))
    return parts


_INTEGERS = (int, np.integer, np.bool_)  # bool is an int


def group_pieces(rows: tuple[int, int, int], G: int, slots: list[int]) -> Buffers:
    """The pieces of page groups of `G` pages, a group per `G` consecutive entries of `slots` (the
    last group may be shorter: a tail), in a pool whose `rows` are (address of slot 0, bytes
    between slots, bytes of a page).

    Where rows lie back to back, a group whose pages are in consecutive slots, in order, is one
    piece; any other group is a piece per page. Mooncake moves fewer, larger pieces faster: a
    batch of 32 objects of 512 KiB as one piece each took 4-11 % less time than as 4 pieces each
    in five runs on H200 hosts (raw gets; those L3 results are in git history). The span of every
    piece comes with them (None for no slots)."""
    base, stride, size = rows
    n = len(slots)
    if not n:
        return Buffers([], [])
    merge = stride == size  # rows back to back: consecutive slots are one piece
    if merge and slots == list(range(slots[0], slots[0] + n)):
        # the usual fetch (sorted slots of a fresh reserve): one run, a piece per group,
        # without a list per group (half the time of the loop below, on the fill's path)
        first = base + stride * slots[0]
        sizes = [[G * size] for _ in range(n // G)]
        if n % G:
            sizes.append([n % G * size])
        return Buffers(
            [[at] for at in range(first, first + n * stride, G * stride)],
            sizes,
            (first, first + n * stride),
        )
    ptrs: list[list[int]] = []
    sizes: list[list[int]] = []
    for i in range(0, n, G):  # plain ints: cheaper than numpy at this size
        group = slots[i : i + G]
        first, k = group[0], len(group)
        if merge and group == list(range(first, first + k)):
            ptrs.append([base + stride * first])
            sizes.append([k * size])
        else:
            ptrs.append([base + stride * slot for slot in group])
            sizes.append([size] * k)
    # min/max of the ints, not numpy reductions (each costs more than the loop here)
    low, high = min(slots), max(slots)
    return Buffers(ptrs, sizes, (base + stride * low, base + stride * high + size))


def segmented_pieces(rows: list[tuple[int, int, int]], G: int, slots: list[int]) -> Buffers:
    """As `group_pieces`, for pages made of several segments (a row of each; `rows` gives
    each segment's address of slot 0, bytes between slots and bytes of a row): a group's
    bytes are segment by segment, each segment's rows of the group's pages in order, so that
    a segment whose rows lie back to back gives one piece for a group in consecutive slots
    (else a piece per page). The span covers every piece (None for no slots)."""
    if not slots:
        return Buffers([], [])
    ptrs: list[list[int]] = []
    sizes: list[list[int]] = []
    for i in range(0, len(slots), G):
        group = slots[i : i + G]
        first, k = group[0], len(group)
        run = group == list(range(first, first + k))
        obj_ptrs: list[int] = []
        obj_sizes: list[int] = []
        for base, stride, size in rows:
            if run and stride == size:
                obj_ptrs.append(base + stride * first)
                obj_sizes.append(k * size)
            else:
                obj_ptrs += [base + stride * slot for slot in group]
                obj_sizes += [size] * k
        ptrs.append(obj_ptrs)
        sizes.append(obj_sizes)
    low, high = min(slots), max(slots)
    span = (
        min(base + stride * low for base, stride, _ in rows),
        max(base + stride * high + size for base, stride, size in rows),
    )
    return Buffers(ptrs, sizes, span)
