"""A store client in a process of its own (``own_process: true``), against a real mooncake_master
on loopback: the bytes are exact, bad input is refused here before anything is sent, and a child
that dies is started again while the engine goes on without L3."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from fake_engine import FakeEngine
from test_l3 import l3_config, prompt, settled, wait_until

from hicache.backends.base import Buffers, StoreUnavailable
from hicache.backends.isolated import IsolatedStore
from hicache.backends.mooncake import MooncakeConfig, StoreCode
from hicache.memory import HostMemory

pytestmark = pytest.mark.mooncake


def own_process(master) -> dict:
    cfg = l3_config(master)
    cfg["tiers"][1]["own_process"] = True
    return cfg


@pytest.fixture
def store(mooncake_master):
    """An isolated Mooncake store, connected, with 1 MiB of shared host memory registered."""
    s = IsolatedStore(MooncakeConfig(**mooncake_master.tier_config))
    s.start()
    memory = HostMemory(1 << 20, pin=False, shared=True)
    s.register(memory.tensor)
    assert s.wait_ready(30)
    yield s, memory.tensor
    s.close()
    memory.close()


def test_objects_put_and_got_through_the_process_are_the_same_bytes(store):
    s, mem = store
    mem[:4096] = torch.arange(4096, dtype=torch.int64).to(torch.uint8)
    base = mem.data_ptr()
    names = [f"iso/{os.getpid()}/a", f"iso/{os.getpid()}/b"]
    # object a: two pieces (1 KiB at 0, 1 KiB at 2 KiB); object b: one piece at 1 KiB
    out = Buffers([[base, base + 2048], [base + 1024]], [[1024, 1024], [1024]])
    assert s.put_from(names, out) == [0, 0]
    into = Buffers([[base + 8192], [base + 16384]], [[2048], [1024]])
    assert s.get_into(names, into) == [2048, 1024]
    want_a = torch.cat([mem[:1024], mem[2048:3072]])
    assert torch.equal(mem[8192 : 8192 + 2048], want_a)
    assert torch.equal(mem[16384 : 16384 + 1024], mem[1024:2048])
    assert s.exists([*names, f"iso/{os.getpid()}/never"]) == [True, True, False]
    assert s.get_into(["iso/never"], Buffers([[base]], [[8]])) == [StoreCode.OBJECT_NOT_FOUND]
    assert s.stats().keys_got == 2  # the child's own client counted them


def test_bad_input_is_refused_by_name_before_the_child_sees_it(store):
    s, mem = store
    base = mem.data_ptr()
    with pytest.raises(ValueError, match=r"key 'k2': piece .* is outside registered memory"):
        s.put_from(["k1", "k2"], Buffers([[base], [base + (1 << 20) - 8]], [[8], [16]]))
    with pytest.raises(ValueError, match="2 keys but 1 pointer lists"):
        s.get_into(["k1", "k2"], Buffers([[base]], [[8]]))
    with pytest.raises(TypeError, match="not one str"):
        s.exists("k1")
    private = torch.zeros(4096, dtype=torch.uint8)
    with pytest.raises(ValueError, match="needs the tensor in shared host memory"):
        s.register(private)
    # the child still serves calls
    assert s.exists(["k1"]) == [False]


def test_a_fresh_cache_hits_exact_bytes_through_its_own_store_process(mooncake_master):
    writer = FakeEngine(own_process(mooncake_master))
    reader = FakeEngine(own_process(mooncake_master))
    try:
        p = prompt(31)
        writer.run("w", p)
        settled(writer)
        assert writer.cache.stats()["l3_objects_put"] == 5
        store = reader.cache._l3.store
        assert isinstance(store, IsolatedStore) and store.wait_ready(30)
        m = reader.run("r", p)  # checks every loaded byte
        assert (m.hit_tokens, m.l3_tokens) == (40, 40)
        assert store._process.pid != os.getpid()
        assert store.stats().keys_got == 5
    finally:
        writer.cache.close()
        reader.cache.close()


def test_a_killed_store_process_is_started_again_and_l3_comes_back(mooncake_master):
    e = FakeEngine(own_process(mooncake_master))
    fresh = None
    try:
        store = e.cache._l3.store
        assert store.wait_ready(30)
        e.run("before", prompt(40))
        settled(e)
        store.restart_backoff_s = (3.0, 30.0)  # the child stays down while the test looks
        first = store._process
        os.kill(first.pid, signal.SIGKILL)
        first.wait(10)
        wait_until(lambda: not e.cache.stats()["l3_available"], e)
        t0 = time.perf_counter()
        for i in range(5):  # requests go on with the host tier alone; nothing is raised
            m = e.run(f"down{i}", prompt(50 + i))
            assert m.hit_tokens == 0
        assert time.perf_counter() - t0 < 5
        with pytest.raises(StoreUnavailable):
            store.exists(["anything"])
        assert store.wait_ready(60)  # a new child, its files registered again
        assert store.restarts == 1 and store._process.pid != first.pid
        assert e.cache.stats()["l3_store_restarts"] == 1
        p = prompt(60)
        e.run("after", p)
        settled(e)
        fresh = FakeEngine(own_process(mooncake_master))
        m = fresh.run("again", p)
        assert (m.hit_tokens, m.l3_tokens) == (40, 40)
    finally:
        e.cache.close()
        if fresh is not None:
            fresh.cache.close()


def test_close_ends_the_child(mooncake_master):
    s = IsolatedStore(MooncakeConfig(**mooncake_master.tier_config))
    s.start()
    assert s.wait_ready(30)
    child = s._process
    assert s.close() is True
    assert child.poll() is not None and not s.available
    with pytest.raises(StoreUnavailable):
        s.exists(["k"])


def test_the_child_maps_the_same_memory_not_a_copy(store):
    """A get lands in the parent's memory: the child wrote through its own mapping of it."""
    s, mem = store
    base = mem.data_ptr()
    name = f"iso/{os.getpid()}/same"
    payload = np.frombuffer(os.urandom(4096), dtype=np.uint8)
    mem[:4096] = torch.from_numpy(payload.copy())
    assert s.put_from([name], Buffers([[base]], [[4096]])) == [0]
    mem[:4096] = 0
    assert s.get_into([name], Buffers([[base]], [[4096]])) == [4096]
    assert np.array_equal(mem[:4096].numpy(), payload)


def test_the_child_exits_when_the_engine_process_dies(mooncake_master):
    """A killed engine leaves no store client behind: the child sees its control socket close,
    closes its store and exits."""
    script = f"""
import sys, time
from hicache.backends.isolated import IsolatedStore
from hicache.backends.mooncake import MooncakeConfig
s = IsolatedStore(MooncakeConfig(**{mooncake_master.tier_config!r}))
s.start()
assert s.wait_ready(30)
print(s._process.pid, flush=True)
time.sleep(600)
"""
    engine = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        child = int(engine.stdout.readline())
        assert _alive(child)
        engine.kill()
        engine.wait(10)
        deadline = time.monotonic() + 30  # its store's close takes 1-2.5 s
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child)
    finally:
        engine.kill()


def _alive(pid: int) -> bool:
    """The process runs (a zombie, exited but not reaped by its new parent, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")
