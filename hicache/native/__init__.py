"""The compiled page-key chain, built with the system C compiler at first use and cached.

`chain_keys(seed, pages)` is the fast path of `hicache.keys`; `available()` says whether it could
be built and loaded. Where it cannot (no compiler, no OpenSSL in the process), `hicache.keys`
computes the same bytes in Python, about 2.5 times slower.
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

_SOURCE = Path(__file__).with_name("chainhash.c")


def cache_dir() -> Path:
    """Where compiled helpers are kept: $HICACHE_CACHE_DIR, else ~/.cache/hicache."""
    root = os.environ.get("HICACHE_CACHE_DIR") or Path.home() / ".cache" / "hicache"
    return Path(root)


@cache
def _library() -> tuple[ctypes.CDLL, tuple[int, int, int]] | None:
    sha256 = _openssl_sha256()
    if sha256 is None:
        log.info("hicache: OpenSSL's SHA256 not found in this process; keys hashed in Python")
        return None
    source = _SOURCE.read_bytes()
    tag = hashlib.sha256(source + sys.platform.encode()).hexdigest()[:16]
    target = cache_dir() / f"chainhash-{tag}.so"
    if not target.exists():
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            log.warning("hicache: no C compiler found; page keys are hashed in Python (slower)")
            return None
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            cmd = [compiler, "-O2", "-shared", "-fPIC", "-o", str(built), str(_SOURCE)]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                log.warning("hicache: building %s failed: %s", _SOURCE.name, done.stderr.strip())
                return None
            os.replace(built, target)  # atomic: concurrent builders all end with one good file
    lib = ctypes.CDLL(str(target))
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


def chain_keys(seed: bytes, pages: np.ndarray) -> bytes | None:
    """Keys of `pages` (a C-contiguous [n, page_tokens] int32 array) chained from `seed`.

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
