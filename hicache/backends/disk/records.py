"""The disk tier's records: one file per object, a 4 KiB header, then the object's bytes.

A record is published only whole: it is written under a temporary name and renamed into place
once every byte is written (and synced, where the tier syncs), so a reader meets either no file
or a complete one. The header names the key and the payload's length and carries a CRC32 of
itself; a record whose header does not verify, names another key or whose file length disagrees
is not served. The header takes a whole 4 KiB block so that the payload starts aligned and can
move with O_DIRECT. An object's small first piece (at most `INLINE` bytes: the object header
that the tier chain writes before every payload, `hicache.backends.envelope`) is kept inside the
header block, covered by its CRC, so that the rest stays aligned. Records of the earlier
format (``HICDISK1``) do not verify: they are misses, removed when met.

The I/O helpers move bytes between a file and memoryviews with ``os.preadv``/``os.pwritev``,
which release the GIL, and loop over short transfers.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
import threading
import zlib
from collections.abc import Callable, Sequence

from hicache.core.keys import object_tenant

HEADER = 4096
"""Bytes before the payload: one block, so that the payload is aligned for O_DIRECT."""
MAGIC = b"HICDISK2"
_FIELDS = struct.Struct("<8sQII")  # magic, payload bytes, key bytes, inline bytes; then the key,
# the inline bytes, then a CRC32 of all before it
INLINE = 256
"""An object's first piece of at most this many bytes (and not its only piece) is kept in the
header block."""
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


def file_name(key: str) -> str:
    """The record's name below the objects directory: ``ab/abcdef…`` (SHA-256 of the key, so any
    key makes a valid, fixed-length name; the header keeps the key itself), and for a tenant's
    object (`hicache.core.keys.object_tenant`) ``ab/abcdef…~<tenant>``, so that the tier's book
    knows each record's tenant from the listing alone."""
    digest = hashlib.sha256(key.encode()).hexdigest()
    tenant = object_tenant(key)
    return f"{digest[:2]}/{digest}" + (f"~{tenant}" if tenant else "")


def check_key(key: str) -> None:
    """ValueError naming the key if it does not fit a record's header."""
    if _FIELDS.size + len(key.encode()) + INLINE + 4 > HEADER:
        raise ValueError(f"key {key[:40]!r}...: longer than a record header holds")


def split(views: list[memoryview]) -> tuple[memoryview | None, list[memoryview]]:
    """An object's pieces as (the piece kept in the header block, or None; the pieces after
    the header block)."""
    if len(views) > 1 and views[0].nbytes <= INLINE:
        return views[0], views[1:]
    return None, views


def pack_header(out: memoryview, key: str, length: int, inline: memoryview | None) -> None:
    """Write the header of a record of `length` payload bytes after the header block for `key`
    (checked by `check_key`), holding `inline`, into `out` (HEADER bytes)."""
    raw = key.encode()
    kept = bytes(inline) if inline is not None else b""
    end = _FIELDS.size + len(raw) + len(kept)
    out[:HEADER] = bytes(HEADER)
    _FIELDS.pack_into(out, 0, MAGIC, length, len(raw), len(kept))
    out[_FIELDS.size : end] = raw + kept
    struct.pack_into("<I", out, end, zlib.crc32(out[:end]))


def parse_header(block: memoryview) -> tuple[str, int, memoryview] | None:
    """(key, payload bytes after the block, the inline bytes) of a header block, or None if it
    is not a valid header."""
    magic, length, key_len, kept = _FIELDS.unpack_from(block, 0)
    end = _FIELDS.size + key_len + kept
    if magic != MAGIC or kept > INLINE or end + 4 > HEADER:
        return None
    (crc,) = struct.unpack_from("<I", block, end)
    if crc != zlib.crc32(block[:end]):
        return None
    key_end = _FIELDS.size + key_len
    try:
        return bytes(block[_FIELDS.size : key_end]).decode(), length, block[key_end:end]
    except UnicodeDecodeError:
        return None


_local = threading.local()


def header_block() -> memoryview:
    """This thread's page-aligned HEADER-byte buffer (anonymous mmap memory is page-aligned, so
    it can travel with O_DIRECT)."""
    block = getattr(_local, "block", None)
    if block is None:
        block = _local.block = memoryview(mmap.mmap(-1, HEADER))
    return block


def alignment(views: Sequence[memoryview], addresses: Sequence[int]) -> int:
    """The largest power of two up to 4096 that divides every address and every length."""
    bits = 4096
    for view, address in zip(views, addresses, strict=True):
        bits |= address | view.nbytes
    return bits & -bits


def transfer(
    op: Callable[[int, list[memoryview], int], int],
    fd: int,
    views: Sequence[memoryview],
    offset: int,
) -> int:
    """Run ``os.preadv``/``os.pwritev`` until every view is done or the file ends; bytes moved."""
    todo = [v for v in views if v.nbytes]
    done = 0
    while todo:
        n = op(fd, todo[:_IOV_MAX], offset + done)
        if n <= 0:
            break
        done += n
        while todo and n >= todo[0].nbytes:
            n -= todo[0].nbytes
            todo.pop(0)
        if n:
            todo[0] = todo[0][n:]
    return done


def read_full(fd: int, views: Sequence[memoryview], offset: int) -> int:
    """Read into `views` from `offset`; bytes read (fewer only at the end of the file)."""
    return transfer(os.preadv, fd, views, offset)


def write_full(fd: int, views: Sequence[memoryview], offset: int) -> int:
    """Write `views` at `offset`; bytes written."""
    return transfer(os.pwritev, fd, views, offset)
