"""A store tier that answers a call with a result of the wrong length or type (a plugin with a
bug): the call counts as failed, decided on the worker thread, never as a hit; the fetch
completes as a miss and releases its slots, and the engine thread never sees an exception.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

import numpy as np
import pytest
from fake_engine import FakeEngine, config, settle
from memory_tier import MemoryTier

BAD: dict[str, Callable[[list], object]] = {
    "short": lambda out: out[:-1],
    "long": lambda out: [*out, out[-1]],
    "none": lambda out: None,
    "str": lambda out: "x" * len(out),
    "floats": lambda out: [float(c) for c in out],
}


def prompt(seed: int, n: int = 33) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, n).astype(np.int32)


def engine(space: str) -> FakeEngine:
    cfg = config(host_pages=64)
    cfg["tiers"].append({"type": "memory", "space": space, "group_pages": 2, "fetch_reserve": 0})
    return FakeEngine(cfg)


def mangle(e: FakeEngine, call: str, bad: Callable[[list], object]) -> None:
    """Make the engine's memory tier answer `call` with `bad` of its true result."""
    store: MemoryTier = e.cache._chain.links[0].store
    real = getattr(store, call)
    setattr(store, call, lambda *args: bad(real(*args)))


@pytest.mark.parametrize("bad", sorted(BAD))
@pytest.mark.parametrize("call", ["exists", "get_into"])
def test_a_wrong_result_of_a_fetch_is_a_failed_call_and_a_miss(call, bad):
    space = uuid.uuid4().hex
    p = prompt(1)
    writer = engine(space)
    writer.run("w", p)
    settle(writer)
    writer.cache.close()

    reader = engine(space)
    try:
        mangle(reader, call, BAD[bad])
        m = reader.run("r", p)  # checks every loaded byte
        assert m.hit_tokens == 0
        settle(reader)
        s = reader.cache.stats()
        assert (s["call_errors_memory"], s["pages_fetched_memory"]) == (1, 0)
        assert (s["host_pinned"], s["requests"], s["jobs_in_flight_memory"]) == (0, 0, 0)
    finally:
        reader.cache.close()


@pytest.mark.parametrize("bad", sorted(BAD))
def test_a_wrong_result_of_a_put_is_a_failed_put(bad):
    space = uuid.uuid4().hex
    e = engine(space)
    try:
        mangle(e, "put_from", BAD[bad])
        e.run("w", prompt(2))
        settle(e)
        s = e.cache.stats()
        assert (s["call_errors_memory"], s["objects_put_memory"], s["put_failed_memory"]) == (
            1,
            0,
            4,
        )
        assert s["host_pinned"] == 0
        del e.cache._chain.links[0].store.put_from  # the tier answers right again: the groups
        e.run("w2", prompt(2))  # were not taken as held, so they are put now
        settle(e)
        assert e.cache.stats()["objects_put_memory"] == 4
    finally:
        e.cache.close()
