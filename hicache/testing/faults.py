"""The simulation's store tier (``type: sim``): a real store behind a gate and a fault injector.

Every call a tier's worker thread makes parks at the world's `Gate` until the simulation
releases it, with the fault it draws (or none): so calls complete late, out of order, or only at
close. Behind the gate is a real store: an in-memory object store shared by every instance that
names the same `space` (other instances at the same time, a reopened one), or the real disk
tier in a directory (`disk`, `KillableDisk`). Faults at a call: the store unreachable, an
exception, a BaseException (asyncio's CancelledError, as a plugin's asyncio code raises), code
lists too short, too long or of the wrong type, per-key failures (of the first object and every
other one, or of every other one between the first and the last: groups in the middle of a
run, the state at its end kept), wrong byte counts. A call that fails leaves poison where its
transfer failed (`POISON`): a get in the buffers of every object it does not return whole, a
put a torn object (its header whole, its payload poison) under every name it was made to fail
that the store did not hold before. Bytes served from a failed transfer are then wrong, and the
byte oracle sees them. Faults at rest (`Space.damage`, `damage_disk`: on the real disk tier's
record files): objects lost, truncated, replaced, or one byte of their payload changed (their
headers intact: only the payload's checksum can tell); the store full, down and back, a
restart that loses its contents; the process of a disk tier killed at a point of a record's
write.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch

from hicache.backends.base import Buffers, StoreTier, StoreUnavailable
from hicache.backends.disk import records
from hicache.backends.disk.tier import DiskTier
from hicache.backends.envelope import HEADER
from hicache.config import StoreTierConfig
from hicache.core.marks import mark
from hicache.registry import register_tier
from hicache.testing.oracle import Violation

MISSING = -2

CALL_FAULTS = (
    "unavailable", "exception", "cancelled", "short", "long", "wrong_type", "per_key",
    "per_key_odd", "wrong_bytes",
)  # fmt: skip
"""What a released call may be made to do instead of answering (see `_faulty`)."""
AT_REST = ("lost", "truncated", "replaced", "payload", "stray")
"""What `Space.damage` and `damage_disk` do to an object at rest."""
DAMAGED_AMONG = 8
"""Damage at rest lands on one of the objects put (or, on a disk, used) last: those a request
is likely to read soon."""
POISON = 0xA5
"""The byte a failed transfer leaves where it failed (no page or state of the oracle's is all
this byte)."""
KILL_POINTS = ("writing", "written", "renamed")
"""Where in a record's write a disk tier's process can die (see `KillableDisk`)."""


@dataclass
class Call:
    """One store call parked at the gate."""

    op: str
    tier: str
    names: tuple[str, ...]
    order: tuple[Any, ...]
    """Sorts the parked calls the same way in every run (names, then, for a get, where its
    buffers lie in the registered memory)."""
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

    def release_call(self, call: Call, fault: str | None) -> None:
        """Release `call` (one of `sorted`'s, if still parked) and its twins, with `fault`."""
        with self._cond:
            for parked in list(self.parked):
                if parked.order == call.order:
                    parked.released, parked.fault = True, fault
                    self.parked.remove(parked)
            self._cond.notify_all()

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
    on_put: Callable[[str, bytes, Sequence[tuple[int, int]], int], None] | None = None
    """The oracle's check of each object put (name, bytes, its pieces, the putting node)."""
    on_get: Callable[[str, Sequence[tuple[int, int]], int], None] | None = None
    """The check of where each object a get writes goes (name, its pieces, the reading node),
    before it is written."""
    registered: int = 0
    """Host memory registrations not yet dropped by close (the leak check reads it)."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    last_writer: int | None = None
    """The node whose put reached the store last."""
    writers: set[int] = field(default_factory=set)
    """The nodes whose tiers on this store are open now."""
    damaged: set[str] = field(default_factory=set)
    """Objects damaged at rest since they were put."""
    remote: list[str] = field(default_factory=list)
    """Objects put to a real store behind this space's tiers (Mooncake), oldest first."""
    raising: bool = False
    """The store's `available` raises (a plugin with a bug)."""
    clock: Callable[[], float] = lambda: 0.0
    """The world's clock (when a tier said it lacks an object)."""
    report: Callable[[Exception], None] = lambda err: None
    """Records a violation found on a worker thread (the world raises it at its next check)."""

    def restart(self) -> None:
        """The store node restarts: its contents are lost."""
        with self.lock:
            self.objects.clear()

    def damage(self, index: int, how: str) -> str | None:
        """Do `how` (`AT_REST`; a stray entry is a disk's only) to the object at `index` among
        the `DAMAGED_AMONG` put last (mod their number, newest first)."""
        with self.lock:
            names = list(self.objects)[::-1][:DAMAGED_AMONG]
            if not names:
                return None
            name = names[index % len(names)]
            data = self.objects[name]
            self.damaged.add(name)
            if how == "lost":
                del self.objects[name]
            elif how == "truncated":
                self.objects[name] = data[: len(data) // 2]
            elif how == "replaced":  # by other bytes of the same length
                self.objects[name] = bytes(b ^ 0x5A for b in data)
            elif how == "payload" and len(data) > HEADER:  # one byte, the header intact
                at = HEADER + index % (len(data) - HEADER)
                self.objects[name] = data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1 :]
            return name


def damage_disk(
    path: str, index: int, how: str, read: Callable[[str], bool] = lambda name: True
) -> str | None:
    """Do `how` (`AT_REST`) to the record file of the disk tier at `path` at `index` (mod their
    number) among the `DAMAGED_AMONG` used last of those whose object `read` says a request may
    read from it (its instance's host tier lacks the object's pages), under the running tier:
    lost (the file removed), truncated (to half
    its length), replaced (every byte changed: its header no longer verifies), payload (one
    byte past the record's header block changed: the record verifies, its object does not) or
    stray (a file that is no record put beside the shards: the tier's next listing meets it)."""
    if how == "stray":  # an entry that is no record (a file beside the shards)
        stray = Path(path, "objects", f"stray.{index}")
        stray.write_bytes(b"not a record")
        return stray.name
    files = [f for f in sorted(Path(path, "objects").glob("*/*")) if read(_record_key(f))]
    files.sort(key=lambda f: -f.stat().st_mtime_ns)  # the tier stamps each use, in order
    files = files[:DAMAGED_AMONG]
    if not files:
        return None
    file = files[index % len(files)]
    data = file.read_bytes()
    if how == "lost":
        file.unlink()
    elif how == "truncated":
        os.truncate(file, len(data) // 2)
    elif how == "replaced":
        file.write_bytes(bytes(b ^ 0x5A for b in data))
    elif how == "payload" and len(data) > records.HEADER:
        at = records.HEADER + index % (len(data) - records.HEADER)
        with open(file, "r+b") as f:
            f.seek(at)
            f.write(bytes([data[at] ^ 0x01]))
    return file.name


def _record_key(file: Path) -> str:
    """The name of the object a disk tier's record file holds ('' where it does not say)."""
    with open(file, "rb") as f:
        found = records.parse_header(
            memoryview(bytearray(f.read(records.HEADER)).ljust(records.HEADER, b"\0"))
        )
    return "" if found is None else found[0]


class Killed(Exception):
    """The simulated process of a disk tier died at a write point (`KillableDisk`)."""


class KillableDisk(DiskTier):
    """The real disk tier, whose process the simulation kills at a point of the next record it
    writes once armed (`kill_at`, one of `KILL_POINTS`): while writing it (half the temporary
    file written), once written (whole in ``tmp``, not renamed into place), or once in place
    (the put never answers). The put raises `Killed`; the tier is dead from then on. One I/O
    thread, so that which records of a call were written before the death does not depend on
    how threads ran."""

    kill_at: str | None = None

    def _write(self, tmp: Path, key: str, views: Any, addresses: Any, nbytes: int) -> None:
        super()._write(tmp, key, views, addresses, nbytes)
        if self.kill_at == "writing":
            os.truncate(tmp, (records.HEADER + nbytes) // 2)
        if self.kill_at in ("writing", "written"):
            self._killed()

    def _put_one(self, key: str, obj: Any) -> int:
        if self.kill_at == "dead":
            raise Killed("dead")
        held = records.file_name(key) in self.book
        code = super()._put_one(key, obj)
        if self.kill_at == "renamed" and code == 0 and not held:
            self._killed()
        return code

    def _killed(self) -> None:
        """Die here: nothing after this point runs (the call's later objects neither)."""
        point, self.kill_at = self.kill_at, "dead"
        raise Killed(point)

    def die(self) -> None:
        """What the kernel does when the process dies: its lock goes (its file descriptor
        closes), its threads stop taking work; its files stay as they are."""
        self.kill_at = "dead"
        self._closed = True
        self._unlock()
        if self._pool is not None:
            self._pool.shutdown(wait=False)


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
    node: int = 0
    """The world's node (one cache) whose tier this is."""
    prefix: bool = False
    """In memory: reads objects shorter than their buffers whatever its codec, as the disk tier
    does (the codec stays out of the objects' names). Otherwise only with a codec, as Mooncake
    does."""
    mooncake: str | None = None
    """A Mooncake master's address: the store behind the gate is a real Mooncake client of it
    (`MooncakeStore`), not the space's objects."""
    probe: bool = False
    """vLLM's scheduler's client of the store (`StoreProbe`): its `exists` answers at once,
    past the gate, with no fault."""


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
        self.inner: Any = None
        self.dead = False
        """Its disk tier's process was killed (`KillableDisk`): every call fails."""
        if config.disk is not None:
            from hicache.backends.disk.config import DiskTierConfig

            cfg = DiskTierConfig(path=config.disk, size=config.disk_size, io_threads=1, sync=False)
            self.inner = KillableDisk(cfg)
            self.shared, self.persistent = DiskTier.shared, DiskTier.persistent
            self.missing_code = DiskTier.missing_code
        elif config.mooncake is not None:
            self.inner = _mooncake(config.mooncake, config.codec)
            self.missing_code, self.reads_prefix = self.inner.missing_code, self.inner.reads_prefix
        elif config.private:
            self.shared = False
        if config.prefix:
            self.reads_prefix, self.prefix_with_codec = True, False
        self.said_absent: dict[str, float] = {}
        """Objects this tier said it lacks (an exists or a get that reached the engine thread
        unfaulted), and when: the link's books must not keep them as held from before."""
        self._registered = 0
        self._regions: list[tuple[int, int]] = []  # (address, bytes) of each registered tensor

    def empty_at_start(self) -> bool:
        return self.config.private

    def start(self) -> None:
        with self.space.lock:
            self.space.writers.add(self.config.node)
        if self.inner is not None:
            self.inner.start()

    def lose(self, index: int) -> str | None:
        """Remove the object at `index` (mod their number, in the order they were put) from the
        real store behind this tier (Mooncake)."""
        with self.space.lock:
            names = self.space.remote
            name = names.pop(index % len(names)) if names else None
        if name is not None and self.inner is not None:
            self.inner.remove([name], force=True)
        return name

    def arm(self, point: str) -> None:
        """Kill this tier's process at `point` of the next record its disk tier writes."""
        if isinstance(self.inner, KillableDisk) and not self.dead:
            self.inner.kill_at = point

    @property
    def available(self) -> bool:
        if self.space.raising:
            raise RuntimeError("sim store: available raised")
        if self.space.down or self.dead:
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
            self.space.writers.discard(self.config.node)
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
        """Park the call at the gate; the fault it is released with. Raises what a call that
        cannot start raises (the store down, its process dead)."""
        # a put's objects are its names (an encoded one lies in staging memory that the tier
        # chain aligns within its allocation: where depends on the allocation's address)
        at = tuple(tuple(map(self._where, p)) for p in buffers.ptrs) if op == "get" else ()
        order = (self.name, op, tuple(keys), at)
        fault = self.space.gate.enter(Call(op, self.name, tuple(keys), order))
        if self.space.down or self.dead:
            raise StoreUnavailable(f"sim store {self.config.space!r} is down")
        return fault

    def _raise(self, fault: str | None) -> None:
        """Raise what `fault` makes the call raise, if anything."""
        if fault == "unavailable":
            raise StoreUnavailable(f"sim store {self.config.space!r} is down")
        if fault == "exception":
            raise RuntimeError("sim store: the client library raised")
        if fault == "cancelled":  # a plugin's asyncio code, cancelled: not an Exception
            raise asyncio.CancelledError("sim store: the client's task was cancelled")

    def exists(self, keys: Sequence[str]) -> list[bool]:
        if self.config.probe:
            with self.space.lock:
                return [k in self.space.objects for k in keys]
        fault = self._enter("exists", keys, None)
        self._raise(fault)
        if self.inner is not None:
            out = self.inner.exists(keys)
        else:
            with self.space.lock:
                out = [k in self.space.objects for k in keys]
        self._absent(fault, keys, [not here for here in out])
        return _faulty(out, fault, False)  # type: ignore[return-value]

    def _absent(self, fault: str | None, keys: Sequence[str], absent: list[bool]) -> None:
        """Note the objects the tier lacks, where its answer reaches the link as it is."""
        if fault is None:
            now = self.space.clock()
            self.said_absent.update((k, now) for k, gone in zip(keys, absent) if gone)

    def get_into(self, keys: Sequence[str], buffers: Buffers) -> list[int]:
        """The objects into their buffers; every object the answer does not give whole (a
        fault's, the store's own failure, a miss; every object where the call raises) left
        holding poison."""
        on_get = self.space.on_get
        try:
            fault = self._enter("get", keys, buffers)
            if on_get is not None:  # where it writes, checked before it writes
                for i, key in enumerate(keys):
                    on_get(key, list(zip(buffers.ptrs[i], buffers.sizes[i])), self.config.node)
            self._raise(fault)
        except BaseException:
            _poison(buffers, range(len(keys)))
            raise
        if self.inner is not None:
            out = self.inner.get_into(keys, buffers)
        else:
            out = [self._get_one(k, buffers.ptrs[i], buffers.sizes[i]) for i, k in enumerate(keys)]
        self._absent(fault, keys, [code == self.missing_code for code in out])
        answer = out
        if fault == "wrong_bytes" and out:
            answer = [n - 1 if n > 0 else n for n in out]
        answer = _faulty(answer, fault, -5)
        _poison(buffers, _failed(out, answer, ok=lambda i: out[i] >= 0))
        return answer

    def _get_one(self, key: str, ptrs: list[int], sizes: list[int]) -> int:
        with self.space.lock:
            data = self.space.objects.get(key)
        if data is None:
            return MISSING
        shorter = len(data) < sum(sizes)
        if shorter and not self.reads_prefix and key not in self.space.damaged:
            self.space.report(
                Violation(f"a tier without a codec cannot read the encoded object {key[-16:]} "
                          "another instance put under a name it reads")
            )  # fmt: skip
        if len(data) > sum(sizes) or (shorter and not self.reads_prefix):
            return -1
        at = 0
        for ptr, size in zip(ptrs, sizes, strict=True):
            n = min(size, len(data) - at)
            ctypes.memmove(ptr, data[at : at + n], n)
            at += n
        return len(data)

    def put_from(self, keys: Sequence[str], buffers: Buffers) -> list[int]:
        """The objects put (unless held already); where the call is made to fail (its answer
        for an object, or the whole call), the objects it wrote are torn (`_tear`)."""
        fault = self._enter("put", keys, buffers)
        space, node = self.space, self.config.node
        on_put = space.on_put
        if on_put is not None:  # what the put reads, checked by the oracle
            for i, key in enumerate(keys):
                pieces = list(zip(buffers.ptrs[i], buffers.sizes[i], strict=True))
                data = b"".join(ctypes.string_at(p, n) for p, n in pieces)
                on_put(key, data, pieces, node)
        with space.lock:
            if space.last_writer not in (None, node) and space.last_writer in space.writers:
                mark("sim.two-writers")
            space.last_writer = node
        held = self._holds(keys)
        if self.inner is not None:
            try:
                out = self.inner.put_from(keys, buffers)
            except Killed:
                self.dead = True
                self.inner.die()
                raise StoreUnavailable("sim: the disk tier's process was killed") from None
            if self.config.mooncake is not None:
                with space.lock:
                    space.remote.extend(k for k, code in zip(keys, out) if code == 0)
        else:
            out = [self._put_one(k, buffers.ptrs[i], buffers.sizes[i]) for i, k in enumerate(keys)]
        answer = out if fault in RAISING else _faulty(out, fault, -28)
        failed = _failed(out, answer, ok=lambda i: True, raised=fault in RAISING)
        self._tear([keys[i] for i in failed if out[i] == 0 and not held[i]])
        self._raise(fault)
        return answer

    def _holds(self, keys: Sequence[str]) -> list[bool]:
        """Whether the store holds each object now (a put of one it holds writes nothing)."""
        if isinstance(self.inner, DiskTier):
            return [records.file_name(k) in self.inner.book for k in keys]
        with self.space.lock:
            return [k in self.space.objects for k in keys]

    def _tear(self, keys: list[str]) -> None:
        """The objects `keys`, just written by a put that failed, are left torn: their header
        whole, their payload poison (only the payload's checksum tells). Not on a real
        Mooncake store (its objects are the master's)."""
        if self.config.mooncake is not None or not keys:
            return
        mark("sim.poisoned-put", len(keys))
        if isinstance(self.inner, DiskTier):
            for key in keys:
                path = self.inner.root / "objects" / records.file_name(key)
                size = path.stat().st_size - records.HEADER
                with open(path, "r+b") as f:
                    f.seek(records.HEADER)
                    f.write(bytes([POISON]) * size)
            return
        with self.space.lock:
            for key in keys:
                data = self.space.objects[key]
                self.space.objects[key] = data[:HEADER] + bytes([POISON]) * (len(data) - HEADER)

    def _put_one(self, key: str, ptrs: list[int], sizes: list[int]) -> int:
        """Put an object unless the store holds one of that name already (as Mooncake does:
        the put answers 0 and writes nothing)."""
        data = b"".join(ctypes.string_at(p, n) for p, n in zip(ptrs, sizes, strict=True))
        with self.space.lock:
            objects = self.space.objects
            if key in objects:
                return 0
            if sum(len(v) for v in objects.values()) + len(data) > self.space.capacity:
                return -28
            objects[key] = data
            self.space.damaged.discard(key)
        return 0


def _mooncake(address: str, codec: str) -> Any:
    """A Mooncake client of the master at `address`, with no segment of its own (the store
    node beside the master holds the objects), as an engine's."""
    from hicache.backends.mooncake.config import MooncakeConfig
    from hicache.backends.mooncake.tier import MooncakeStore

    config = MooncakeConfig(
        master_address=address, global_segment_size=0, local_buffer_size=16 << 20,
        call_timeout_s=30.0, reconnect_backoff_s=0.2, codec=codec,
    )  # fmt: skip
    return MooncakeStore(config)


RAISING = ("unavailable", "exception", "cancelled")
"""Call faults that make the call raise (after a put has written its objects)."""


def _failed(
    out: list[int], answer: Any, ok: Callable[[int], bool], raised: bool = False
) -> list[int]:
    """The objects a call failed: every one where it `raised` or its `answer` is not one int
    per object, else each whose answer is not the store's own (`out`) or not `ok`."""
    whole = not raised and isinstance(answer, list) and len(answer) == len(out)
    if not whole:
        return list(range(len(out)))
    return [i for i, code in enumerate(answer) if code != out[i] or not ok(i)]


def _poison(buffers: Buffers, objects: Sequence[int]) -> None:
    """Fill every piece of a get's `objects` (indices into `buffers`) with `POISON`."""
    for i in objects:
        for ptr, size in zip(buffers.ptrs[i], buffers.sizes[i], strict=True):
            ctypes.memset(ptr, POISON, size)
    if objects:
        mark("sim.poisoned-get", len(objects))


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
    if fault == "per_key_odd" and out:  # a run's middle objects lost, its first and last not
        return [bad if i % 2 == 1 and i < len(out) - 1 else v for i, v in enumerate(out)]
    return out
