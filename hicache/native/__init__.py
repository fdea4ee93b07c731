"""The compiled page-key chain, built with the system C compiler at first use and cached.

`chain_keys(seed, pages)` is the fast path of `hicache.keys`; `available()` says whether it could
be built and loaded. On x86-64 CPUs with the SHA extensions it hashes pages two at a time with
SHA-NI; elsewhere it uses OpenSSL's SHA-256 (`force_portable` makes it do so anyway, for tests).
Where it cannot be built or loaded (no compiler, no OpenSSL in the process), `hicache.keys`
computes the same bytes in Python, about three times slower.
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
from functools import cache
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    """Where compiled helpers are kept: $HICACHE_CACHE_DIR, else ~/.cache/hicache."""
    root = os.environ.get("HICACHE_CACHE_DIR") or Path.home() / ".cache" / "hicache"
    return Path(root)


def build(source_name: str, flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """Compile `source_name` (a C file of this package) into a shared library and load it.

    The library is cached under `cache_dir()` by a digest of the source, the flags and the
    platform, so it is built once per machine. Returns None (and logs why) when no C compiler is
    found or the build fails; callers then take their pure-Python path.
    """
    source = Path(__file__).with_name(source_name)
    text = source.read_bytes()
    tag = hashlib.sha256(text + " ".join(flags).encode() + sys.platform.encode()).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}-{tag}.so"
    if not target.exists():
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            log.warning("hicache: no C compiler found for %s; using the Python path", source.name)
            return None
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            cmd = [compiler, "-O2", *flags, "-shared", "-fPIC", "-o", str(built), str(source)]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                log.warning("hicache: building %s failed: %s", source.name, done.stderr.strip())
                return None
            os.replace(built, target)  # atomic: concurrent builders all end with one good file
    return ctypes.CDLL(str(target))


@cache
def _library() -> tuple[ctypes.CDLL, tuple[int, int, int]] | None:
    sha256 = _openssl_sha256()
    if sha256 is None:
        log.info("hicache: OpenSSL's SHA256 not found in this process; keys hashed in Python")
        return None
    lib = build("chainhash.c")
    if lib is None:
        return None
    lib.hicache_chain.restype = ctypes.c_int
    lib.hicache_chain.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_char_p,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_size_t,
        ctypes.c_void_p,
    ]
    lib.hicache_chain_force_portable.restype = ctypes.c_int
    lib.hicache_chain_force_portable.argtypes = [ctypes.c_int]
    return lib, sha256


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
    """True when the compiled chain is built and loaded."""
    return _library() is not None


def force_portable(on: bool) -> bool:
    """Make `chain_keys` use OpenSSL even where SHA-NI is available (tests; not thread-safe).

    Returns True when `chain_keys` uses SHA-NI from now on; False also when it is not built.
    """
    loaded = _library()
    return loaded is not None and bool(loaded[0].hicache_chain_force_portable(int(on)))


def chain_keys(seed: bytes, pages: np.ndarray) -> bytes | None:
    """Keys of `pages` (a C-contiguous [n, page_tokens] int32 array) chained from `seed`.

    The format is `hicache.keys`'s; every path (SHA-NI, OpenSSL, Python) gives the same bytes.

    Returns n * 16 bytes, or None when the compiled helper is not available.
    """
    loaded = _library()
    if loaded is None:
        return None
    lib, sha256 = loaded
    n = pages.shape[0]
    # a numpy buffer, not ctypes.create_string_buffer: that makes a new ctypes type for every
    # distinct length (tens of microseconds a call on a real prompt mix)
    out = np.empty(16 * n, dtype=np.uint8)
    lib.hicache_chain(*sha256, seed, pages.ctypes.data, pages.shape[1] * 4, n, out.ctypes.data)
    return out.tobytes()


@cache
def _prefix_library() -> ctypes.CDLL | None:
    lib = build("prefix.c")
    if lib is not None:
        lib.hicache_common_prefix.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        lib.hicache_common_prefix.restype = ctypes.c_size_t
    return lib


def common_tokens(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens two C-contiguous int32 arrays share (compiled where possible)."""
    n = min(a.shape[0], b.shape[0])
    lib = _prefix_library()
    if lib is None:
        diff = np.flatnonzero(a[:n] != b[:n])
        return int(diff[0]) if diff.size else n
    same = lib.hicache_common_prefix(a.ctypes.data, b.ctypes.data, 4 * n)
    return same // 4
