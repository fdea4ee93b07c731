"""The simulation's store tier (``type: sim``): a real store behind a gate and a fault injector.

Every call a tier's worker thread makes parks at the world's `Gate` until the simulation
releases it, with the fault it draws (or none): so calls complete late, out of order, or only at
close. Behind the gate is a real store: an in-memory object store shared by every instance that
names the same `space` (a second instance, a reopened one), or the real disk tier in a directory
(`disk`). Faults at a call: the store unreachable, an exception, code lists too short, too long
or of the wrong type, per-key failures, wrong byte counts. Faults at rest (`Space`): objects
lost, truncated or replaced, the store full, down and back, a restart that loses its contents.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch

from hicache.backends.base import Buffers, StoreTier, StoreUnavailable
from hicache.config import StoreTierConfig
from hicache.registry import register_tier

MISSING = -2

CALL_FAULTS = (
    "unavailable", "exception", "short", "long", "wrong_type", "per_key", "wrong_bytes",
)  # fmt: skip
"""What a released call may be made to do instead of answering (see `_faulty`)."""


@dataclass
class Call:
    """One store call parked at the gate."""

    op: str
    tier: str
    names: tuple[str, ...]
    order: tuple[Any, ...]
    """Sorts the parked calls the same way in every run (names, then where the buffers lie in
    the registered memory)."""
    released: bool = False
    fault: str | None = None
    thread: str = field(default_factory=lambda: threading.current_thread().name)


class Gate:
    """Where worker threads' store calls wait for the simulation. `auto`: let them through
    (at teardown, and for tools that do not drive the calls)."""

    def __init__(self) -> None:
        self.auto = False
        self.parked: list[Call] = []
        self._cond = threading.Condition()

    def enter(self, call: Call) -> str | None:
        """Park `call` (a worker thread) until released; the fault to apply, if any."""
        with self._cond:
            if self.auto:
                return None
            self.parked.append(call)
            while not call.released and not self.auto:
                self._cond.wait()
            if call in self.parked:
                self.parked.remove(call)
            return call.fault

    def sorted(self) -> list[Call]:
        with self._cond:
            return sorted(self.parked, key=lambda c: c.order)

    def release(self, index: int, fault: str | None) -> Call | None:
        """Release the parked call at `index` (mod their number, in `sorted` order) and its
        identical twins, with `fault`. None when none is parked."""
        with self._cond:
            calls = sorted(self.parked, key=lambda c: c.order)
            if not calls:
                return None
            chosen = calls[index % len(calls)]
            for call in calls:
                if call.order == chosen.order:
                    call.released, call.fault = True, fault
                    self.parked.remove(call)
            self._cond.notify_all()
            return chosen

    def open(self) -> None:
        """Let every call through from now on."""
        with self._cond:
            self.auto = True
            self._cond.notify_all()


@dataclass
class Space:
    """One simulated store: its objects (in memory), its gate and its state at rest."""

    gate: Gate = field(default_factory=Gate)
    objects: dict[str, bytes] = field(default_factory=dict)
    down: bool = False
    capacity: int = 1 << 30
    on_put: Callable[[str, bytes, Sequence[tuple[int, int]]], None] | None = None
    """The oracle's check of each object put (name, bytes, its pieces)."""
    registered: int = 0
    """Host memory registrations not yet dropped by close (the leak check reads it)."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def restart(self) -> None:
        """The store node restarts: its contents are lost."""
        with self.lock:
            self.objects.clear()

    def damage(self, index: int, how: str) -> str | None:
        """Lose, truncate or replace the object at `index` (mod their number, in name order)."""
        with self.lock:
            names = sorted(self.objects)
            if not names:
                return None
            name = names[index % len(names)]
            data = self.objects[name]
            if how == "lost":
                del self.objects[name]
            elif how == "truncated":
                self.objects[name] = data[: len(data) // 2]
            else:  # replaced by other bytes of the same length
                self.objects[name] = bytes(b ^ 0x5A for b in data)
            return name


SPACES: dict[str, Space] = {}
"""The simulated stores of this process by name (a world registers its own)."""


class SimTierConfig(StoreTierConfig):
    type: Literal["sim"] = "sim"
    space: str
    """The `Space` (in `SPACES`) whose gate and objects this tier uses."""
    disk: str | None = None
    """A directory: the store behind the gate is the real disk tier there (not the space's
    objects)."""
    disk_size: int = 1 << 20
    private: bool = False
    """In memory, declared neither shared nor persistent: it starts empty and only this
    instance writes it (the tier chain, and vLLM's scheduler, trust their own books of it)."""


@register_tier("sim", SimTierConfig)
class SimTier(StoreTier):
    """See the module docstring. Shared (in memory) or persistent (on disk), as its store."""

    shared = True
    persistent = False
    missing_code = MISSING
    read_gbps: ClassVar[float] = 1.0
    prefix_with_codec = True

    def __init__(self, config: SimTierConfig) -> None:
        self.config = config
        self.reads_prefix = config.codec != "none"  # the disk tier's always does
        self.space = SPACES[config.space]
        self.name = config.name or config.type
        self.inner: StoreTier | None = None
        if config.disk is not None:
            from hicache.backends.disk.config import DiskTierConfig
            from hicache.backends.disk.tier import DiskTier

            cfg = DiskTierConfig(path=config.disk, size=config.disk_size, io_threads=2, sync=False)
            self.inner = DiskTier(cfg)
            self.shared, self.persistent = DiskTier.shared, DiskTier.persistent
            self.missing_code = DiskTier.missing_code
        elif config.private:
            self.shared = False
        self._registered = 0
        self._regions: list[tuple[int, int]] = []  # (address, bytes) of each registered tensor

    def empty_at_start(self) -> bool:
        return self.config.private

    def start(self) -> None:
        if self.inner is not None:
            self.inner.start()

    @property
    def available(self) -> bool:
        if self.space.down:
            return False
        return self.inner is None or self.inner.available

    def register(self, memory: object) -> None:
        if self.inner is not None:
            self.inner.register(memory)
        if isinstance(memory, torch.Tensor):
            self._regions.append((memory.data_ptr(), memory.numel() * memory.element_size()))
        with self.space.lock:
            self.space.registered += 1
            self._registered += 1

    def close(self) -> None:
        with self.space.lock:
            self.space.registered -= self._registered
            self._registered = 0
        if self.inner is not None:
            self.inner.close()

    # -- calls ------------------------------------------------------------------------------

    def _where(self, ptr: int) -> tuple[int, int]:
        """An address as (registered region, offset): the same in every run, unlike the address."""
        for i, (base, size) in enumerate(self._regions):
            if base <= ptr < base + size:
                return i, ptr - base
        return -1, 0

    def _enter(self, op: str, keys: Sequence[str], buffers: Buffers | None) -> str | None:
        at = tuple(tuple(map(self._where, p)) for p in buffers.ptrs) if buffers else ()
        order = (self.name, op, tuple(keys), at)
        fault = self.space.gate.enter(Call(op, self.name, tuple(keys), order))
        if self.space.down or fault == "unavailable":
            raise StoreUnavailable(f"sim store {self.config.space!r} is down")
        if fault == "exception":
            raise RuntimeError("sim store: the client library raised")
        return fault

    def exists(self, keys: Sequence[str]) -> list[bool]:
        fault = self._enter("exists", keys, None)
        if self.inner is not None:
            out = self.inner.exists(keys)
        else:
            with self.space.lock:
                out = [k in self.space.objects for k in keys]
        return _faulty(out, fault, False)  # type: ignore[return-value]

    def get_into(self, keys: Sequence[str], buffers: Buffers) -> list[int]:
        fault = self._enter("get", keys, buffers)
        if self.inner is not None:
            out = self.inner.get_into(keys, buffers)
        else:
            out = [self._get_one(k, buffers.ptrs[i], buffers.sizes[i]) for i, k in enumerate(keys)]
        if fault == "wrong_bytes" and out:
            out = [n - 1 if n > 0 else n for n in out]
        return _faulty(out, fault, -5)

    def _get_one(self, key: str, ptrs: list[int], sizes: list[int]) -> int:
        with self.space.lock:
            data = self.space.objects.get(key)
        if data is None:
            return MISSING
        if len(data) > sum(sizes) or (len(data) < sum(sizes) and not self.reads_prefix):
            return -1
        at = 0
        for ptr, size in zip(ptrs, sizes, strict=True):
            n = min(size, len(data) - at)
            ctypes.memmove(ptr, data[at : at + n], n)
            at += n
        return len(data)

    def put_from(self, keys: Sequence[str], buffers: Buffers) -> list[int]:
        fault = self._enter("put", keys, buffers)
        on_put = self.space.on_put
        if on_put is not None:  # what the put reads, checked by the oracle
            for i, key in enumerate(keys):
                pieces = list(zip(buffers.ptrs[i], buffers.sizes[i], strict=True))
                data = b"".join(ctypes.string_at(p, n) for p, n in pieces)
                on_put(key, data, pieces)
        if self.inner is not None:
            out = self.inner.put_from(keys, buffers)
        else:
            out = [self._put_one(k, buffers.ptrs[i], buffers.sizes[i]) for i, k in enumerate(keys)]
        return _faulty(out, fault, -28)

    def _put_one(self, key: str, ptrs: list[int], sizes: list[int]) -> int:
        data = b"".join(ctypes.string_at(p, n) for p, n in zip(ptrs, sizes, strict=True))
        with self.space.lock:
            objects = self.space.objects
            held = sum(len(v) for v in objects.values())
            if key not in objects and held + len(data) > self.space.capacity:
                return -28
            objects[key] = data
        return 0


def _faulty(out: list[Any], fault: str | None, bad: Any) -> Any:
    """`out` as a faulty store would answer it."""
    if fault == "short":
        return out[:-1]
    if fault == "long":
        return [*out, out[-1] if out else bad]
    if fault == "wrong_type":
        return None if len(out) % 2 else tuple(str(v) for v in out)
    if fault == "per_key" and out:
        return [bad if i % 2 == 0 else v for i, v in enumerate(out)]
    return out
