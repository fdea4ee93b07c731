"""Page keys, the layout fingerprint and the store object names.

A page key names a whole prefix: ``key[i] = SHA-256(key[i-1] || SHA-256(page i))[:16]`` with
``key[-1] = SHA-256(namespace)[:16]``, a page being its tokens as int32 little-endian. The page
digests do not depend on each other, so on CPUs with the SHA extensions the compiled chain
hashes pages two at a time and only the one-block step over ``key[i-1] || digest`` (48 bytes)
is sequential. Keys are the same in every process and on every machine (no Python ``hash()``),
so instances share pages; a cryptographic hash means nobody can craft a prompt whose key
collides with another's.

The namespace is the layout fingerprint plus an optional tenant salt: two engines share pages
only where every byte-relevant property of their layouts is equal and they use the same salt.
"""

from __future__ import annotations

import hashlib
import json
import re
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from hicache.config import Layout
from hicache.core import native
from hicache.core.marks import mark

FORMAT_VERSION = 1
"""hicache's own format version: bump it when the bytes of a page or a state change meaning."""

KEY_BYTES = 16
HASH_NAME = "sha256-16/page-sha256"
"""The key formula's name; it is in the fingerprint, so keys of another formula never mix."""

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


def _field(tag: bytes, value: bytes) -> bytes:
    """`value` tagged with `tag`, each behind its length: a run of fields parses one way only."""
    return len(tag).to_bytes(2, "little") + tag + len(value).to_bytes(8, "little") + value


def namespace(**fields: str | None) -> bytes | None:
    """A request's namespace fields (a tenant salt, a LoRA adapter's name and path, ...) in one
    encoding, to give `match` and `store` as the salt: each field's name and value behind their
    lengths, in name order; None fields are left out (None when all are). The encoding is
    injective: no value of one field (a client's salt, say) can make the encoding of another
    set of fields, so two namespaces share a page only where every field is equal."""
    given = {name: value for name, value in fields.items() if value is not None}
    if not given:
        return None
    out = [b"hicache-fields\x00"]
    for name in sorted(given):
        value = given[name]
        if not isinstance(value, str):
            raise TypeError(f"namespace field {name!r} must be str or None, got {type(value)}")
        out.append(_field(name.encode(), value.encode()))
    return b"".join(out)


FOLD_BITS = 31
"""Bits of a feature's hash that each word of a folded page carries (`fold_features`)."""
FEATURE_BITS = 128
"""Bits of a feature's whole hash that every page it touches carries at the least: a page of
P tokens folds FOLD_BITS x P, so pages of fewer than 5 tokens take `features_salt` too."""


def fold_features(
    tokens: Sequence[int],
    first_token: int,
    page_tokens: int,
    features: Sequence[tuple[int, int, str]],
) -> list[int]:
    """Tokens as the page keys see them where multimodal features (``(offset, length,
    identifier)``: a placeholder range and the full hash of its content) lie among them.

    `tokens` are the request's tokens from `first_token` (a page boundary) on. Each full page
    that a feature overlaps becomes ``page_tokens`` words drawn (SHAKE-256) from the page's own
    tokens and, for every feature overlapping it, its offset from the page's start, its length
    and its whole identifier, all bits: two pages agree only where their tokens and every
    feature's identifier and position agree (the words hold `FOLD_BITS` each, so a page of P
    tokens carries 31 x P bits of them: pages of fewer than 5 tokens carry less than
    `FEATURE_BITS`, and their requests' namespace takes the rest: `features_salt`). The words are
    negative int32 (no token id is), so such a page never keys as a page of text. Other pages,
    and a trailing partial page (never keyed), are kept as they are."""
    if first_token % page_tokens:
        raise ValueError(f"first_token={first_token} is not a page boundary ({page_tokens})")
    out = list(tokens)
    end = first_token + len(out)
    touched: dict[int, list[tuple[int, int, str]]] = {}
    for offset, length, identifier in features:
        lo, hi = max(offset, first_token), min(offset + length, end)
        if hi > lo:
            for page in range(lo // page_tokens, (hi - 1) // page_tokens + 1):
                touched.setdefault(page, []).append((offset, length, identifier))
    for page, on_page in touched.items():
        start = page * page_tokens
        if start + page_tokens > end:
            continue  # partial: not keyed
        i = start - first_token
        words = array("i", out[i : i + page_tokens]).tobytes()
        parts = [b"hicache-mm-page\x00", _field(b"tokens", words)]
        for offset, length, identifier in sorted(on_page):
            where = (offset - start).to_bytes(8, "little", signed=True)
            parts.append(_field(b"at", where + length.to_bytes(8, "little")))
            parts.append(_field(b"id", identifier.encode()))
        digest = hashlib.shake_256(b"".join(parts)).digest(4 * page_tokens)
        out[i : i + page_tokens] = [
            -1 - (int.from_bytes(digest[4 * k : 4 * k + 4], "little") & 0x7FFFFFFF)
            for k in range(page_tokens)
        ]
    return out


def features_salt(
    salt: bytes | None, page_tokens: int, features: Sequence[tuple[int, int, str]]
) -> bytes | None:
    """A request's salt (`namespace`) once its multimodal features (``(offset, length,
    identifier)``, as `fold_features` takes them) are accounted for: `salt` itself where it has
    none or its pages fold at least `FEATURE_BITS` of each (5 tokens a page and more); else a
    namespace of `salt` and a digest (SHA-256) of every feature's position, length and whole
    identifier, so that every page of the request, those the features touch included, is keyed
    by their whole hashes. The price, at such page sizes only: a request with features shares
    no page with one whose features (or their positions) differ, not even a page before the
    first of them."""
    if not features or FOLD_BITS * page_tokens >= FEATURE_BITS:
        return salt
    if page_tokens == 1:
        mark("keys.images-on-one-token-pages")
    h = hashlib.sha256(b"hicache-mm-request\x00")
    for offset, length, identifier in sorted(features):
        at = offset.to_bytes(8, "little", signed=True) + length.to_bytes(8, "little")
        h.update(_field(b"at", at) + _field(b"id", identifier.encode()))
    return namespace(request=None if salt is None else salt.hex(), features=h.hexdigest())


def as_tokens(tokens: Any) -> np.ndarray:
    """Tokens as a 1-D C-contiguous int32 array; ValueError naming the problem if they can't be.

    Accepts a sequence of ints, a numpy array or a CPU torch tensor. Token ids must fit int32.
    """
    if type(tokens) is np.ndarray and tokens.dtype == np.int32 and tokens.ndim == 1:
        return tokens if tokens.flags.c_contiguous else np.ascontiguousarray(tokens)
    if isinstance(tokens, list | tuple):  # what engines pass: one C loop, and the GIL is kept
        return _list_tokens(tokens)
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


def _list_tokens(tokens: list | tuple) -> np.ndarray:
    """A list of token ids as int32, through `array('i')`: faster than numpy's conversion to
    int64 and cast (which releases the GIL for prompts of more than a few hundred tokens)."""
    try:
        return np.frombuffer(array("i", tokens), dtype=np.int32)
    except OverflowError:
        bad = next(t for t in tokens if not _INT32_MIN <= t <= _INT32_MAX)
        raise ValueError(f"token id {bad} is outside int32") from None
    except TypeError:
        bad = next(t for t in tokens if not isinstance(t, int))
        if isinstance(bad, list | tuple | np.ndarray):
            raise ValueError("tokens must be 1-D, got a nested sequence") from None
        raise ValueError(f"token ids must be integers, got {type(bad).__name__}") from None


def page_keys(
    seed: bytes, tokens: np.ndarray, page_tokens: int, release_gil: bool = False
) -> list[bytes]:
    """Keys of every full page of `tokens` (int32), chained from `seed`. `release_gil`: let
    other threads run while the compiled chain hashes (for worker threads)."""
    n = tokens.shape[0] // page_tokens
    if n == 0:
        return []
    pages = np.ascontiguousarray(tokens[: n * page_tokens]).reshape(n, page_tokens)
    if pages.dtype.byteorder == ">":
        pages = pages.astype("<i4")
    raw = native.chain_keys(seed, pages, release_gil)
    if raw is None:
        return _page_keys_python(seed, pages)
    return np.frombuffer(raw, dtype=f"V{KEY_BYTES}").tolist()


def _page_keys_python(seed: bytes, pages: np.ndarray) -> list[bytes]:
    """`page_keys` without the compiled chain: the same bytes, from hashlib."""
    keys, prev = [], seed
    data = memoryview(pages.tobytes())
    size = pages.shape[1] * 4
    sha256 = hashlib.sha256
    for i in range(pages.shape[0]):
        prev = sha256(prev + sha256(data[i * size : (i + 1) * size]).digest()).digest()[:KEY_BYTES]
        keys.append(prev)
    return keys


class KeyChain:
    """The tokens of one sequence and the keys of its full pages, hashed when first asked for.

    Each page is hashed at most once, from the last key hashed: `hash_to(n)` hashes only the
    pages it has not hashed yet. With a `PrefixMemo`, the pages a sequence shares with a recent
    one are not hashed at all. So `match` hashes a prompt only as far as the tiers could hit, and
    `store` hashes the rest.

    The chain holds its own copy of the tokens, never the caller's array: an engine may reuse
    or change its token buffer at once (a copy of a 128k-token prompt takes about 50 us, once
    per request and per growth). The array held is never changed in place (growing replaces
    it), so views of it stay valid.

    Attributes (read them; only the chain's methods change them): `tokens`, the int32 tokens
    held; `pages`, the full pages in them; `hashed`, the keys hashed so far, those of the first
    ``len(hashed)`` pages (a caller that hashed the pages right after them from ``hashed[-1]``,
    or the seed, may add their keys at its end: see `append`).
    """

    __slots__ = ("hashed", "page_tokens", "pages", "seed", "tokens")

    def __init__(
        self, seed: bytes, page_tokens: int, tokens: np.ndarray, memo: PrefixMemo | None = None
    ) -> None:
        self.seed = seed
        self.page_tokens = page_tokens
        # a copy made with the GIL kept (a bytearray's): numpy lets go of it to copy an array
        # of more than a few hundred elements, which would let a hicache worker cut into the
        # engine-thread call (the README's engine contract)
        self.tokens = tokens = np.frombuffer(bytearray(tokens), dtype=np.int32)
        self.pages: int = tokens.shape[0] // page_tokens
        self.hashed: list[bytes] = memo.shared_keys(seed, tokens) if memo is not None else []

    def hash_to(self, n: int) -> list[bytes]:
        """Hash the first `n` full pages (at most `pages`) if they are not yet; returns `hashed`
        itself (slice it to keep the keys of a moment: the chain grows it in place)."""
        keys = self.hashed
        have = len(keys)
        if n > have:
            P = self.page_tokens
            prev = keys[-1] if keys else self.seed
            keys += page_keys(prev, self.tokens[have * P : min(n, self.pages) * P], P)
        return keys

    def append(self, keys: list[bytes]) -> None:
        """Take the keys of the pages right after `hashed`, hashed elsewhere from `hashed[-1]`
        (or the seed) in this format: a fetch's worker hashes the pages it fetches."""
        if len(self.hashed) + len(keys) > self.pages:
            raise ValueError("more keys than the chain has full pages")
        self.hashed += keys

    def try_extend(self, tokens: np.ndarray) -> bool:
        """Grow to `tokens` (a copy of them) if they start with the tokens held now; False (and
        nothing changed) if they do not. Always compared: the caller may have changed its
        array in place since."""
        # compiled (numpy releases the GIL to compare arrays this long, which would let a
        # hicache worker cut into the engine-thread call that asks)
        held = self.tokens.shape[0]
        if tokens.shape[0] < held or native.common_tokens(tokens, self.tokens) != held:
            return False
        if tokens.shape[0] > held:
            self.tokens = np.frombuffer(bytearray(tokens), dtype=np.int32)  # (as __init__)
            self.pages = tokens.shape[0] // self.page_tokens
        return True


class PrefixMemo:
    """Recent sequences' tokens and keys, so that a prompt is hashed only past what it shares.

    In a conversation or an agent loop each prompt starts with the previous one; hashing that
    start again costs most of `match`. The memo keeps the last `max_sequences` sequences, grouped
    by their seed and first page. A new prompt is compared token by token (numpy, ~20 times
    faster than hashing) with those that begin like it, and the keys of the longest shared run of
    full pages are reused. Reused keys are exactly what hashing would give: tokens are compared,
    never keys. Engine thread only.
    """

    def __init__(self, page_tokens: int, max_sequences: int = 256, per_head: int = 4) -> None:
        self.page_tokens = page_tokens
        self.max_sequences = max_sequences
        self.per_head = per_head
        self._heads: OrderedDict[bytes, list[KeyChain]] = OrderedDict()
        self._count = 0
        self.reused_pages = 0

    def shared_keys(self, seed: bytes, tokens: np.ndarray) -> list[bytes]:
        """Keys of the longest run of leading full pages `tokens` shares with a remembered one."""
        P = self.page_tokens
        limit = tokens.shape[0] // P
        if not limit:
            return []
        head = seed + tokens[:P].tobytes()  # the group: the seed and the first page
        chains = self._heads.get(head)
        if not chains:
            return []
        self._heads.move_to_end(head)
        best: list[bytes] = []
        for chain in chains:  # most recent first
            pages = min(len(chain.hashed), limit)
            if pages <= len(best):
                continue
            b = len(best) * P  # to beat `best`, the chain must share the page after it too
            if best and not np.array_equal(chain.tokens[b : b + P], tokens[b : b + P]):
                continue
            n = pages * P
            same = native.common_tokens(chain.tokens[:n], tokens[:n]) // P
            if same > len(best):
                best = chain.hashed[:same]
                if same == limit:
                    break
        self.reused_pages += len(best)
        return best

    def remember(self, chain: KeyChain) -> None:
        """Keep `chain` (a finished request's) for later prompts; the oldest go first."""
        if not chain.hashed:  # (so it holds a full page at least)
            return
        head = chain.seed + chain.tokens[: self.page_tokens].tobytes()
        chains = self._heads.setdefault(head, [])
        self._heads.move_to_end(head)
        mine = chain.tokens
        for i, old in enumerate(chains):
            theirs = old.tokens
            same = native.common_tokens(theirs, mine)
            more_keys = len(chain.hashed) >= len(old.hashed)
            if same == mine.shape[0] and not more_keys:
                return  # a remembered sequence already covers this one
            if same == theirs.shape[0] and more_keys:  # this one extends it: replace
                del chains[i]
                self._count -= 1
                break
        chains.insert(0, chain)
        self._count += 1
        if len(chains) > self.per_head:
            chains.pop()
            self._count -= 1
        while self._count > self.max_sequences:
            _, dropped = self._heads.popitem(last=False)
            self._count -= len(dropped)


def store_key(
    prefix: str, fingerprint_: bytes, key: bytes, group: int | None, tenant: str = ""
) -> str:
    """The object name of a page group (named by its last page's key) or, with group None, a state.

    ``<prefix>/<fingerprint hex>/g<G>/<key hex>`` or ``<prefix>/<fingerprint hex>/s/<key hex>``;
    a tenant's objects (`tenant`, its name) carry it after the fingerprint,
    ``<prefix>/<fingerprint hex>/~<tenant>/g<G>/<key hex>``, so that a store tier can keep each
    tenant's share and quota from the names alone (`object_tenant`).
    """
    kind = "s" if group is None else f"g{group}"
    owner = f"~{tenant}/" if tenant else ""
    return f"{prefix}/{fingerprint_.hex()}/{owner}{kind}/{key.hex()}"


_OWNER = re.compile(r"/~([\w.\-]+)/(?:s|g\d+)/[0-9a-f]*$")


def object_tenant(name: str) -> str:
    """The tenant an object's name (`store_key`) names, or "" for the objects of no tenant."""
    found = _OWNER.search(name)
    return found.group(1) if found else ""
