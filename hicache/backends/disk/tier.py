"""The disk tier: page groups and states as files on a local file system, below the host tier.

Layout (see docs/disk.md): ``<path>/objects/ab/<sha256 of key>`` holds one object as a record
(`disk_records`: a 4 KiB header naming the key and the length, then the bytes; an object's
small first piece, such as the tier chain's object header, is kept in the header block);
``<path>/tmp`` holds records being written; ``<path>/lock`` is held (flock) by the one process
using the directory.

The contract the tier chain's workers rely on:

- `start()` makes the directories, takes the lock and checks that a record can be written and
  synced, on the caller's thread, and raises `DiskTierError` with one line naming the path and
  the problem (missing parent, not a directory, read-only, no space, in use by another process).
  It then lists the records of an earlier process (and removes its half-written ones) in the
  background; the tier is `available` once that is done.
- Calls run their objects on the tier's own I/O threads, in parallel, straight between the file
  and the caller's registered memory (O_DIRECT where the memory and sizes are aligned and the file
  system takes it, buffered otherwise). Per key they return the bytes read / 0, or a negative
  errno: `missing_code` (-ENOENT) for an object not held, -ENOSPC (size bound, or the disk full),
  -EFBIG (file size limit), -EIO and so on for failed I/O, -EMSGSIZE for buffers smaller than
  the object (a smaller object is read into the buffers' front: `reads_prefix`). A failed put
  or get is counted and never raises; a failed get is not a hit.
- A record is published only whole (written to ``tmp``, synced, renamed into place). A record
  found damaged (its header does not verify or its length is wrong) is a miss and is removed.
- Capacity: the records' bytes (headers included) stay within `size`; a put first evicts the
  least recently used records (`LruBook`), or, with tenants' terms (`set_terms`), by tenant:
  over its quota first, then the one furthest over its share. A file system that runs out of
  space first lowers the bound to what the tier holds then (the put that met it fails; later
  ones evict); a put under a lowered bound raises it again by the room the file system has
  then (a full file system is transient: a tier that held nothing when it met one takes puts
  again once space returns).
  The order survives restarts: a record's modification time is stamped with its last use (its
  write, its latest hit), and a restart orders by it.
- One process per directory: a second process gets a start-up error rather than a directory
  whose capacity and eviction order two processes would keep apart. The lock dies with its
  process, SIGKILL included, so a restart after a crash takes the directory over at once.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch

from hicache.backends.base import Buffers, StoreTier, StoreUnavailable
from hicache.backends.disk import records as rec
from hicache.backends.disk.config import DiskTierConfig, os_reason
from hicache.backends.disk.lru import LruBook
from hicache.backends.regions import Regions, check_keys, checked_tensor
from hicache.config import Layout
from hicache.core.marks import mark
from hicache.core.shares import Terms
from hicache.errors import TierStartError
from hicache.registry import register_tier

log = logging.getLogger(__name__)

MISSING = -errno.ENOENT
_SHARDS = frozenset(f"{i:02x}" for i in range(256))
"""The shard directories below objects/ (a record's name starts with its shard)."""
_RECORD = re.compile(r"[0-9a-f]{64}(~[\w.\-]+)?")
"""A record's file name in its shard (`records.file_name`)."""

_Object = tuple[list[memoryview], list[int]]
"""An object's pieces as memoryviews, and their addresses."""


class DiskTierError(TierStartError):
    """The directory cannot be used (raised by `start`, with one line naming path and cause)."""

    def __init__(self, reason: str) -> None:
        super().__init__("path", reason)


@dataclass(frozen=True)
class DiskStats:
    """Counters of one `DiskTier`."""

    records: int
    bytes_used: int
    capacity: int
    """Bytes the records may take: `size`, or less once the file system ran out of space."""
    keys_got: int
    bytes_got: int
    keys_put: int
    bytes_put: int
    misses: int
    failed_gets: int
    failed_puts: int
    damaged: int
    evicted: int
    dropped: int
    """Records removed by `drop_prefix` (a clear)."""
    stray: int
    """Entries of the directory that are not records (skipped at start, left alone)."""
    direct_calls: int
    buffered_calls: int


@register_tier("disk", DiskTierConfig)
class DiskTier(StoreTier):
    """Objects as files in one directory of a local file system. Thread-safe; blocking calls
    (worker threads only). `layout` is accepted like the other tiers' and is not used."""

    shared = False  # one process per directory (see the module docstring)
    persistent = True
    missing_code = MISSING
    reads_prefix = True  # a record's header holds its length
    keeps_terms = True  # a record's file name carries its tenant (`LruBook`)

    def __init__(self, config: DiskTierConfig, layout: Layout | None = None) -> None:
        if not isinstance(config, DiskTierConfig):
            raise TypeError(f"config must be a DiskTierConfig, got {type(config).__name__}")
        self.config = config
        self.layout = layout
        self.root = Path(config.path)
        self._objects = self.root / "objects"
        self._tmp = self.root / "tmp"
        self.book = LruBook(config.size)
        self._memory: Regions[memoryview] = Regions()
        self._pool: ThreadPoolExecutor | None = None
        self._listing: threading.Thread | None = None  # the start-up listing (see _load)
        self._lock_fd: int | None = None
        self._ready = threading.Event()
        self._closed = False
        self._direct_align: int | None = None  # least alignment O_DIRECT takes here; None: off
        self._seq = 0
        self._clock = 0  # the last use stamped on a record (ns); see _stamp
        self._found_empty = False  # set by the listing (see empty_at_start)
        self._count_lock = threading.Lock()
        self._counts = dict.fromkeys(
            (
                "keys_got",
                "bytes_got",
                "keys_put",
                "bytes_put",
                "misses",
                "failed_gets",
                "failed_puts",
                "damaged",
                "evicted",
                "dropped",
                "stray",
                "direct_calls",
                "buffered_calls",
            ),
            0,
        )

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Check and lock the directory now (DiskTierError, one line, if it cannot be used), then
        list its records in the background. Idempotent."""
        if self._closed:
            raise RuntimeError("DiskTier.start after close")
        if self._pool is not None:
            return
        where = str(self.root)
        try:
            self.root.mkdir(exist_ok=True)
            self._objects.mkdir(exist_ok=True)
            self._tmp.mkdir(exist_ok=True)
            for shard in _SHARDS:
                (self._objects / shard).mkdir(exist_ok=True)
        except OSError as err:
            raise DiskTierError(
                f"{where}: cannot create its directories: {os_reason(err)}"
            ) from None
        self._lock_fd = _lock(self.root / "lock", where)
        try:
            self._direct_align = _probe(self._tmp, self.config.direct_io == "auto", where)
        except DiskTierError:
            self._unlock()
            raise
        self._pool = ThreadPoolExecutor(self.config.io_threads, thread_name_prefix="hicache-disk")
        self._listing = threading.Thread(target=self._load, name="hicache-disk-load", daemon=True)
        self._listing.start()

    def _load(self) -> None:
        """Background: remove half-written records of an earlier process, list the records
        (oldest use first) and trim them to the size. Stops, changing nothing more, once the
        tier is closed (`close` waits for it before it lets the directory go)."""
        try:
            listed = self._list()
        except OSError as err:  # stays unavailable: nothing is stored or served
            log.error("hicache disk: cannot list %s: %s", self._objects, os_reason(err))
            return
        if listed:
            self._ready.set()

    def _list(self) -> bool:
        """List the records; an entry that is not the tier's (not a shard directory below
        objects/, not a record's file in a shard) is skipped, left alone and counted `stray`.
        False where the tier was closed meanwhile (then nothing is trimmed)."""
        for leftover in self._tmp.iterdir():
            mark("disk.leftover-removed")
            leftover.unlink(missing_ok=True)
        found, stray = [], 0
        with os.scandir(self._objects) as shards:
            for shard in shards:
                if self._closed:
                    return False
                if shard.name not in _SHARDS or not shard.is_dir(follow_symlinks=False):
                    stray += 1
                    continue
                with os.scandir(shard.path) as entries:
                    for entry in entries:
                        name = entry.name
                        if not (_RECORD.fullmatch(name) and entry.is_file(follow_symlinks=False)):
                            stray += 1
                            continue
                        st = entry.stat()
                        found.append((st.st_mtime_ns, f"{shard.name}/{name}", st.st_size))
        if stray:
            mark("disk.stray-skipped")
            log.warning(
                "hicache disk: %d entries in %s are not records: skipped", stray, self._objects
            )
            self._count("stray", stray)
        for stamp, name, nbytes in sorted(found):
            self.book.add(name, nbytes)
            self._clock = max(self._clock, stamp)
        if self._closed:
            return False
        self._remove(self.book.shrink())
        self._found_empty = not found
        return True

    def set_terms(self, terms: Mapping[str, Terms]) -> None:
        if self._pool is not None:
            raise RuntimeError("DiskTier.set_terms after start")
        self.book.terms = dict(terms)

    def tenant_bytes(self) -> dict[str, tuple[int, int]]:
        return self.book.tenants() if self.book.terms else {}

    def empty_at_start(self) -> bool:
        """Its directory held no record when it was listed (one process a directory)."""
        return self._ready.is_set() and self._found_empty

    @property
    def available(self) -> bool:
        """Started, its records listed, not closed."""
        return self._ready.is_set() and not self._closed

    def wait_ready(self, timeout_s: float) -> bool:
        """Block until the records are listed (for tools and tests); True if available."""
        self._ready.wait(timeout_s)
        return self.available

    def close(self, timeout_s: float = 30.0) -> bool:
        """Finish the calls in flight, stop the I/O threads and the start-up listing (which
        changes no file once it has stopped), and let go of the directory. True if the threads
        ended within `timeout_s` (they always end; the lock is released then)."""
        if self._closed:
            return True
        self._closed = True
        pool = self._pool
        if pool is None:
            return True
        done = threading.Event()

        def finish() -> None:
            pool.shutdown(wait=True)
            if self._listing is not None:
                self._listing.join()  # it stops at its next shard: no file changes after this
            self._unlock()
            done.set()

        threading.Thread(target=finish, name="hicache-disk-close", daemon=True).start()
        return done.wait(timeout_s)

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    # -- memory ------------------------------------------------------------------------------

    def register(self, memory: object) -> None:
        """Allow a contiguous CPU tensor as the source and target of transfers (kept referenced
        until the tier is gone). Twice is a no-op; overlapping regions are refused."""
        checked_tensor(memory)
        tensor = cast(torch.Tensor, memory)
        self._memory.add(tensor, memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))

    def _views(self, keys: list[str], buffers: Buffers) -> list[_Object]:
        """Per object: memoryviews of its pieces, and their addresses. Checks the pieces."""
        at = self._memory.locate(keys, buffers)
        regions = self._memory.all()
        out, j = [], 0
        for i, n in enumerate(at.counts):
            views = []
            for k in range(j, j + n):
                off = int(at.offset[k])
                views.append(regions[int(at.region[k])].info[off : off + int(at.size[k])])
            out.append((views, buffers.ptrs[i]))
            j += n
        return out

    # -- calls -------------------------------------------------------------------------------

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Which keys the tier holds (from its book: no I/O)."""
        keys = check_keys(keys)
        self._check_open("exists")
        return [rec.file_name(k) in self.book for k in keys]

    def get_into(self, keys: Sequence[str], buffers: Buffers) -> list[int]:
        """Read each object into its pieces, in parallel; per key the bytes read or a negative
        errno (-ENOENT: not held, or found damaged and removed)."""
        keys = check_keys(keys)
        objects = self._views(keys, buffers)
        codes = self._run("get_into", self._get_one, keys, objects)
        self._used(keys, codes)
        return codes

    def put_from(self, keys: Sequence[str], buffers: Buffers) -> list[int]:
        """Write each object from its pieces, in parallel; per key 0 (stored, or held already:
        objects are named by content) or a negative errno."""
        keys = check_keys(keys)
        for key in keys:
            rec.check_key(key)
        objects = self._views(keys, buffers)
        codes = self._run("put_from", self._put_one, keys, objects)
        self._used(keys, codes)
        return codes

    def _used(self, keys: list[str], codes: list[int]) -> None:
        """The records a call read or wrote become the most recently used, in the call's order
        (its last object the most recent), stamped on the files so that a restart lists them
        so too. Done here, not by the I/O threads as each finishes, whose order is the
        threads': the eviction order, and so which prompts hit, would depend on timing. (The
        reverse order, a prompt's first group the most recent, hit 0.7 % fewer tokens on 400
        requests of the agentic trace: docs/decisions/eviction-policies.md.)"""
        for key, code in zip(keys, codes):
            name = rec.file_name(key)
            if code >= 0 and self.book.touch(name):
                with contextlib.suppress(OSError):
                    os.utime(self._objects / name, ns=(self._stamp(),) * 2)

    def discard(self, keys: Sequence[str]) -> None:
        """Remove the records of `keys` that are held (counted `damaged`); one being written
        is left to its put."""
        names = [rec.file_name(key) for key in check_keys(keys)]
        self._remove([n for n in names if self.book.drop(n)], "damaged")

    def drop_prefix(self, prefix: str) -> int:
        """Remove every record whose key starts with `prefix`, on the I/O threads: each held
        record's header is read (4 KiB) to learn its key. How many were removed."""
        pool = self._check_open("drop")
        names = self.book.names()
        keys = pool.map(self._key_of, names)
        gone = [n for n, key in zip(names, keys) if key is not None and key.startswith(prefix)]
        gone = [n for n in gone if self.book.drop(n)]
        self._remove(gone, "dropped")
        return len(gone)

    def _key_of(self, name: str) -> str | None:
        """The key a record's header names (None: gone, or not a valid header)."""
        head = rec.header_block()
        try:
            fd = os.open(self._objects / name, os.O_RDONLY)
        except OSError:
            return None
        try:
            got = rec.read_full(fd, [head], 0)
        except OSError:
            return None
        finally:
            os.close(fd)
        found = rec.parse_header(head) if got == rec.HEADER else None
        return found[0] if found is not None else None

    def _run(
        self, op: str, one: Callable[[str, _Object], int], keys: list[str], objects: list[_Object]
    ) -> list[int]:
        """`one` for every object on the I/O threads; StoreUnavailable unless the tier is open."""
        pool = self._check_open(op)
        try:
            return list(pool.map(one, keys, objects))
        except RuntimeError:  # closed meanwhile: the pool takes no more work
            raise StoreUnavailable(f"disk {op}: tier is closed") from None

    def _check_open(self, op: str) -> ThreadPoolExecutor:
        if not self.available or self._pool is None:
            state = "closed" if self._closed else "not started" if self._pool is None else "loading"
            raise StoreUnavailable(f"disk {op}: tier is {state}")
        return self._pool

    def _get_one(self, key: str, obj: _Object) -> int:
        name = rec.file_name(key)
        if name not in self.book:
            self._count("misses")
            return MISSING
        views, addresses = obj
        nbytes = sum(v.nbytes for v in views)
        path = self._objects / name
        try:
            code = self._read(path, key, views, addresses, nbytes)
        except OSError as err:
            code = -(err.errno or errno.EIO)
        if code == MISSING:  # gone or damaged: out of the book
            if self.book.drop(name):
                self._remove([name], "damaged")
            self._count("misses")
        elif code < 0:
            self._count("failed_gets")
        else:
            self._count("keys_got", code, "bytes_got")
        return code

    def _read(
        self, path: Path, key: str, views: list[memoryview], addresses: list[int], nbytes: int
    ) -> int:
        """Read a record into the front of `views` (`nbytes` in all): the bytes read, MISSING
        (absent or damaged), or -EMSGSIZE (a record larger than the views)."""
        head = rec.header_block()
        inline, rest = rec.split(views)
        after = nbytes - (inline.nbytes if inline is not None else 0)
        try:
            fd = self._open(path, os.O_RDONLY, rest, addresses[len(views) - len(rest) :])
        except FileNotFoundError:
            return MISSING
        try:
            got = rec.read_full(fd, [head, *rest], 0)
        finally:
            os.close(fd)
        found = rec.parse_header(head) if got >= rec.HEADER else None
        if found is None or found[0] != key:
            mark("disk.record-damaged")
            return MISSING
        kept = found[2]
        if found[1] > after or kept.nbytes != (inline.nbytes if inline is not None else 0):
            return -errno.EMSGSIZE
        if inline is not None:
            inline[:] = kept
        if got != rec.HEADER + found[1]:  # shorter: a torn record
            mark("disk.record-damaged")
            return MISSING
        return nbytes - after + found[1]

    def _put_one(self, key: str, obj: _Object) -> int:
        name = rec.file_name(key)
        views, addresses = obj
        nbytes = sum(v.nbytes for v in rec.split(views)[1])  # after the header block
        if self.book.lowered:  # the file system was full: take back the room it has now
            self.book.lift(_room(self.root))
        try:
            victims = self.book.reserve(name, rec.HEADER + nbytes)
        except ValueError:
            self._count("failed_puts")
            return -errno.ENOSPC
        if victims is None:
            return 0
        if victims:
            mark("disk.evicted")
        self._remove(victims, "evicted")
        with self._count_lock:
            self._seq += 1
            tmp = self._tmp / f"{os.getpid()}.{self._seq}"
        try:
            self._write(tmp, key, views, addresses, nbytes)
            os.rename(tmp, self._objects / name)
        except OSError as err:
            tmp.unlink(missing_ok=True)
            self.book.settle(name, written=False)
            if err.errno == errno.ENOSPC:  # the file system is full before `size` is reached
                self.book.lower()
            self._count("failed_puts")
            return -(err.errno or errno.EIO)
        self.book.settle(name, written=True)
        self._count("keys_put", nbytes, "bytes_put")
        return 0

    def _write(
        self, tmp: Path, key: str, views: list[memoryview], addresses: list[int], nbytes: int
    ) -> None:
        """Write a record of `nbytes` (the file's bytes after the header block)."""
        head = rec.header_block()
        inline, rest = rec.split(views)
        rec.pack_header(head, key, nbytes, inline)
        at = addresses[len(views) - len(rest) :]
        fd = self._open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, rest, at)
        try:
            if rec.write_full(fd, [head, *rest], 0) != rec.HEADER + nbytes:
                raise OSError(errno.EIO, "short write")
            os.utime(fd, ns=(self._stamp(),) * 2)
            if self.config.sync:
                os.fdatasync(fd)
        finally:
            os.close(fd)

    def _open(self, path: Path, flags: int, views: list[memoryview], addresses: list[int]) -> int:
        """Open for one object's transfer: with O_DIRECT where its pieces are aligned enough."""
        direct = self._direct_align is not None and (
            rec.alignment(views, addresses) >= self._direct_align
        )
        self._count("direct_calls" if direct else "buffered_calls")
        return os.open(path, flags | (os.O_DIRECT if direct else 0), 0o644)

    def _stamp(self) -> int:
        """A record's time of last use, in ns: the wall clock, but always later than every stamp
        before it (file times are coarser than the order of two calls), so that a restart
        lists the records in the order of their use."""
        with self._count_lock:
            self._clock = max(time.time_ns(), self._clock + 1)
            return self._clock

    def _remove(self, names: list[str], why: str = "evicted") -> None:
        for name in names:
            try:
                os.unlink(self._objects / name)
            except FileNotFoundError:
                pass
            except OSError as err:
                log.warning("hicache disk: cannot remove %s: %s", name, os_reason(err))
        if names:
            self._count(why, n=len(names))

    def _count(self, name: str, n: int = 1, nbytes_name: str | None = None) -> None:
        """Add one (or `n`) to a counter; with `nbytes_name`, one to `name` and `n` to it."""
        with self._count_lock:
            if nbytes_name is None:
                self._counts[name] += n
            else:
                self._counts[name] += 1
                self._counts[nbytes_name] += n

    # -- stats -------------------------------------------------------------------------------

    def stats(self) -> DiskStats:
        """A snapshot of the counters."""
        with self._count_lock:
            counts = dict(self._counts)
        book = self.book
        return DiskStats(records=len(book), bytes_used=book.used, capacity=book.capacity, **counts)


def _room(path: Path) -> int:
    """Bytes an unprivileged writer may still take on the file system of `path` (0 where it
    cannot be asked)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def _lock(path: Path, where: str) -> int:
    """Take the directory's lock (flock, held until the fd closes or the process dies)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise DiskTierError(f"{where}: cannot open its lock file: {os_reason(err)}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        if holder == str(os.getpid()):
            raise DiskTierError(
                f"{where}: in use by another tier of this process; give each its own path"
            ) from None
        raise DiskTierError(
            f"{where}: in use by another process (pid {holder}); give each process its own path"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _probe(tmp: Path, want_direct: bool, where: str) -> int | None:
    """Write and sync a test record (DiskTierError if the directory takes none), and find the
    least memory alignment O_DIRECT takes here (512 or 4096), or None where it takes none."""
    import mmap

    block = memoryview(mmap.mmap(-1, 3 * rec.HEADER))
    probe = tmp / f"probe.{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            if rec.write_full(fd, [block[: 2 * rec.HEADER]], 0) != 2 * rec.HEADER:
                raise OSError(errno.EIO, "short write")
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as err:
        probe.unlink(missing_ok=True)
        raise DiskTierError(f"{where}: cannot write a record: {os_reason(err)}") from None
    found = None
    for align in (512, 4096) if want_direct else ():
        try:
            fd = os.open(probe, os.O_RDWR | os.O_DIRECT)
        except OSError:
            break  # the file system takes no O_DIRECT (tmpfs, some network file systems)
        try:
            view = block[align : align + 2 * rec.HEADER]
            if os.preadv(fd, [view], 0) == 2 * rec.HEADER and os.pwritev(fd, [view], 0):
                found = align
        except OSError:
            continue
        finally:
            os.close(fd)
        break
    probe.unlink(missing_ok=True)
    return found
