"""`KeyIndex`: page keys to slot numbers, the index of a `SlotPool`.

`key_index(capacity)` gives the compiled table of ``keyindex.c`` where a C compiler is present
(one cache line per lookup, batch lookups prefetched: about five times faster than a dict once
the CPU caches are cold), and a dict with the same methods where it is not. Both hold at most
`capacity` keys; both are engine-thread only.

The compiled table holds the C functions it calls and the buffers they fill, so that each of
its lookups (``prefix``, ``split``, ``lookup``, ``walk``) is one Python call around one C call;
`SlotPool` binds these methods as its own, so the engine thread calls them directly.
"""

from __future__ import annotations

import ctypes
from array import array
from collections.abc import Iterator, Sequence

import numpy as np

from hicache.core import native

__all__ = ["KeyIndex", "key_index"]

KEY_BYTES = 16
_ENTRY = np.dtype([("k0", "<u8"), ("k1", "<u8"), ("slot", "<i8")])


def _bad_keys() -> ValueError:
    return ValueError(f"page keys must be {KEY_BYTES} bytes each")


def _packed(keys: Sequence[bytes]) -> bytes:
    """`keys` as one string for a compiled call (the hot lookups do this inline)."""
    data = b"".join(keys)
    if len(data) != KEY_BYTES * len(keys):
        raise _bad_keys()
    return data


class _TableIndex:
    """The compiled open-addressing table (see keyindex.c), and the walk over it (walk.c) where
    the chain's hash functions are loaded (`chain`: `native.chain_library()`)."""

    def __init__(
        self,
        capacity: int,
        lib: ctypes.CDLL,
        chain: tuple[ctypes.CDLL, tuple[int, int, int]] | None = None,
    ) -> None:
        size = 1 << max(4, (2 * capacity - 1).bit_length())  # load factor at most 1/2
        self._table = np.zeros(size, dtype=_ENTRY)
        self._table["slot"] = -1
        self._addr = self._table.ctypes.data
        self._mask = size - 1
        self._find = lib.hicache_index_find
        self._split = lib.hicache_index_split
        self._insert = lib.hicache_index_insert
        self._remove = lib.hicache_index_remove
        # the walk: hicache_walk with OpenSSL's SHA-256 functions as its first arguments
        self._walk_c = None if chain is None else chain[0].hicache_walk
        self._sha256 = () if chain is None else chain[1]
        self._found = ctypes.c_int64()
        self._found_ref = ctypes.byref(self._found)
        self.count = np.zeros(1, dtype=np.int64)
        """The number of keys held; the slot books (books.py) update it when they insert or
        remove keys in the table themselves."""
        self._room = 0
        self._grow(64)

    def _grow(self, n: int) -> None:
        """Reused result buffers (slots, new-key flags, positions, the walk's keys) with room
        for at least `n` entries, and their addresses."""
        room = self._room = max(n, 2 * self._room)
        self._out = array("i", bytes(4 * room))
        self._fresh = array("B", bytes(room))
        self._lost = array("i", bytes(4 * room))
        self._keys = np.empty(room, dtype=f"V{KEY_BYTES}")
        self._out_at = self._out.buffer_info()[0]
        self._fresh_at = self._fresh.buffer_info()[0]
        self._lost_at = self._lost.buffer_info()[0]
        self._keys_at = self._keys.ctypes.data

    # The lookups below pack the keys and size the buffers inline: each is one Python call.

    def prefix(self, keys: Sequence[bytes]) -> list[int]:
        n = len(keys)
        packed = b"".join(keys)
        if len(packed) != KEY_BYTES * n:
            raise _bad_keys()
        if self._room < n:
            self._grow(n)
        found = self._find(self._addr, self._mask, packed, n, self._out_at, 1)
        return self._out[:found].tolist()

    def lookup(self, keys: Sequence[bytes]) -> list[int | None]:
        n = len(keys)
        packed = b"".join(keys)
        if len(packed) != KEY_BYTES * n:
            raise _bad_keys()
        if self._room < n:
            self._grow(n)
        self._find(self._addr, self._mask, packed, n, self._out_at, 0)
        return [None if s < 0 else s for s in self._out[:n].tolist()]

    def split(self, keys: Sequence[bytes]) -> tuple[list[int], list[int]]:
        n = len(keys)
        packed = b"".join(keys)
        if len(packed) != KEY_BYTES * n:
            raise _bad_keys()
        if self._room < n:
            self._grow(n)
        found = self._split(self._addr, self._mask, packed, n, self._out_at, self._lost_at)
        return self._out[:found].tolist(), self._lost[: n - found].tolist()

    def get(self, key: bytes) -> int | None:
        if len(key) != KEY_BYTES:
            raise _bad_keys()
        self._find(self._addr, self._mask, key, 1, self._out_at, 0)
        slot = self._out[0]
        return None if slot < 0 else slot

    def __contains__(self, key: bytes) -> bool:
        if len(key) != KEY_BYTES:
            raise _bad_keys()
        return self._find(self._addr, self._mask, key, 1, self._out_at, 0) == 1

    def insert(self, keys: Sequence[bytes], slots: Sequence[int]) -> list[bool]:
        n = len(keys)
        if len(slots) != n:
            raise ValueError(f"{n} keys but {len(slots)} slots")
        if len(self) + n > self._mask:  # a full table would never end a probe
            raise RuntimeError(f"hicache: key index full ({len(self)} keys)")
        slot_arr = array("i", slots)
        if self._room < n:
            self._grow(n)
        self.count[0] += self._insert(
            self._addr, self._mask, _packed(keys), slot_arr.buffer_info()[0], n, self._fresh_at
        )
        return self._fresh[:n].tolist()  # type: ignore[return-value]  # 0/1, as good as bools

    def remove(self, keys: Sequence[bytes]) -> None:
        self.count[0] -= self._remove(self._addr, self._mask, _packed(keys), len(keys))

    def walk(self, prev: bytes, pages: np.ndarray) -> tuple[list[bytes], list[int]] | None:
        """Hash `pages` (C-contiguous [n, page_tokens] int32) chained from `prev` and look each
        key up, stopping after the pair of pages that holds the first miss (walk.c): the keys
        hashed and the slots of the leading run held. None without the chain's hash functions
        (the caller then hashes and looks up in steps)."""
        if self._walk_c is None:
            return None
        n = pages.shape[0]
        if self._room < n:
            self._grow(n)
        hashed = self._walk_c(
            *self._sha256,
            prev,
            native.address(pages),
            pages.shape[1] * 4,
            n,
            self._addr,
            self._mask,
            self._keys_at,
            self._out_at,
            self._found_ref,
        )
        return self._keys[:hashed].tolist(), self._out[: self._found.value].tolist()

    def __len__(self) -> int:
        return int(self.count[0])

    @property
    def table(self) -> tuple[int, int]:
        """Address of the table and its mask (its size - 1), for compiled code that shares it."""
        return self._addr, self._mask

    def items(self) -> Iterator[tuple[bytes, int]]:
        used = self._table[self._table["slot"] >= 0]
        for k0, k1, slot in used.tolist():
            yield k0.to_bytes(8, "little") + k1.to_bytes(8, "little"), slot


class _DictIndex:
    """The same methods over a dict, where no C compiler is found."""

    def __init__(self, capacity: int) -> None:
        self._map: dict[bytes, int] = {}

    def prefix(self, keys: Sequence[bytes]) -> list[int]:
        out = []
        for k in keys:
            s = self._map.get(k)
            if s is None:
                break
            out.append(s)
        return out

    def lookup(self, keys: Sequence[bytes]) -> list[int | None]:
        return list(map(self._map.get, keys))

    def split(self, keys: Sequence[bytes]) -> tuple[list[int], list[int]]:
        found = self.lookup(keys)
        return [s for s in found if s is not None], [i for i, s in enumerate(found) if s is None]

    def get(self, key: bytes) -> int | None:
        return self._map.get(key)

    def __contains__(self, key: bytes) -> bool:
        return key in self._map

    def insert(self, keys: Sequence[bytes], slots: Sequence[int]) -> list[bool]:
        if len(slots) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(slots)} slots")
        fresh = []
        for k, s in zip(keys, slots):
            new = k not in self._map
            if new:
                self._map[k] = s
            fresh.append(new)
        return fresh

    def remove(self, keys: Sequence[bytes]) -> None:
        for k in keys:
            self._map.pop(k, None)

    def walk(self, prev: bytes, pages: np.ndarray) -> None:
        return None  # no compiled helpers: the caller hashes and looks up in steps

    def __len__(self) -> int:
        return len(self._map)

    def items(self) -> Iterator[tuple[bytes, int]]:
        return iter(list(self._map.items()))


KeyIndex = _TableIndex | _DictIndex


def key_index(capacity: int, *, compiled: bool = True) -> KeyIndex:
    """An index for at most `capacity` keys: the compiled table when it can be built (and
    `compiled`), else the dict. Methods: ``prefix(keys)`` (slots of the leading run of keys
    held), ``lookup(keys)`` (slot or None each), ``split(keys)`` (the slots of the keys held,
    and the positions of the others), ``get``, ``in``, ``insert(keys, slots)`` (adds
    the keys not held; says which were new), ``remove(keys)``, ``len``, ``items()``, and
    ``walk(prev, pages)``: hash pages chained from `prev` while their keys are held (see
    `_TableIndex.walk`; None from the dict, or where the chain's hash functions are missing).

    The caller keeps at most `capacity` keys in it (the table's load factor depends on it).
    """
    lib = native.library() if compiled else None
    if lib is None:
        return _DictIndex(capacity)
    return _TableIndex(capacity, lib, native.chain_library())
