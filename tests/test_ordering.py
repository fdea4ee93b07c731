"""No worker reads a host slot before the copy that fills it has completed.

The writer's copies complete late, as CUDA's do (`late_copies.LateTransfers`): `store`
publishes its host slots at once while their GPU -> host copy is held. Every put a store tier's
worker sends from host slots (write-behind, write-back, the promotion of a lower tier's pages)
must wait for the copies enqueued before it; a second cache, whose copies are ordinary, then
checks every byte it loads from that tier.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import numpy as np
import pytest
from fake_engine import FakeEngine, config, kv_bytes, settle
from late_copies import LateTransfers
from memory_tier import MemoryTier

import hicache.cache

P = 4  # tokens per page in `config()`


def prompt(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, n).astype(np.int32)


def memory(space: str, **kw: object) -> dict:
    return {"type": "memory", "space": space, "group_pages": 2, "fetch_reserve": 0, **kw}


def chain(*tiers: dict, host_pages: int = 64) -> dict:
    cfg = config(host_pages=host_pages)
    cfg["tiers"] += list(tiers)
    return cfg


def idle(engine: FakeEngine) -> bool:
    """Apply the workers' results; True if no store tier has work queued or running."""
    engine.cache.poll()
    return engine.cache.tiers_idle


@pytest.fixture
def engines(monkeypatch) -> Iterator[dict]:
    """`late(cfg)`: an engine whose copies complete late; `plain(cfg)`: an ordinary one."""
    made: list[FakeEngine] = []

    def late(cfg: dict) -> FakeEngine:
        with monkeypatch.context() as m:
            m.setattr(hicache.cache, "Transfers", LateTransfers)
            e = FakeEngine(cfg)
        made.append(e)
        return e

    def plain(cfg: dict) -> FakeEngine:
        e = FakeEngine(cfg)
        made.append(e)
        return e

    yield {"late": late, "plain": plain}
    for e in made:
        if isinstance(e.cache._transfers, LateTransfers):
            e.cache._transfers.complete()
            e.cache.poll()
        e.cache.close()


def complete_late(e: FakeEngine) -> None:
    """Let the workers take up what they were given (a put waits for its copies, or, where it
    did not, has read its slots), then complete the held copies and settle."""
    e.cache._transfers.settle_workers(lambda: idle(e), 1)
    e.cache._transfers.complete()
    settle(e)


def read_back(engines: dict, space: str, tokens: np.ndarray) -> int:
    """A fresh cache with ordinary copies runs `tokens` from the memory tier `space`, checking
    every loaded byte: the tokens it got from that tier."""
    m = engines["plain"](chain(memory(space))).run("r", tokens)
    return dict(m.tier_tokens).get("memory", 0)


def store_late(e: FakeEngine, rid: str, tokens: np.ndarray) -> None:
    """Compute and store `tokens` (a miss) into blocks left alone until the copies complete."""
    m = e.cache.match(rid, tokens)
    assert m.hit_tokens == 0
    blocks = e.allocate(-(-len(tokens) // P))
    e.compute(tokens, blocks, 0)
    e.cache.store(rid, tokens, blocks)
    e.cache.release(rid)


def test_a_write_back_waits_for_the_copy_of_the_pages_it_puts(engines):
    """write: on_evict: the host tier is full right after the store, so the next poll writes
    back at once, while the store's copies are still held. The put waits for them: the second
    cache reads the engine's bytes, never the empty slots'. (Before the fix the put went with
    a completion that was already done, and the reader loaded zeros.)"""
    space = uuid.uuid4().hex
    p = prompt(1, 33)  # 8 pages, the whole host tier
    e = engines["late"](chain(memory(space, write="on_evict"), host_pages=8))
    store_late(e, "a", p)
    e.cache.poll()  # the host tier is full: write back now
    assert e.cache.stats()["write_back_pending_memory"] == 0
    complete_late(e)
    assert len(MemoryTier.spaces[space]) == 4

    assert read_back(engines, space, p) == 32


def test_a_promotion_waits_for_the_copy_of_the_host_pages_it_puts(engines):
    """A walk that finds pages 0-7 in the host (stored, their copy still held) and pages 8-15
    in the lower tier puts all eight groups behind to the tier above it (which was down when
    the store ran). The promotion's put waits for the held copies: a cache that reads only the
    upper tier gets the engine's bytes for every page."""
    upper, lower = uuid.uuid4().hex, uuid.uuid4().hex
    p = prompt(2, 65)  # 16 pages
    engines["plain"](chain(memory(lower))).run("w", p)
    e = engines["late"](chain(memory(upper, name="up"), memory(lower, name="low", write="off")))
    top = e.cache._chain.links[0]
    top.store.down = True  # the store's own write-behind skips the upper tier
    store_late(e, "s", p[:32])
    top.store.down = False
    m = FakeEngine.match(e, "r", p)
    assert (m.hit_tokens, m.tier_tokens) == (64, (("low", 32),))
    e.cache.release("r")  # not loaded: its loads would be held too
    complete_late(e)
    assert len(MemoryTier.spaces[upper]) == 8

    assert read_back(engines, upper, p) == 64


def test_a_write_behind_waits_for_the_copy_of_the_pages_it_puts(engines):
    """write: behind: the put queued by `store` itself waits for the store's copies."""
    space = uuid.uuid4().hex
    p = prompt(3, 33)
    e = engines["late"](chain(memory(space)))
    store_late(e, "a", p)
    complete_late(e)
    assert read_back(engines, space, p) == 32


def test_a_load_of_pages_whose_store_is_in_flight_gets_the_stored_bytes():
    """A hit on pages whose store copy has not completed yet is loaded after it, on the same
    stream: the engine's blocks get the stored bytes, never the empty slots'."""
    space = uuid.uuid4().hex
    p = prompt(4, 33)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hicache.cache, "Transfers", LateTransfers)
        e = FakeEngine(chain(memory(space, write="off")))
    try:
        store_late(e, "a", p)
        m = e.cache.match("b", p)
        assert (m.hit_tokens, m.load_pages) == (32, 8)
        blocks = e.allocate(8)
        e.cache.load(m, blocks)
        assert e.cache._transfers.complete() == 2  # the store's copy, then the load's
        e.cache.poll()
        e.cache.release("b")
        for i, block in enumerate(blocks):
            assert np.array_equal(e.page(block), kv_bytes(p, (i + 1) * P, 64)), i
        assert e.cache.stats()["host_pinned"] == 0
    finally:
        e.cache.close()
