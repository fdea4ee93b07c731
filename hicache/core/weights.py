"""The weights by content: a digest over every byte of every weight file, remembered by file.

A fine-tune merged and written over its base keeps the files' names, sizes and config; only a
digest of every byte tells it apart. Reading a checkpoint costs what the disk gives (the
digest itself runs at several GB/s a core: docs/identity.md has the figure), so each file's
digest is remembered across restarts in hicache's cache directory (`cache_dir`), by the file's
identity: its resolved path, size, mtime, ctime, inode and device. An unchanged checkpoint is
read once; a file written in place (its mtime or ctime moves) or replaced (another inode) is
read again.

A file is hashed in chunks of `CHUNK` bytes, each by SHA-256 on its own (the chunks of one file
are hashed side by side, on `workers` threads: hashlib lets go of the GIL), and the file's
digest is SHA-256 over its size and its chunks' digests.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hicache.core.native import cache_dir

log = logging.getLogger("hicache.weights")

WEIGHT_SUFFIXES = frozenset({".safetensors", ".bin", ".pt", ".pth", ".gguf"})
"""The files whose bytes are the weights (in the model's folder, not below it)."""
CHUNK = 64 << 20
"""Bytes of a file hashed as one piece (pieces of one file are hashed side by side)."""
READ = 4 << 20
"""Bytes read at a time."""
MEMO_FILE = "weights-digests.json"
"""The remembered digests' file in `cache_dir()`."""
MEMO_ENTRIES = 4096
"""Files remembered at most (the oldest entries go first)."""


def weight_files(folder: str | Path) -> list[Path]:
    """The weight files in `folder`, by name; empty where it is not a directory."""
    root = Path(folder)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())


def weights_digest(folder: str | Path, workers: int | None = None, memo: bool = True) -> str:
    """32 hex digits naming every byte of every weight file in `folder` (``*.safetensors``,
    ``*.bin``, ``*.pt``, ``*.pth``, ``*.gguf``) and their names; '' where `folder` is not a
    directory or holds no weight files. `memo`: take and keep each file's digest in the cache
    directory by the file's identity (path, size, mtime, ctime, inode, device)."""
    files = weight_files(folder)
    if not files:
        return ""
    remembered = _load_memo() if memo else {}
    h = hashlib.sha256(b"hicache-weights\x00")
    changed = False
    for path in files:
        ident = _file_identity(path)
        digest = remembered.get(ident)
        if digest is None:
            digest = file_digest(path, workers)
            remembered[ident] = digest
            changed = True
        name = path.name.encode()
        h.update(len(name).to_bytes(2, "little") + name + bytes.fromhex(digest))
    if memo and changed:
        _save_memo(remembered)
    return h.hexdigest()[:32]


def file_digest(path: str | Path, workers: int | None = None) -> str:
    """SHA-256 (hex) over the file's size and the SHA-256 of each of its `CHUNK`-byte pieces,
    the pieces hashed on up to `workers` threads (default: the CPUs, at most 8)."""
    size = os.stat(path).st_size
    starts = range(0, max(size, 1), CHUNK)
    workers = workers or min(8, os.cpu_count() or 1)
    if workers == 1 or len(starts) == 1:
        parts = [_chunk_digest(path, at, size) for at in starts]
    else:
        with ThreadPoolExecutor(min(workers, len(starts))) as pool:
            parts = list(pool.map(lambda at: _chunk_digest(path, at, size), starts))
    h = hashlib.sha256(b"hicache-weight-file\x00" + size.to_bytes(8, "little"))
    for part in parts:
        h.update(part)
    return h.hexdigest()


def _chunk_digest(path: str | Path, at: int, size: int) -> bytes:
    h = hashlib.sha256()
    end = min(at + CHUNK, size)
    buf = bytearray(READ)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        f.seek(at)
        while at < end:
            n = f.readinto(view[: min(READ, end - at)])
            if not n:
                raise OSError(f"{path}: ended at byte {at} of {size} while it was hashed")
            h.update(view[:n])
            at += n
    return h.digest()


def _file_identity(path: Path) -> str:
    st = path.stat()
    return json.dumps(
        [str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]
    )


def _memo_path() -> Path:
    return cache_dir() / MEMO_FILE


def _load_memo() -> dict[str, str]:
    try:
        data = json.loads(_memo_path().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _save_memo(entries: dict[str, str]) -> None:
    """Write the remembered digests whole (a new file renamed over the old: processes that
    write at once each leave a whole file, the last one's)."""
    keep = dict(list(entries.items())[-MEMO_ENTRIES:])
    path = _memo_path()
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(keep))
        os.replace(tmp, path)
    except OSError as err:  # a read-only home: the digests are only not remembered
        log.warning("hicache: cannot remember the weights' digests in %s: %s", path, err)
