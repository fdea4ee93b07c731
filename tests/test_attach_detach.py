"""Store tiers attached and detached at runtime on `HiCache` (issue 60): requests walk and store
into a tier from the step it is attached; detached, it is asked nothing more, its reads and writes
in flight finish (never a wrong byte, never a stuck request), and it leaves no pin, thread or file
handle; a persistent tier's objects are read again once it is attached again."""

from __future__ import annotations

import os
import threading
import time
import uuid
from pathlib import Path
from typing import ClassVar, Literal

import numpy as np
import pytest
from fake_engine import FakeEngine, config, settle
from memory_tier import MemoryConfig, MemoryTier

from hicache.backends.base import Buffers
from hicache.errors import ConfigError
from hicache.registry import register_tier

PAGE = 1024


def prompt(seed: int, n: int = 41) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, n).astype(np.int32)


def disk(tmp_path: Path, **extra) -> dict:
    return {"type": "disk", "path": str(tmp_path / "d"), "size": "16MiB", "group_pages": 2,
            "sync": False, **extra}  # fmt: skip


def threads_of(name: str) -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(f"hicache-{name}-")]


def open_files_under(path: Path) -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(path)):
            out.append(target)
    return out


def flood(e: FakeEngine, n: int = 12) -> None:
    """Push every earlier page out of the 32-page host tier."""
    for i in range(n):
        e.run(f"flood{i}", prompt(1000 + i, 17))


def test_attach_a_disk_tier_then_detach_leaves_nothing_and_attach_again_reads_its_objects(
    tmp_path,
):
    """A host-only cache gets a disk tier attached: a prompt stored then rests on the disk and
    comes back from it after the host forgot it. Detached (waiting for it), the tier leaves no
    thread, no open file, no pinned host slot; the prompt is then a miss. Attached again (the
    same directory), the prompt comes back from the disk."""
    e = FakeEngine(config(page_bytes=PAGE, host_pages=32))
    try:
        assert e.cache.attach(disk(tmp_path)) == "disk"
        assert e.cache.wait_ready(120)  # until it answers, it is passed over
        assert list(e.cache.store_tiers) == ["disk"]
        p = prompt(1)
        e.run("p", p)
        settle(e)
        flood(e)
        settle(e)
        m = e.run("p2", p)
        assert (m.hit_tokens, m.tier_tokens) == (40, (("disk", 40),))
        flood(e)
        assert e.cache.detach("disk", timeout_s=120)
        assert threads_of("disk") == [] and open_files_under(tmp_path) == []
        assert e.cache.stats()["host_pinned"] == 0 and e.cache.store_tiers == {}
        assert e.run("p3", p).hit_tokens == 0
        flood(e)
        e.cache.attach(disk(tmp_path))
        assert e.cache.wait_ready(120)
        m = e.run("p4", p)
        assert (m.hit_tokens, m.tier_tokens) == (40, (("disk", 40),))
    finally:
        e.cache.close()
    assert threads_of("disk") == [] and open_files_under(tmp_path) == []


class _GatedConfig(MemoryConfig):
    type: Literal["gated_memory"] = "gated_memory"  # type: ignore[assignment]


@register_tier("gated_memory", _GatedConfig)
class _GatedTier(MemoryTier):
    """The memory tier whose gets and puts wait for `gate` (so a test holds them in flight)."""

    gate: ClassVar[threading.Event] = threading.Event()
    waiting: ClassVar[threading.Semaphore] = threading.Semaphore(0)

    def get_into(self, keys, buffers: Buffers) -> list[int]:
        self.waiting.release()
        self.gate.wait(120)
        return super().get_into(keys, buffers)

    def put_from(self, keys, buffers: Buffers) -> list[int]:
        self.waiting.release()
        self.gate.wait(120)
        return super().put_from(keys, buffers)


def gated(space: str) -> dict:
    return {"type": "gated_memory", "space": space, "group_pages": 2, "name": "gated"}


def test_detach_while_a_read_and_a_write_are_in_flight_drains_them(tmp_path):
    """With a get and a put held in flight on the tier's workers, the tier is detached (not
    waited for: the engine goes on). Nothing is asked of it any more; once the calls return,
    `poll` applies them (the waiting request gets the pages that arrived, byte-exact, or
    recomputes) and closes the tier: no thread, no pinned host slot."""
    space = uuid.uuid4().hex
    _GatedTier.gate.set()
    e = FakeEngine(config(page_bytes=PAGE, host_pages=32))
    try:
        e.cache.attach(gated(space))
        assert e.cache.wait_ready(120)
        p, q = prompt(2), prompt(3)
        e.run("p", p)
        settle(e)
        flood(e)
        settle(e)
        _GatedTier.gate.clear()
        while _GatedTier.waiting.acquire(blocking=False):
            pass
        m = e.cache.match("r", p)
        assert m.pending  # the fetch is out: its probe, then (applied by poll) its get
        deadline = time.monotonic() + 120
        while not _GatedTier.waiting.acquire(timeout=0.01):  # the get is held at the gate
            assert time.monotonic() < deadline, "the get never reached the store"
            e.cache.poll()
        blocks = e.allocate(11)
        e.compute(q, blocks, 0)
        e.cache.store("w", q, blocks)  # a put is queued behind the gate too
        e.cache.poll()
        assert not e.cache.detach("gated", timeout_s=0)  # in flight: not closed yet
        assert e.cache.store_tiers == {} and threads_of("gated")
        _GatedTier.gate.set()
        m = e.match("r", p)  # the get in flight drained into the host: checked byte by byte
        assert (m.hit_tokens, m.tier_tokens) == (40, (("gated", 40),))
        e.cache.load(m, blocks[: m.load_pages] if m.load_pages else [])
        e.cache.poll()
        for i in range(m.load_pages):
            assert np.array_equal(e.page(blocks[i]), _kv(e, p, i))
        e.cache.release("r")
        e.cache.release("w")
        e.free.extend(blocks)
        settle(e)
        assert threads_of("gated") == [] and e.cache.stats()["host_pinned"] == 0
        assert e.run("again", q).hit_tokens == 40  # the host kept q
    finally:
        _GatedTier.gate.set()
        e.cache.close()


def _kv(e: FakeEngine, tokens: np.ndarray, page: int) -> np.ndarray:
    from fake_engine import kv_bytes

    return kv_bytes(tokens, (page + 1) * e.P, e.layout.page_size)


def test_attach_and_detach_refuse_what_they_cannot_do(tmp_path):
    e = FakeEngine(config(page_bytes=PAGE, host_pages=32))
    try:
        with pytest.raises(ConfigError) as err:
            e.cache.attach({"type": "disk", "path": str(tmp_path), "size": "-1"})
        assert str(err.value) == "attach: size: a size cannot be negative, got -1"
        with pytest.raises(ValueError, match="detach: no tier named 'disk' is attached"):
            e.cache.detach("disk")
        with pytest.raises(ValueError, match="needs the host tier's eviction hook"):
            e.cache.attach(disk(tmp_path, write="on_evict"))
        e.cache.attach(disk(tmp_path))
        with pytest.raises(ValueError, match="attach: a tier named 'disk' is attached already"):
            e.cache.attach(disk(tmp_path))
        with pytest.raises(ValueError, match=r"attach: position 5 is not one of 0\.\.1"):
            e.cache.attach({**disk(tmp_path), "name": "other"}, position=5)
        with pytest.raises(ValueError, match="not a store tier"):
            e.cache.attach({"type": "host", "size": "1MiB"})
    finally:
        e.cache.close()


@pytest.mark.mooncake
def test_attach_detach_mooncake_tier_reads_its_objects_when_attached_again(mooncake_master):
    """The same on a real Mooncake master: a tier attached, a prompt stored, the tier detached
    (no thread left), the host flooded, the tier attached again: the prompt comes from the
    store."""
    tier = {"type": "mooncake", **mooncake_master.tier_config,
            "key_prefix": uuid.uuid4().hex[:12], "group_pages": 2}  # fmt: skip
    e = FakeEngine(config(page_bytes=PAGE, host_pages=32))
    try:
        e.cache.attach(tier)
        assert e.cache.wait_ready(120)
        p = prompt(4)
        e.run("p", p)
        settle(e)
        assert e.cache.detach("mooncake", timeout_s=120)
        assert threads_of("mooncake") == [] and e.cache.stats()["host_pinned"] == 0
        flood(e)
        e.cache.attach(tier)
        assert e.cache.wait_ready(120)
        m = e.run("p2", p)
        assert (m.hit_tokens, m.tier_tokens) == (40, (("mooncake", 40),))
    finally:
        e.cache.close()
