"""A store tier that answers a call with a result of the wrong length or type (a plugin with a
bug): the call counts as failed, decided on the worker thread, never as a hit; the fetch
completes as a miss and releases its slots, and the engine thread never sees an exception.
"""

from __future__ import annotations

import asyncio
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


def raise_once(e: FakeEngine, call: str) -> None:
    """Make the engine's memory tier raise asyncio.CancelledError (a BaseException, not an
    Exception) from its first `call`, and answer right from then on."""
    store: MemoryTier = e.cache._chain.links[0].store
    real = getattr(store, call)
    raised: list[str] = []

    def once(*args):
        if not raised:
            raised.append(call)
            raise asyncio.CancelledError("a plugin's call was cancelled")
        return real(*args)

    setattr(store, call, once)


@pytest.mark.parametrize("call", ["exists", "get_into", "put_from"])
def test_a_call_that_raises_a_base_exception_fails_alone_and_the_worker_goes_on(call):
    """A plugin's call raises CancelledError once. That call counts as failed (a fetch: a miss;
    a put: its groups not stored), its slots are released, and the tier's worker takes the next
    job: the second prompt is fetched (or put) as usual, no job is left in flight (so close
    does not wait out its timeout) and nothing stays pinned."""
    space = uuid.uuid4().hex
    p, q = prompt(3), prompt(4)
    writer = engine(space)
    try:
        if call == "put_from":
            raise_once(writer, call)
        writer.run("w1", p)
        writer.run("w2", q)
        settle(writer, timeout=60)
        s = writer.cache.stats()
        put = 4 if call == "put_from" else 8
        assert (s["objects_put_memory"], s["host_pinned"]) == (put, 0)
    finally:
        writer.cache.close()
    reader = engine(space)
    try:
        if call != "put_from":
            raise_once(reader, call)
        first = reader.run("r1", p).hit_tokens  # checks every loaded byte
        assert (first, reader.run("r2", q).hit_tokens) == (0, 32)
        settle(reader, timeout=60)
        s = reader.cache.stats()
        assert s["call_errors_memory"] == int(call != "put_from")
        assert (s["host_pinned"], s["requests"], s["jobs_in_flight_memory"]) == (0, 0, 0)
    finally:
        reader.cache.close()


def test_a_tier_whose_available_raises_is_taken_as_down(monkeypatch):
    """A plugin's `available` raises: match and store (on the engine thread) do not; the tier
    is passed over as one that is down (no fetch, no put, both counted), and the request is
    served from the host tier. Once `available` answers again, the tier is used again."""
    space = uuid.uuid4().hex
    e = engine(space)
    try:

        def broken(self) -> bool:
            raise RuntimeError("the plugin lost its client")

        monkeypatch.setattr(MemoryTier, "available", property(broken))
        assert e.run("w", prompt(5)).hit_tokens == 0
        assert e.run("r", prompt(5)).hit_tokens == 32  # from the host tier
        s = e.cache.stats()
        assert (s["puts_skipped_memory"], s["objects_put_memory"]) == (8, 0)
        assert s["available_memory"] == 0
        monkeypatch.undo()
        e.run("w2", prompt(6))
        settle(e)
        assert e.cache.stats()["objects_put_memory"] == 4
    finally:
        e.cache.close()
