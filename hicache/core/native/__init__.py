"""hicache's C helpers: one library, built with the system C compiler at first use and cached.

What is in it, and who uses it:

- the page-key chain (`chain_keys`, the fast path of `hicache.core.keys`): on x86-64 CPUs with the
  SHA extensions it hashes pages two at a time with SHA-NI; elsewhere it uses OpenSSL's SHA-256
  (`force_portable` makes it do so anyway, for tests);
- the key index (`index.py` over ``keyindex.c``) and its walk (``walk.c``), which hashes and
  looks up pairs of pages until the first miss;
- the slot books (`books.py` over ``slotbook.c``): pins, LRU order and free list of a slot pool;
- the prefix compare of the prefix memo (`common_tokens`), the CPU page copy and the block-id
  checks and gathers of the cache's copies (``copyrows.c``: numpy releases the GIL for array
  operations of more than a few hundred elements, and the engine thread must not);
- the checksum of stored objects (``checksum.c``, `hicache.core.checksum`), on worker threads.
- the byte planes of the lossless codec (``planes.c``, `hicache.backends.codec`), on worker threads.

`library()` loads it with its signatures declared; calls keep the GIL unless the caller asks for
the variant that drops it (long calls from worker threads). Loading happens once per variant, at
start-up (`available()`; the key index loads it when it is made). The engine thread's helpers
here (`chain_keys`, `bad_id`, `align_slots`, `common_tokens`, ...) then find the loaded library in
the loader's cache (a C call, no Python frame) and make one C call each, and the index and the
books (`index.py`, `books.py`) hold the C functions they call: an engine-thread operation is one
Python call around one C call.

Where it cannot be built or loaded (no compiler, no OpenSSL in the process), every user has a
Python path that gives the same results, slower; `available()` says whether the chain is
compiled. Any failure to build or load it (no compiler, ``CC`` pointing nowhere, an unwritable
cache directory, sources missing from the installed package) is one warning and the Python
paths; ``HICACHE_NO_NATIVE=1`` takes the Python paths without trying.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from array import array
from collections.abc import Sequence
from functools import cache
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    """Where compiled helpers are kept: $HICACHE_CACHE_DIR, else ~/.cache/hicache."""
    root = os.environ.get("HICACHE_CACHE_DIR") or Path.home() / ".cache" / "hicache"
    return Path(root)


SOURCES = (
    "chainhash.c",
    "keyindex.c",
    "prefix.c",
    "walk.c",
    "slotbook.c",
    "copyrows.c",
    "checksum.c",
    "planes.c",
)
"""The C files of this package, built into one library (they share native.h)."""


def build(
    sources: tuple[str, ...] = SOURCES,
    flags: tuple[str, ...] = (),
    *,
    release_gil: bool = True,
    directory: Path | None = None,
) -> ctypes.CDLL | None:
    """Compile `sources` (C files in `directory`, by default this package's) into one shared
    library and load it.

    The library is cached under `cache_dir()` by a digest of the sources, the directory's
    headers, the flags and the platform, so it is built once per machine. Returns None (and
    logs one warning that says why) when it cannot be built or loaded; callers then take their
    pure-Python path.

    With `release_gil` (ctypes' usual CDLL) every call drops the GIL while it runs; without it
    (a PyDLL over the same library) calls keep it.
    """
    if not enabled():
        return None
    target = _built(sources, flags, directory or Path(__file__).parent)
    if target is None:
        return None
    try:
        return (ctypes.CDLL if release_gil else ctypes.PyDLL)(target)
    except OSError as err:
        log.warning("hicache: loading the C helpers failed (%s); using the Python paths", err)
        return None


DISABLE_ENV = "HICACHE_NO_NATIVE"
"""Set to 1 to take the Python paths without building or loading the C helpers."""


def enabled() -> bool:
    """False where $HICACHE_NO_NATIVE turns the C helpers off (any value but empty or 0)."""
    return os.environ.get(DISABLE_ENV, "") in ("", "0")


@cache
def _built(sources: tuple[str, ...], flags: tuple[str, ...], here: Path) -> str | None:
    """The path of the compiled library, built now if it is not cached; None (logged once)
    where it cannot be built."""
    try:
        return _build(sources, flags, here)
    except OSError as err:  # unreadable sources, unwritable cache, a compiler that won't run
        log.warning("hicache: C helpers unavailable (%s); using the Python paths (slower)", err)
        return None


def _build(sources: tuple[str, ...], flags: tuple[str, ...], here: Path) -> str | None:
    digest = hashlib.sha256(" ".join(flags).encode() + sys.platform.encode())
    for path in (*(here / name for name in sources), *sorted(here.glob("*.h"))):
        digest.update(path.read_bytes())
    target = cache_dir() / f"hicache-native-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return str(target)
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("hicache: no C compiler found; using the Python paths (slower)")
        return None
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        files = [str(here / name) for name in sources]
        cmd = [compiler, "-O2", *flags, "-shared", "-fPIC", "-o", str(built), *files]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            log.warning(
                "hicache: building the C helpers failed (%s); using the Python paths (slower)",
                _one_line(done.stderr) or f"{compiler} exited {done.returncode}",
            )
            return None
        os.replace(built, target)  # atomic: concurrent builders all end with one good file
    return str(target)


def _one_line(text: str, limit: int = 300) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def library(release_gil: bool = False) -> ctypes.CDLL | None:
    """The compiled helpers with their signatures declared, or None where they can't be built.

    By default calls keep the GIL: the engine thread's calls take microseconds, and a call that
    dropped the GIL would let a worker thread take it and run Python for as long as it likes
    before the engine thread gets it back. `release_gil=True` is for the long calls that worker
    threads make (hashing a fetch's pages), so that the engine thread runs meanwhile.
    """
    # one cache entry per variant, however it is asked for: loading (file reads, dlopen)
    # releases the GIL, so it must happen once, at start-up, never in an engine-thread call
    return _load(bool(release_gil))


@cache
def _load(release_gil: bool) -> ctypes.CDLL | None:
    """`library(release_gil)`; the engine thread's helpers below call it directly (a hit in
    its cache is a C call: no Python frame) with a bool, so they share `library`'s entry."""
    lib = build(release_gil=release_gil)
    if lib is None:
        return None
    p, i64, u64, size = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64, ctypes.c_size_t
    signatures = {
        "hicache_chain": (ctypes.c_int, [p, p, p, ctypes.c_char_p, p, size, size, p]),
        "hicache_chain_force_portable": (ctypes.c_int, [ctypes.c_int]),
        "hicache_index_find": (i64, [p, u64, ctypes.c_char_p, i64, p, ctypes.c_int]),
        "hicache_index_insert": (i64, [p, u64, ctypes.c_char_p, p, i64, p]),
        "hicache_index_remove": (i64, [p, u64, ctypes.c_char_p, i64]),
        "hicache_common_prefix": (size, [p, p, size]),
        "hicache_walk": (i64, [p, p, p, ctypes.c_char_p, p, size, size, p, u64, p, p, p]),
        "hicache_books_pin": (i64, [p, p, i64]),
        "hicache_books_unpin": (i64, [p, p, i64]),
        "hicache_books_reserve": (i64, [p, i64, p, p, p]),
        "hicache_books_publish": (i64, [p, p, ctypes.c_char_p, i64, p]),
        "hicache_books_lru": (i64, [p, p]),
        "hicache_copy_pages_cpu": (None, [p, p, i64, p, p, i64]),
        "hicache_index_split": (i64, [p, u64, ctypes.c_char_p, i64, p, p]),
        "hicache_ids_int32": (i64, [p, ctypes.c_int, i64, i64, p]),
        "hicache_gather_int32": (None, [p, p, i64, p]),
        "hicache_align_slots": (ctypes.c_int, [p, p, i64]),
        "hicache_checksum": (u64, [p, p, i64, u64]),
        "hicache_planes_split": (None, [p, i64, p, p]),
        "hicache_planes_merge": (None, [p, p, i64, p]),
    }
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def chain_library(release_gil: bool = False) -> tuple[ctypes.CDLL, tuple[int, int, int]] | None:
    """The library and OpenSSL's SHA-256 functions, which the chain and the walk need where
    SHA-NI is not; None where either is missing. Loads them the first time (start-up)."""
    return _load_chain(bool(release_gil))


@cache
def _load_chain(release_gil: bool) -> tuple[ctypes.CDLL, tuple[int, int, int]] | None:
    """`chain_library(release_gil)`, cached; `chain_keys` calls it directly, as `_load`."""
    sha256 = _openssl_sha256()
    if sha256 is None:
        log.info("hicache: OpenSSL's SHA256 not found in this process; keys hashed in Python")
        return None
    lib = library(release_gil)
    return None if lib is None else (lib, sha256)


def _openssl_sha256() -> tuple[int, int, int] | None:
    """Addresses of SHA256_Init/_Update/_Final in the libcrypto that hashlib uses, if any."""
    try:
        import _hashlib  # noqa: F401  (loads libcrypto into the process)
    except ImportError:
        return None
    path = None
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                if "libcrypto" in line:
                    path = line.split()[-1]
                    break
    except OSError:
        return None
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path)
        names = ("SHA256_Init", "SHA256_Update", "SHA256_Final")
        return tuple(ctypes.cast(getattr(lib, n), ctypes.c_void_p).value for n in names)
    except (OSError, AttributeError):
        return None


def available() -> bool:
    """True when the compiled chain is built and loaded (loading both variants of the library
    if they are not yet: call it at start-up)."""
    return chain_library(True) is not None and chain_library() is not None


def force_portable(on: bool) -> bool:
    """Make `chain_keys` use OpenSSL even where SHA-NI is available (tests; not thread-safe).

    Returns True when `chain_keys` uses SHA-NI from now on; False also when it is not built.
    """
    loaded = chain_library()
    return loaded is not None and bool(loaded[0].hicache_chain_force_portable(int(on)))


def address(arr: np.ndarray | bytearray) -> int:
    """The address of the first byte of a C-contiguous array (or a bytearray), for a compiled
    call.

    About 0.6 µs where ``arr.ctypes.data`` takes 1.7 (it builds a helper object at every
    access), and the engine thread's calls take a few addresses each. Read-only and empty arrays
    take the slower way."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(arr))
    except (TypeError, ValueError):  # read-only, or no bytes to point at
        return arr.ctypes.data if isinstance(arr, np.ndarray) else 0  # (a bytearray: empty)


def chain_keys(seed: bytes, pages: np.ndarray, release_gil: bool = False) -> bytes | None:
    """Keys of `pages` (a C-contiguous [n, page_tokens] int32 array) chained from `seed`.

    The format is `hicache.core.keys`'s; every path (SHA-NI, OpenSSL, Python) gives the same bytes.
    `release_gil`: drop the GIL while hashing (worker threads; see `library`).

    Returns n * 16 bytes, or None when the compiled helper is not available.
    """
    loaded = _load_chain(bool(release_gil))
    if loaded is None:
        return None
    lib, sha256 = loaded
    n = pages.shape[0]
    if n == 0:
        return b""
    # a bytearray, not ctypes.create_string_buffer: that makes a new ctypes type for every
    # distinct length (tens of microseconds a call on a real prompt mix)
    out = bytearray(16 * n)
    at = ctypes.addressof(ctypes.c_char.from_buffer(out))
    lib.hicache_chain(*sha256, seed, address(pages), pages.shape[1] * 4, n, at)
    return bytes(out)


def ids_int32(ids: np.ndarray, limit: int) -> tuple[np.ndarray, int] | None:
    """`ids` (a C-contiguous int32 or int64 array) as a new int32 array, and the position of the
    first id outside [0, `limit`) (-1 when there is none). None where the helpers are not
    compiled or for another dtype: the caller takes numpy's way."""
    lib = _load(False)
    if lib is None or ids.dtype not in (np.int32, np.int64) or not ids.flags.c_contiguous:
        return None
    out = np.empty(ids.shape[0], dtype=np.int32)
    wide = int(ids.dtype == np.int64)
    bad = lib.hicache_ids_int32(address(ids), wide, ids.shape[0], limit, address(out))
    return out, bad


def bad_id(ids: array, limit: int) -> int:
    """The position of the first id of an `array('i')` outside [0, `limit`), or -1 (checked in
    place: no copy, no numpy)."""
    lib = _load(False)
    if lib is None:
        return next((k for k, i in enumerate(ids) if not 0 <= i < limit), -1)
    address = ids.buffer_info()[0]
    return lib.hicache_ids_int32(address, 0, len(ids), limit, address)


def gather_int32(ids: np.ndarray, at: Sequence[int]) -> np.ndarray:
    """``ids[at]`` for a C-contiguous int32 array and positions the caller knows are in range."""
    lib = _load(False)
    if lib is None:
        return ids[np.asarray(at, dtype=np.intp)]
    positions = array("i", at)
    out = np.empty(len(positions), dtype=np.int32)
    lib.hicache_gather_int32(address(ids), positions.buffer_info()[0], len(positions), address(out))
    return out


def align_slots(ids: np.ndarray, slots: list[int]) -> array:
    """Fresh `slots` for the pages in blocks `ids` (C-contiguous int32, as many), as an
    `array('i')`, reordered to ascend where the ids ascend and descend where they descend, so
    that a copy of consecutive blocks into consecutive slots merges their rows (the copy
    engines' cost is per row). In the order given when the ids run neither way, or without the
    compiled helpers."""
    ordered = array("i", slots)
    lib = _load(False)
    if lib is not None and len(ordered) > 1:
        lib.hicache_align_slots(address(ids), ordered.buffer_info()[0], len(ordered))
    return ordered


def common_tokens(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens two C-contiguous int32 arrays share (compiled where possible)."""
    n = min(a.shape[0], b.shape[0])
    lib = _load(False)
    if lib is None:
        diff = np.flatnonzero(a[:n] != b[:n])
        return int(diff[0]) if diff.size else n
    same = lib.hicache_common_prefix(address(a), address(b), 4 * n)
    return same // 4
