"""Page keys, the layout fingerprint and the L3 key format.

A page key names a whole prefix: ``key[i] = H(key[i-1] || tokens of page i)`` with ``key[-1] =
H(namespace)``, H being SHA-256 truncated to 16 bytes and tokens hashed as int32 little-endian.
Keys are the same in every process and on every machine (no Python ``hash()``), so instances
share pages; a cryptographic H means nobody can craft a prompt whose key collides with another's.

The namespace is the layout fingerprint plus an optional tenant salt: two engines share pages
only where every byte-relevant property of their layouts is equal and they use the same salt.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from hicache import native
from hicache.config import Layout

FORMAT_VERSION = 1
"""hicache's own format version: bump it when the bytes of a page or a state change meaning."""

KEY_BYTES = 16
HASH_NAME = "sha256-16"

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def _digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()[:KEY_BYTES]


def model_digest(config: dict[str, Any]) -> str:
    """A short stable digest of a model's config (for example its parsed config.json).

    Use it as, or inside, `Layout.model` so that engines with different models never share.
    """
    canon = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canon.encode()).hexdigest()[:16]


def fingerprint(layout: Layout) -> bytes:
    """16 bytes naming everything that makes pages incompatible.

    The model, KV dtype(s), page_tokens, page and segment sizes, state_bytes, the TP rank and
    size where KV is sharded by head, the hash, and hicache's format version.
    """
    fields = {
        "format": FORMAT_VERSION,
        "hash": HASH_NAME,
        "model": layout.model,
        "kv_dtype": layout.kv_dtype,
        "page_tokens": layout.page_tokens,
        "segments": list(layout.segment_bytes),
        "state_bytes": layout.state_bytes,
        "tp": [layout.tp_rank, layout.tp_size] if layout.kv_head_sharded else None,
    }
    return _digest(json.dumps(fields, sort_keys=True).encode())


def chain_seed(fingerprint_: bytes, salt: str | bytes | None = None) -> bytes:
    """``key[-1]``: the digest of the namespace (fingerprint and tenant salt)."""
    if isinstance(salt, str):
        salt = salt.encode()
    if salt is not None and not isinstance(salt, bytes):
        raise TypeError(f"salt must be str, bytes or None, got {type(salt).__name__}")
    tail = b"" if salt is None else b"\x01" + _digest(salt)
    return _digest(b"hicache-ns\x00" + fingerprint_ + tail)


def as_tokens(tokens: Any) -> np.ndarray:
    """Tokens as a 1-D C-contiguous int32 array; ValueError naming the problem if they can't be.

    Accepts a sequence of ints, a numpy array or a CPU torch tensor. Token ids must fit int32.
    """
    if hasattr(tokens, "numpy") and hasattr(tokens, "device"):  # a torch tensor
        if tokens.device.type != "cpu":
            raise ValueError(f"tokens must be on the CPU, got a tensor on {tokens.device}")
        tokens = tokens.numpy()
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {arr.shape}")
    if arr.dtype == np.int32:
        return np.ascontiguousarray(arr)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int32)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < _INT32_MIN or hi > _INT32_MAX:
        bad = lo if lo < _INT32_MIN else hi
        raise ValueError(f"token id {bad} is outside int32")
    return arr.astype(np.int32)


def page_keys(seed: bytes, tokens: np.ndarray, page_tokens: int) -> list[bytes]:
    """Keys of every full page of `tokens` (int32), chained from `seed`."""
    n = tokens.shape[0] // page_tokens
    if n == 0:
        return []
    pages = np.ascontiguousarray(tokens[: n * page_tokens]).reshape(n, page_tokens)
    if pages.dtype.byteorder == ">":
        pages = pages.astype("<i4")
    raw = native.chain_keys(seed, pages)
    if raw is None:
        return _page_keys_python(seed, pages)
    return np.frombuffer(raw, dtype=f"V{KEY_BYTES}").tolist()


def _page_keys_python(seed: bytes, pages: np.ndarray) -> list[bytes]:
    keys, prev = [], seed
    data = memoryview(pages.tobytes())
    size = pages.shape[1] * 4
    for i in range(pages.shape[0]):
        h = hashlib.sha256(prev)
        h.update(data[i * size : (i + 1) * size])
        prev = h.digest()[:KEY_BYTES]
        keys.append(prev)
    return keys


class KeyChain:
    """The tokens of one sequence and the keys of its full pages.

    A prompt is hashed once; `extend` hashes only the new full pages, from the last key.
    """

    __slots__ = ("keys", "page_tokens", "seed", "tokens")

    def __init__(self, seed: bytes, page_tokens: int, tokens: np.ndarray) -> None:
        self.seed = seed
        self.page_tokens = page_tokens
        self.tokens = tokens
        self.keys: list[bytes] = page_keys(seed, tokens, page_tokens)

    def extend(self, tokens: np.ndarray) -> None:
        """Grow to `tokens`, which must start with the tokens held now."""
        have = self.tokens.shape[0]
        if tokens.shape[0] < have or not np.array_equal(tokens[:have], self.tokens):
            raise ValueError(
                "tokens must extend the request's earlier tokens (the prompt given to match)"
            )
        self.tokens = tokens
        done = len(self.keys) * self.page_tokens
        prev = self.keys[-1] if self.keys else self.seed
        self.keys.extend(page_keys(prev, tokens[done:], self.page_tokens))


def l3_key(prefix: str, fingerprint_: bytes, key: bytes, group: int | None) -> str:
    """The object name of a page group (named by its last page's key) or, with group None, a state.

    ``<prefix>/<fingerprint hex>/g<G>/<key hex>`` or ``<prefix>/<fingerprint hex>/s/<key hex>``.
    """
    kind = "s" if group is None else f"g{group}"
    return f"{prefix}/{fingerprint_.hex()}/{kind}/{key.hex()}"


def hex_keys(keys: Sequence[bytes]) -> list[str]:
    """Keys as hex strings (for logs and events)."""
    return [k.hex() for k in keys]
