"""A seeded randomized soak: >= 100,000 cache operations with interleaved, deferred and aborted
requests on a small host tier. Every load is checked byte for byte; the books are checked as it
runs, and at the end no pin, slot or request may be left behind."""

from __future__ import annotations

import numpy as np
import pytest
from fake_engine import FakeEngine, FakeStates, config, kv_bytes

from hicache.core.eviction import policy_names

P = 4


@pytest.mark.parametrize("policy", policy_names())
def test_soak_keeps_books_exact_and_leaks_nothing(policy: str) -> None:
    rng = np.random.default_rng(2026)
    states = FakeStates(slots=64, state_bytes=16, history_tokens=12)
    cfg = config(page_bytes=32, host_pages=48, state_bytes=16, state_slots=24)
    cfg["tiers"][0]["policy"] = policy
    e = FakeEngine(
        cfg,
        num_blocks=512,
        states=states,
    )
    cache = e.cache
    prefixes = [
        rng.integers(0, 50, size=int(rng.integers(4, 40)), dtype=np.int32) for _ in range(12)
    ]
    waiting: dict[str, tuple[np.ndarray, object, int]] = {}
    free_slots = list(range(64))
    ops = hits = checked = 0
    next_id = 0

    while ops < 100_000:
        action = rng.random()
        if action < 0.45 or not waiting:  # a new request matches and may wait for blocks
            base = prefixes[int(rng.integers(len(prefixes)))]
            tail = rng.integers(0, 50, size=int(rng.integers(1, 12)), dtype=np.int32)
            prompt = np.concatenate([base, tail])
            rid = f"r{next_id}"
            next_id += 1
            m = cache.match(rid, prompt)
            waiting[rid] = (prompt, m, free_slots.pop())
        elif action < 0.85:  # the engine finally allocates and runs one of them
            rid = list(waiting)[int(rng.integers(len(waiting)))]
            prompt, m, slot = waiting.pop(rid)
            if rng.random() < 0.3:  # ask again first, as after a pending answer
                m = cache.match(rid, prompt)
                ops += 1
            blocks = e.allocate(-(-len(prompt) // P) + 3)
            cache.load(m, blocks, state_slot=slot if m.needs_state else None)
            hits += m.load_pages > 0
            for i in range(m.load_pages):
                assert np.array_equal(e.page(blocks[i]), kv_bytes(prompt, (i + 1) * P, 32))
                checked += 1
            if m.needs_state:
                assert np.array_equal(
                    states.pool[slot].numpy(), kv_bytes(prompt, m.hit_tokens, 16, b"state")
                )
            e.compute(prompt, blocks, m.hit_tokens // P)
            states.tokens[slot] = prompt
            cache.store(rid, prompt, blocks, state_slot=slot)
            if rng.random() < 0.5:  # decode a few tokens and keep them too
                full = np.concatenate([prompt, rng.integers(0, 50, size=8, dtype=np.int32)])
                e.compute(full, blocks, len(prompt) // P)
                states.tokens[slot] = full[:-1]
                cache.store(rid, full[:-1], blocks, state_slot=slot)
                ops += 1
            cache.release(rid)
            e.free.extend(blocks)
            free_slots.append(slot)
            ops += 3
        else:  # the engine aborts a waiting request
            rid = list(waiting)[int(rng.integers(len(waiting)))]
            free_slots.append(waiting.pop(rid)[2])
            cache.release(rid)
        cache.poll()
        ops += 2
        if ops % 10_000 < 3:
            cache.host.page_slots.check()
            cache.host.state_slots.check()

    for rid, (_, _, slot) in waiting.items():
        cache.release(rid)
        free_slots.append(slot)
    cache.poll()
    pages, stat_pool = cache.host.page_slots, cache.host.state_slots
    pages.check()
    stat_pool.check()
    s = cache.stats()
    assert s["host_pinned"] == 0 and s["requests"] == 0 and pages.pinned == 0
    assert pages.used + pages.free == pages.capacity == 48
    assert stat_pool.used + stat_pool.free == stat_pool.capacity == 24
    assert s["pages_stored"] - s["pages_evicted"] == pages.used
    assert hits > 1000 and checked > 5000 and s["pages_evicted"] > 1000
