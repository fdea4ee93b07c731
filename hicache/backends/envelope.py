"""The header every object of a store tier carries: what it holds and a checksum of its bytes.

A store tier's worker (`hicache.chain.jobs`) writes an object as one `HEADER`-byte header,
then the payload; the store keeps both as the object's bytes, so every store tier (disk,
Mooncake, one from another package) gets the check without doing anything. The header is::

    magic "HCob" | version u8 | codec u8 | flags u16 | raw bytes u64 | stored bytes u64
    | checksum u64 | key id u32 | nonce (12 bytes) | tag (16 bytes)

(little-endian). Key id 0 (nonce and tag zeros): the payload is stored plain; else it is
AES-GCM's ciphertext under the key of that id, the nonce and tag its own, and the object's name
and the header's fields before the nonce its associated data (`hicache.backends.crypt`: a
tenant's encryption at rest; what is encrypted is the payload the codec made). The checksum
(`hicache.core.checksum`) covers the payload's raw bytes, seeded by the object's name, so an
object read under another name does not verify either. A tier with a codec
(`hicache.backends.codec`) stores the payload encoded (`stored` bytes of codec `codec`) or,
where that would not shrink it, raw (flag `RAW`, `stored` = `raw`). A read counts only where
the store returned exactly header plus `stored` bytes and the header names this version, a
codec this reader decodes, the raw length the reader expects, and the checksum of the raw
bytes that arrived or were decoded; for a tenant with a key, also the key's id and a tag that
verifies (else `KEY_MISS`, as for an encrypted object where no key is expected). Anything else
(bytes changed at rest, a payload that does not decode, an object written by an older version,
one of another layout or size) is a miss, counted, never a hit.

The headers live in memory of their own (`Envelopes`), registered with the store beside the host
pools: one header per host page slot (a page group's goes by its last slot) and per state slot.
Two jobs never share a header: a get's slots are reserved, its own; puts read pinned slots, and
two puts that share a group's last slot put the same object (a last page's key names its
group), whereas groups that share a first page do not.
"""

from __future__ import annotations

import errno
import hashlib
import struct
import threading

import numpy as np
import torch

from hicache.backends.codec import Codec, view
from hicache.backends.crypt import KEY_MISS, TenantKey
from hicache.core.checksum import checksum
from hicache.core.marks import mark

_FIELDS = struct.Struct("<4sBBHQQQI12s16s")
# magic, version, codec, flags, raw, stored, checksum, key id, nonce, tag
_SIGNED = struct.Struct("<4sBBHQQQI")  # the fields a tag covers (with the object's name)
HEADER = _FIELDS.size
"""Bytes of an object's header (64)."""
MAGIC = b"HCob"
VERSION = 2
"""2: with a key id, nonce and tag (objects of version 1, 32-byte headers, are misses)."""
CODEC_NONE = 0
RAW = 1
"""Flag: the payload of an object of a tier with a codec is stored raw (it did not shrink)."""

CORRUPT = -errno.EBADMSG
"""The per-key code a get gives for an object whose header or checksum did not verify."""


def seed(name: str) -> int:
    """The checksum's seed for the object named `name`."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


class Envelopes:
    """The headers of one store link's objects: `HEADER` bytes per host page slot, then per
    state slot, in one tensor (`memory`) that the link registers with its store. Thread-safe
    for jobs on distinct slots."""

    def __init__(self, page_slots: int, state_slots: int) -> None:
        self.memory = torch.zeros(max(1, page_slots + state_slots) * HEADER, dtype=torch.uint8)
        self._base = self.memory.data_ptr()
        self._view = memoryview(self.memory.numpy())
        self._states = page_slots

    def page_header(self, slot: int) -> int:
        """Address of the header of the group whose last page is in host page slot `slot`."""
        return self._base + HEADER * slot

    def state_header(self, slot: int) -> int:
        """Address of the header of the state in host state slot `slot`."""
        return self._base + HEADER * (self._states + slot)

    def seal(self, name: str, ptrs: list[int], sizes: list[int]) -> None:
        """Write the header of object `name` stored raw: `ptrs[0]` is its header (one of this
        object's), the other pieces its payload."""
        payload = sum(sizes) - HEADER
        value = checksum(ptrs[1:], sizes[1:], seed(name))
        self.write(ptrs[0], CODEC_NONE, 0, payload, payload, value)

    def write(
        self,
        at: int,
        codec: int,
        flags: int,
        raw: int,
        stored: int,
        value: int,
        sealed: tuple[int, bytes, bytes] = (0, bytes(12), bytes(16)),
    ) -> None:
        """Write a header at `at` (one of this object's headers); `sealed`: the key id, nonce and
        tag of an encrypted payload (`signed` gave what the tag covers)."""
        fields = (MAGIC, VERSION, codec, flags, raw, stored, value, *sealed)
        _FIELDS.pack_into(self._view, at - self._base, *fields)

    def check(
        self,
        name: str,
        ptrs: list[int],
        sizes: list[int],
        code: int,
        codec: Codec | None = None,
        key: TenantKey | None = None,
    ) -> int:
        """The code of a get of object `name` into `ptrs`/`sizes` (header first) that returned
        `code`: the payload's raw bytes where it verifies (decrypted in place with `key`, the
        tenant's, where it has one; decoded in place by `codec` where it was stored encoded),
        the store's own code where it failed (negative), `KEY_MISS` for an object that does not
        open with `key` (or is encrypted where `key` is None), `CORRUPT` for anything else."""
        if code < 0:
            return code
        payload = sum(sizes) - HEADER
        magic, version, kind, flags, raw, stored, value, kid, nonce, tag = _FIELDS.unpack_from(
            self._view, ptrs[0] - self._base
        )
        if (magic, version, raw) != (MAGIC, VERSION, payload) or code != stored + HEADER:
            return CORRUPT
        if kid != (0 if key is None else key.id):
            mark("crypt.key-mismatch")
            return KEY_MISS
        if key is not None:
            aad = signed(name, kind, flags, raw, stored, value, kid)
            if not _open(key, ptrs[1:], sizes[1:], stored, aad, nonce, tag):
                mark("crypt.tag-failed")
                return KEY_MISS
            mark("crypt.opened")
        if kind == CODEC_NONE or flags == RAW:
            if stored != raw or flags != (0 if kind == CODEC_NONE else RAW):
                return CORRUPT
        elif flags or codec is None or not _decode(codec, kind, ptrs[1:], sizes[1:], stored):
            return CORRUPT
        else:
            mark("codec.decoded")
        if not self.verifies(name, ptrs, sizes, value):
            mark("checksum.mismatch")
            return CORRUPT
        return payload

    @staticmethod
    def verifies(name: str, ptrs: list[int], sizes: list[int], value: int) -> bool:
        """The checksum's verdict: whether the raw payload of object `name` (the pieces after
        its header) has the checksum `value` its header gives."""
        return value == checksum(ptrs[1:], sizes[1:], seed(name))

    def encoded(self, at: int) -> bool:
        """Whether the header at `at` (one of this object's, verified) says its payload was
        stored encoded."""
        kind, flags = self._view[at - self._base + 5], self._view[at - self._base + 6]
        return kind != CODEC_NONE and flags != RAW


def signed(name: str, *fields: int) -> bytes:
    """What an object's tag covers: its name and its header's codec, flags, raw and stored
    bytes, checksum and key id."""
    return name.encode() + _SIGNED.pack(MAGIC, VERSION, *fields)


def _open(
    key: TenantKey, ptrs: list[int], sizes: list[int], stored: int, aad: bytes, nonce: bytes,
    tag: bytes,
) -> bool:  # fmt: skip
    """Decrypt the first `stored` bytes of the pieces in place; False (the pieces left as they
    were) where the tag does not verify."""
    if sum(sizes) < stored:
        return False
    out = key.scratch(stored)
    src = contiguous(ptrs, sizes, stored)
    if not key.open(src, out, aad, nonce, tag):
        return False
    scatter(out[:stored], ptrs, sizes)
    return True


def contiguous(ptrs: list[int], sizes: list[int], nbytes: int) -> np.ndarray:
    """The first `nbytes` of the pieces as one array: a view of the first piece where it holds
    them, else a copy in this thread's buffer (until its next call on this thread)."""
    if sizes and sizes[0] >= nbytes:
        return view(ptrs[0], nbytes)
    buf = getattr(_local, "joined", None)
    if buf is None or buf.size < nbytes:
        buf = _local.joined = np.empty(nbytes, dtype=np.uint8)
    out = buf[:nbytes]
    at = 0
    for ptr, size in zip(ptrs, sizes):
        n = min(size, nbytes - at)
        out[at : at + n] = view(ptr, n)
        at += n
        if at == nbytes:
            break
    return out


_local = threading.local()


def scatter(src: np.ndarray, ptrs: list[int], sizes: list[int]) -> None:
    """`src` into the pieces, in order (as many bytes as `src` has)."""
    at = 0
    for ptr, size in zip(ptrs, sizes):
        n = min(size, src.size - at)
        if n <= 0:
            break
        view(ptr, n)[:] = src[at : at + n]
        at += n


def _decode(codec: Codec, kind: int, ptrs: list[int], sizes: list[int], stored: int) -> bool:
    """Decode the payload of codec `kind` read into the first `stored` bytes of the pieces into
    the pieces; False where it does not decode."""
    raw = sum(sizes)
    if len(ptrs) == 1:
        dst = view(ptrs[0], raw)
        return codec.decode(kind, dst[:stored], dst)
    src = contiguous(ptrs, sizes, stored)
    dst = codec.scratch(raw, "out")
    if not codec.decode(kind, src, dst):
        return False
    at = 0
    for ptr, size in zip(ptrs, sizes):
        view(ptr, size)[:] = dst[at : at + size]
        at += size
    return True
