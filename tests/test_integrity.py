"""Bytes changed at rest in a store tier are misses, counted, never hits (issue 40, item 9).

Every store tier kind keeps its objects across engines: the in-memory plugin tier from tests/
(through the chain, as any tier from another package), a disk directory, and a Mooncake store
node on a real master on loopback. A writer stores prompts; their objects are then changed where
they rest; a fresh engine (its own empty host tier) asks for them. `FakeEngine.run` checks every
byte it loads, so a wrong byte served fails the test; the stats must count each object that did
not verify (`corrupt_<tier>`), and prompts left alone must still hit, byte-exact.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from fake_engine import FakeEngine, FakeStates, config
from memory_tier import MemoryTier
from test_chain import settle

from hicache.backends.base import Buffers
from hicache.backends.disk.records import HEADER as DISK_HEADER
from hicache.backends.disk.records import file_name
from hicache.backends.envelope import HEADER

pytestmark = pytest.mark.mooncake

PAGE = 1024  # bytes of a page; 4 tokens a page, groups of 2 pages
GROUP = 2 * PAGE
KINDS = ["memory", "disk", "mooncake"]


def prompt(seed: int, n: int = 42) -> np.ndarray:
    """10 full pages: 5 groups."""
    return np.random.default_rng(seed).integers(0, 50_000, n).astype(np.int32)


def tier_config(kind: str, master, tmp_path: Path) -> dict:
    cfg = config(page_bytes=PAGE, host_pages=64)
    if kind == "memory":
        tier: dict = {"type": "memory", "space": uuid.uuid4().hex}
    elif kind == "disk":
        tier = {"type": "disk", "path": str(tmp_path / "d"), "size": "64MiB"}
    else:
        tier = {"type": "mooncake", **master.tier_config, "key_prefix": uuid.uuid4().hex[:12]}
    cfg["tiers"].append({**tier, "group_pages": 2})
    return cfg


class Writer:
    """An engine that stores prompts and records the names of the objects it put."""

    def __init__(self, cfg: dict, states: FakeStates | None = None) -> None:
        self.engine = FakeEngine(cfg, states=states)
        self.store = self.engine.cache._chain.links[0].store
        self.names: list[str] = []
        real = self.store.put_from

        def spy(names: list[str], buffers: Buffers) -> list[int]:
            self.names.extend(names)
            return real(names, buffers)

        self.store.put_from = spy
        self.buffer = torch.zeros(1 << 20, dtype=torch.uint8)
        """Memory for reading and writing objects by hand (registered with the store)."""
        self.store.register(self.buffer)

    def stored(self, tokens: np.ndarray) -> list[str]:
        """Store `tokens`; the names of the objects it put."""
        before = len(self.names)
        self.engine.run(f"w{before}", tokens)
        settle(self.engine)
        return self.names[before:]


def rewrite(kind: str, writer: Writer, name: str, change: Callable[[bytes], bytes]) -> None:
    """Replace the bytes of object `name`, where it rests, by `change` of them. The disk tier's
    records are changed in their file, after the record's header block (so `change` must keep
    the length); the others' objects whole."""
    store = writer.store
    if kind == "disk":
        path = Path(store.root) / "objects" / file_name(name)
        data = path.read_bytes()
        new = change(data[DISK_HEADER:])
        assert len(new) == len(data) - DISK_HEADER
        path.write_bytes(data[:DISK_HEADER] + new)
        return
    replace(kind, writer, name, change(read(kind, writer, name)))


def read(kind: str, writer: Writer, name: str) -> bytes:
    """The bytes of object `name` in a memory or Mooncake tier."""
    store = writer.store
    if kind == "memory":
        assert isinstance(store, MemoryTier)
        return store.objects[name]
    # Mooncake reads an object only into its exact size, unless it reads prefixes (a codec)
    sizes = [writer.buffer.numel()] if store.reads_prefix else [GROUP + HEADER, GROUP]
    for size in sizes:
        got = store.get_into([name], Buffers.of([[(writer.buffer.data_ptr(), size)]]))[0]
        if got > 0:
            return bytes(writer.buffer[:got].numpy())
    raise AssertionError(f"cannot read {name}: {got}")


def replace(kind: str, writer: Writer, name: str, data: bytes) -> None:
    """Make `data` the bytes of object `name` in a memory or Mooncake tier."""
    store = writer.store
    if kind == "memory":
        store.objects[name] = data
        return
    assert store.remove([name], force=True) == [0]
    writer.buffer[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    assert store.put_from([name], Buffers.of([[(writer.buffer.data_ptr(), len(data))]])) == [0]


def flip_middle(data: bytes) -> bytes:
    """16 bytes in the middle of `data`, inverted."""
    mid = len(data) // 2 - 8
    out = bytearray(data)
    out[mid : mid + 16] = bytes(b ^ 0xFF for b in out[mid : mid + 16])
    return bytes(out)


@pytest.fixture
def engines() -> Iterator[Callable[[dict], FakeEngine]]:
    made: list[FakeEngine] = []

    def make(cfg: dict) -> FakeEngine:
        e = FakeEngine(cfg)
        made.append(e)
        return e

    yield make
    for e in made:
        e.cache.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_payload_changed_at_rest_is_a_counted_miss_never_a_hit(
    kind, mooncake_master, tmp_path, engines
):
    """16 bytes flipped in the middle of every object of one prompt: a fresh engine loads none
    of them (it would fail on the first wrong byte) and counts each; another prompt left alone
    hits whole, byte-exact."""
    cfg = tier_config(kind, mooncake_master, tmp_path)
    writer = Writer(cfg)
    try:
        p, q = prompt(1), prompt(2)
        changed = writer.stored(p)
        assert len(changed) == 5
        assert len(writer.stored(q)) == 5
        for name in changed:
            rewrite(kind, writer, name, flip_middle)
    finally:
        writer.engine.cache.close()

    reader = engines(cfg)
    m = reader.run("r", p)  # checks every loaded byte
    assert m.hit_tokens == 0
    settle(reader)
    s = reader.cache.stats()
    assert s[f"corrupt_{kind}"] == 5
    assert reader.run("r2", q).hit_tokens == 40  # untouched: every page, byte-exact


def test_a_state_is_never_published_at_the_end_of_a_shorter_run_than_its_own():
    """A state layout, groups of 2 pages: a writer stores a 10-page prompt (5 groups and the
    state at page 10). The third group's payload is changed at rest. A fresh engine's get asks
    for the 5 groups and the state at their end; groups 0-1 arrive, group 2 fails, the state
    arrives. That state is page 10's: it must not become the state at page 4 (the end of the
    groups that arrived), where a later match would snap and load it. The request recomputes
    (FakeEngine checks every page and the state it loads) and the damaged group is counted."""
    cfg = config(page_bytes=PAGE, host_pages=64, state_bytes=64, state_slots=8)
    cfg["tiers"].append({"type": "memory", "space": uuid.uuid4().hex, "group_pages": 2})
    p = prompt(5)
    writer = Writer(cfg, FakeStates(2, 64, history_tokens=16))
    try:
        names = writer.stored(p)
        groups = [name for name in names if "/g2/" in name]
        assert (len(names), len(groups)) == (6, 5)
        rewrite("memory", writer, groups[2], flip_middle)
    finally:
        writer.engine.cache.close()
    reader = FakeEngine(cfg, states=FakeStates(2, 64, history_tokens=16))
    try:
        m = reader.run("r", p)
        assert (m.hit_tokens, m.needs_state) == (0, False)
        settle(reader)
        s = reader.cache.stats()
        pinned = s["host_pinned"] - s["fetch_reserve_memory"]  # the reserve stays pinned
        assert (s["corrupt_memory"], pinned, s["requests"]) == (1, 0, 0)
    finally:
        reader.cache.close()


FOREIGN: dict[str, Callable[[bytes, bytes], bytes]] = {
    # (the object's bytes, the bytes of the next object of the prompt) -> what rests instead
    "written without a header (an older version)": lambda own, _: own[HEADER:],
    "longer (another layout)": lambda own, _: own + bytes(PAGE),
    "shorter (another layout)": lambda own, _: own[:-PAGE],
    "another object's bytes": lambda _, other: other,
    "another codec in the header": lambda own, _: own[:5] + b"\x07" + own[6:],
    "another version in the header": lambda own, _: own[:4] + b"\x09" + own[5:],
    "a length changed in the header": lambda own, _: own[:8] + b"\x01" + own[9:],
}


@pytest.mark.parametrize("what", list(FOREIGN))
@pytest.mark.parametrize("kind", ["memory", "mooncake"])
def test_a_foreign_object_is_a_counted_miss(kind, what, mooncake_master, tmp_path, engines):
    """Objects replaced by bytes that are not this object as this version wrote it: none is
    loaded, each is a failed get; of the size the reader expects, each is counted corrupt (an
    object of another size is refused by the store itself, or counted corrupt where the store
    reads it)."""
    cfg = tier_config(kind, mooncake_master, tmp_path)
    writer = Writer(cfg)
    try:
        p = prompt(3)
        names = writer.stored(p)
        old = [read(kind, writer, name) for name in names]
        for i, name in enumerate(names):
            replace(kind, writer, name, FOREIGN[what](old[i], old[(i + 1) % len(old)]))
    finally:
        writer.engine.cache.close()
    reader = engines(cfg)
    assert reader.run("r", p).hit_tokens == 0  # checks every loaded byte
    settle(reader)
    s = reader.cache.stats()
    assert s[f"get_failed_{kind}"] == 5
    if len(FOREIGN[what](bytes(HEADER + GROUP), bytes(HEADER + GROUP))) == HEADER + GROUP:
        assert s[f"corrupt_{kind}"] == 5


def test_a_damaged_disk_record_header_is_a_miss(tmp_path, engines, mooncake_master):
    """A flip inside a disk record's header block (where the object's header is kept) fails
    the record's CRC: a miss, the record removed."""
    cfg = tier_config("disk", mooncake_master, tmp_path)
    writer = Writer(cfg)
    try:
        p = prompt(4)
        for name in writer.stored(p):
            path = Path(writer.store.root) / "objects" / file_name(name)
            data = bytearray(path.read_bytes())
            data[40] ^= 0x01
            path.write_bytes(bytes(data))
    finally:
        writer.engine.cache.close()
    reader = engines(cfg)
    assert reader.run("r", p).hit_tokens == 0
    settle(reader)
    assert reader.cache._chain.links[0].store.stats().damaged == 5
