"""A small in-memory store tier, registered as ``type: memory``: a second store tier for chain
tests, and the tier that a test registers through the ``hicache.tiers`` entry point.

Objects live in a dict per `space`, shared by every instance of this process that names the same
space (so a second cache in the test reads what the first wrote). Bytes are really copied from
and into the host pools through their addresses. `down` makes every call raise
`StoreUnavailable` and `available` read False, as a store that lost its server; `fail` makes the
calls raise while `available` still reads True, as a store that broke since it was last seen.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from typing import ClassVar, Literal

from hicache.backends.base import Buffers, StoreTier, StoreUnavailable
from hicache.config import StoreTierConfig
from hicache.registry import register_tier

MISSING = -2


class MemoryConfig(StoreTierConfig):
    type: Literal["memory"] = "memory"
    space: str = "default"
    """Instances naming the same space share their objects."""
    capacity: int = 1 << 30
    """Bytes held at most; a put beyond it is refused (a negative code)."""


class PrivateMemoryConfig(MemoryConfig):
    type: Literal["memory_private"] = "memory_private"  # type: ignore[assignment]


@register_tier("memory", MemoryConfig)
class MemoryTier(StoreTier):
    shared = True
    persistent = False
    missing_code = MISSING
    read_gbps = 1.0
    reads_prefix = True  # a shorter object is read into the front of its buffers

    spaces: ClassVar[dict[str, dict[str, bytes]]] = {}
    calls: ClassVar[dict[str, list[tuple[str, int]]]] = {}
    """Per space: (call, number of keys), in order."""

    def __init__(self, config: MemoryConfig) -> None:
        self.config = config
        self.objects = self.spaces.setdefault(config.space, {})
        self.log = self.calls.setdefault(config.space, [])
        self.down = False
        self.fail = False
        self._lock = threading.Lock()

    def start(self) -> None:
        pass

    @property
    def available(self) -> bool:
        return not self.down

    def register(self, memory: object) -> None:
        pass

    def _check(self, op: str, n: int) -> None:
        self.log.append((op, n))
        if self.down or self.fail:
            raise StoreUnavailable(f"memory tier {self.config.space!r} is down")

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self._check("exists", len(keys))
        return [k in self.objects for k in keys]

    def get_into(self, keys: Sequence[str], buffers: Buffers) -> list[int]:
        self._check("get", len(keys))
        out = []
        for i, key in enumerate(keys):
            data = self.objects.get(key)
            if data is None:
                out.append(MISSING)
                continue
            if len(data) > buffers.nbytes(i):
                out.append(-1)
                continue
            at = 0
            for ptr, size in zip(buffers.ptrs[i], buffers.sizes[i]):
                n = min(size, len(data) - at)
                ctypes.memmove(ptr, data[at : at + n], n)
                at += n
            out.append(len(data))
        return out

    def put_from(self, keys: Sequence[str], buffers: Buffers) -> list[int]:
        self._check("put", len(keys))
        out = []
        for i, key in enumerate(keys):
            data = b"".join(
                ctypes.string_at(ptr, size) for ptr, size in zip(buffers.ptrs[i], buffers.sizes[i])
            )
            with self._lock:
                held = sum(len(v) for v in self.objects.values())
                if key not in self.objects and held + len(data) > self.config.capacity:
                    out.append(-1)
                    continue
                self.objects[key] = data
            out.append(0)
        return out

    def close(self) -> None:
        pass


@register_tier("memory_private", PrivateMemoryConfig)
class PrivateMemoryTier(MemoryTier):
    """The same store, declared private: neither shared nor persistent, so the chain trusts
    its own books of what it put there."""

    shared = False
