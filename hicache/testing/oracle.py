"""What the right bytes are, and the record of what went wrong.

A page's KV is a function of its namespace (tenant salt, LoRA adapter, the multimodal features
that start before its end), of what the engine's bytes depend on beyond the request (its KV
format, its TP rank's shard: `Content.identity`) and of its tokens up to its end, as a model's
is; a state likewise at its boundary. The simulation's engine writes exactly that (`page`,
`state`), and checks every byte it loads against it. Every byte of a page depends on all of
these and on its offset in the page (so on its layer and on K or V): a page whose layers, halves
or bytes were moved reads wrong. The oracle also learns which page key the cache gave each page
it stored (`learn`): a key that two different pages got is a violation at once (namespaces or
prompts alias), and every object put to a store tier is checked against the pages its name says
it holds (`check_put`).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hicache.backends import envelope
from hicache.backends.codec import Codec
from hicache.core.checksum import checksum_bytes


class Violation(AssertionError):
    """An invariant broke; the message says which."""


@dataclass(frozen=True)
class Content:
    """What a request's tokens mean: its tokens and its namespace."""

    tokens: tuple[int, ...]
    salt: str | None = None
    lora: str | None = None
    images: tuple[tuple[str, int, int], ...] = ()
    """(content hash, offset, length) of each multimodal feature."""
    identity: str = ""
    """What the engine's bytes depend on beyond the request: its KV format, its TP rank's
    shard of the heads (two engines that differ here write other bytes for the same prompt)."""

    def digest(self, end: int) -> bytes:
        """The identity of the page (or state) ending at token `end`."""
        h = hashlib.sha256(repr((self.salt, self.lora, self.identity)).encode())
        for image in self.images:
            if image[1] < end:
                h.update(repr(image).encode())
        h.update(np.asarray(self.tokens[:end], dtype=np.int64).tobytes())
        return h.digest()

    def extended(self, more: Sequence[int]) -> Content:
        return Content(self.tokens + tuple(more), self.salt, self.lora, self.images, self.identity)


COMPRESSIBLE_HIGH = 0x3C
"""In a compressible world, the high byte of every 16-bit value is this or one of the next
three (as bf16 KV's sign and exponent bytes take few values), so that the codec's byte planes
shrink it; the low bytes stay as drawn."""


def expand(digest: bytes, size: int, tag: bytes = b"", compressible: bool = False) -> np.ndarray:
    """`size` bytes drawn from `digest` by an extendable-output hash: each depends on the digest
    and on its offset, with no period (a byte moved anywhere else in the page reads wrong). Never
    all zeros, so a page never written shows. `compressible`: the odd bytes are narrowed to 4
    values (`COMPRESSIBLE_HIGH`), still drawn from the digest and the offset. Read-only."""
    out = np.frombuffer(hashlib.shake_128(tag + digest).digest(size), dtype=np.uint8)
    if compressible:
        out = out.copy()
        out[1::2] = COMPRESSIBLE_HIGH | (out[1::2] & 3)
        out.flags.writeable = False
    return out


MADE_PAGES = 4096
"""Pages the oracle keeps once made (the oldest made goes first)."""


class Oracle:
    """Expected bytes by page key, learnt from the stores; `page_bytes` / `state_bytes` sizes."""

    def __init__(
        self, page_bytes: int, state_bytes: int, page_tokens: int, compressible: bool = False
    ) -> None:
        self.page_bytes, self.state_bytes, self.P = page_bytes, state_bytes, page_tokens
        self.compressible = compressible
        self._made: dict[bytes, np.ndarray] = {}  # pages made lately, by digest (read-only)
        self.pages: dict[bytes, bytes] = {}  # page key -> digest of the page
        self.prev: dict[bytes, bytes] = {}  # page key -> the key of the page before it
        self.depth: dict[bytes, int] = {}  # page key -> its page index

    def page(self, content: Content, end: int) -> np.ndarray:
        return self._page(content.digest(end))

    def state(self, content: Content, end: int) -> np.ndarray:
        return self._state(content.digest(end))

    def _page(self, digest: bytes) -> np.ndarray:
        page = self._made.get(digest)
        if page is None:
            if len(self._made) >= MADE_PAGES:
                self._made.pop(next(iter(self._made)))
            page = self._made[digest] = expand(digest, self.page_bytes, b"", self.compressible)
        return page

    def _state(self, digest: bytes) -> np.ndarray:
        return expand(digest, self.state_bytes, b"state", self.compressible)

    def learn(self, keys: Sequence[bytes], content: Content, what: str) -> None:
        """The cache keyed the pages of `content` with `keys` (page i ends at (i+1)*P)."""
        prev = None
        for i, key in enumerate(keys):
            digest = content.digest((i + 1) * self.P)
            known = self.pages.setdefault(key, digest)
            if known != digest:
                raise Violation(
                    f"{what}: page {i} got key {key.hex()[:16]}, which names another page"
                )
            if prev is not None:
                self.prev[key] = prev
            self.depth[key] = i
            prev = key

    def expected_page(self, key: bytes) -> np.ndarray | None:
        digest = self.pages.get(key)
        return None if digest is None else self._page(digest)

    def expected_state(self, key: bytes) -> np.ndarray | None:
        digest = self.pages.get(key)
        return None if digest is None else self._state(digest)

    def check_put(self, name: str, data: bytes) -> None:
        """An object put to a store tier holds what its name says: a group of pages ending at
        its key (``.../g<G>/<key>``) or the state there (``.../s/<key>``), behind a header that
        describes it (`hicache.backends.envelope`)."""
        parts = name.split("/")
        kind, key = parts[-2], bytes.fromhex(parts[-1])
        data = payload(name, data)
        if kind == "s":
            want = self.expected_state(key)
            if want is not None and data != want.tobytes():
                raise Violation(f"put of state {parts[-1][:16]}: wrong bytes")
            return
        G = int(kind[1:])
        keys = [key]
        while len(keys) < G and keys[-1] in self.prev:
            keys.append(self.prev[keys[-1]])
        if len(keys) < G or len(data) != G * self.page_bytes:
            return  # not a group the oracle learnt whole
        for j, k in enumerate(reversed(keys)):
            want = self.expected_page(k)
            got = data[j * self.page_bytes : (j + 1) * self.page_bytes]
            if want is not None and got != want.tobytes():
                raise Violation(
                    f"put of group {parts[-1][:16]}: page {j} of {G} has wrong bytes "
                    "(read before its copy completed, or another page's)"
                )


_HEADER = struct.Struct("<4sBBHQQQ")
"""An object's header (`hicache.backends.envelope`): magic, version, codec, flags, raw bytes,
stored bytes, checksum of the raw bytes."""


def payload(name: str, data: bytes) -> bytes:
    """The raw payload of object `name` as put (`data`: header, then the payload as stored,
    decoded where its codec encoded it); a Violation where the header does not describe it."""
    if len(data) < envelope.HEADER:
        raise Violation(f"put of {name[-16:]}: {len(data)} bytes, shorter than a header")
    magic, version, codec, flags, raw, stored, value = _HEADER.unpack_from(data)
    body = data[envelope.HEADER :]
    if (magic, version) != (envelope.MAGIC, envelope.VERSION) or stored != len(body):
        raise Violation(f"put of {name[-16:]}: its header does not describe its payload")
    if codec != envelope.CODEC_NONE and flags != envelope.RAW:
        out = np.empty(raw, dtype=np.uint8)
        if not Codec(codec).decode(codec, np.frombuffer(body, dtype=np.uint8), out):
            raise Violation(f"put of {name[-16:]}: its payload does not decode")
        body = out.tobytes()
    if len(body) != raw or checksum_bytes(body, envelope.seed(name)) != value:
        raise Violation(f"put of {name[-16:]}: its header's checksum or length is wrong")
    return body
