"""The header every object of a store tier carries: what it holds and a checksum of its bytes.

A store tier's worker (`hicache.tiers.worker`) writes an object as one `HEADER`-byte header,
then the payload; the store keeps both as the object's bytes, so every store tier (disk,
Mooncake, one from another package) gets the check without doing anything. The header is::

    magic "HCob" | version u8 | codec u8 | flags u16 | raw bytes u64 | stored bytes u64
    | checksum u64

(little-endian). The checksum (`hicache.core.checksum`) covers the payload's bytes, seeded by the
object's name, so an object read under another name does not verify either. A read counts only
where the store returned exactly header plus payload and the header names this version, the
codec, the lengths the reader expects and the checksum of the bytes that arrived; anything else
(bytes changed at rest, an object written by an older version without a header, one of another
layout or size) is a miss, counted, never a hit.

The headers live in memory of their own (`Envelopes`), registered with the store beside the host
pools: one header per host page slot (a page group's goes by its first slot) and per state slot.
A slot belongs to one job at a time (a put's are pinned and published, a get's reserved), so
two jobs never share a header.
"""

from __future__ import annotations

import errno
import hashlib
import struct

import torch

from hicache.core.checksum import checksum

_FIELDS = struct.Struct("<4sBBHQQQ")  # magic, version, codec, flags, raw, stored, checksum
HEADER = _FIELDS.size
"""Bytes of an object's header (32)."""
MAGIC = b"HCob"
VERSION = 1
CODEC_NONE = 0

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
        """Address of the header of the group whose first page is in host page slot `slot`."""
        return self._base + HEADER * slot

    def state_header(self, slot: int) -> int:
        """Address of the header of the state in host state slot `slot`."""
        return self._base + HEADER * (self._states + slot)

    def seal(self, name: str, ptrs: list[int], sizes: list[int]) -> None:
        """Write the header of object `name`: `ptrs[0]` is its header (one of this object's),
        the other pieces its payload."""
        payload = sum(sizes) - HEADER
        value = checksum(ptrs[1:], sizes[1:], seed(name))
        fields = (MAGIC, VERSION, CODEC_NONE, 0, payload, payload, value)
        _FIELDS.pack_into(self._view, ptrs[0] - self._base, *fields)

    def check(self, name: str, ptrs: list[int], sizes: list[int], code: int) -> int:
        """The code of a get of object `name` into `ptrs`/`sizes` (header first) that returned
        `code`: the payload's bytes where it verifies, the store's own code where it failed
        (negative), `CORRUPT` for anything else."""
        if code < 0:
            return code
        payload = sum(sizes) - HEADER
        if code != payload + HEADER:
            return CORRUPT
        magic, version, codec, flags, raw, stored, value = _FIELDS.unpack_from(
            self._view, ptrs[0] - self._base
        )
        if (magic, version, codec, flags, raw, stored) != (
            MAGIC,
            VERSION,
            CODEC_NONE,
            0,
            payload,
            payload,
        ):
            return CORRUPT
        if value != checksum(ptrs[1:], sizes[1:], seed(name)):
            return CORRUPT
        return payload
