"""The cache API as an engine uses it: scenarios with exact expectations.

The fake engine writes deterministic KV per prefix and checks every loaded byte (see
fake_engine.py), so a hit from the wrong prefix, tenant or layout fails loudly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fake_engine import FakeEngine, FakeStates, config, kv_bytes

from hicache import HiCache, Layout, PagedBuffer, StateHookError, load_config

P = 4  # tokens per page in these tests


def toks(*ranges: tuple[int, int]) -> np.ndarray:
    return np.concatenate([np.arange(a, b, dtype=np.int32) for a, b in ranges])


def books_are_clean(engine: FakeEngine) -> None:
    engine.cache.host.page_slots.check()
    engine.cache.host.state_slots.check()
    s = engine.cache.stats()
    assert s["host_pinned"] == 0 and s["requests"] == 0 and s["copies_in_flight"] == 0


# -- hits ------------------------------------------------------------------------------------------


def test_miss_then_full_hit_capped_to_leave_one_token():
    e = FakeEngine(config())
    prompt = toks((0, 16))  # exactly four pages
    first = e.run("a", prompt)
    assert (first.hit_tokens, first.load_pages) == (0, 0)
    again = e.run("b", prompt)
    # all four pages are held, but one token must be recomputed: the last page is not used
    assert (again.hit_tokens, again.load_pages, again.limited_tokens) == (12, 3, 4)
    assert e.cache.stats()["hit_tokens_host"] == 12
    books_are_clean(e)


@pytest.mark.parametrize("walk", ["compiled", "steps"])
def test_hits_stop_at_the_first_missing_page_with_or_without_the_compiled_walk(walk, monkeypatch):
    if walk == "steps":  # no compiled walk: match hashes in steps of 16, 32, ... pages
        monkeypatch.setattr("hicache.core.native.index._TableIndex.walk", lambda *_: None)
    e = FakeEngine(config(host_pages=256))
    long = toks((0, 200))  # 50 pages
    e.run("a", long)
    other = long.copy()
    other[37 * P + 1] += 1  # page 37 differs: pages 0..36 are shared
    m = e.run("b", other)
    assert (m.hit_tokens, m.load_pages) == (37 * P, 37)
    m = e.cache.match("c", long[: 20 * P + 3], computed_tokens=8 * P)  # the engine holds 8
    assert (m.computed_tokens, m.first_page, m.load_pages, m.hit_tokens) == (32, 8, 12, 80)
    e.cache.release("c")
    books_are_clean(e)


def test_partial_hit_on_a_shared_prefix():
    e = FakeEngine(config())
    e.run("a", toks((0, 10)))  # pages 0, 1 stored (2 tokens left over)
    m = e.run("b", toks((0, 8), (50, 70)))  # shares pages 0, 1 only
    assert (m.hit_tokens, m.load_pages) == (8, 2)
    m = e.run("c", toks((0, 6), (90, 99)))  # shares page 0 only
    assert (m.hit_tokens, m.load_pages) == (4, 1)
    books_are_clean(e)


def test_min_recompute_tokens_cap():
    e = FakeEngine(config(min_recompute_tokens=6))
    e.run("a", toks((0, 20)))
    m = e.run("b", toks((0, 20)))
    assert m.hit_tokens == 12  # 20 - 6 = 14, floored to a page
    assert m.limited_tokens == 8


def test_engine_computed_tokens_are_skipped_and_not_loaded():
    e = FakeEngine(config())
    prompt = toks((0, 20))
    e.run("a", prompt)
    m = e.cache.match("b", prompt, computed_tokens=8)
    assert (m.hit_tokens, m.first_page, m.load_pages, m.cached_tokens) == (16, 2, 2, 8)
    blocks = e.allocate(5)
    e.cache.load(m, blocks[2:])
    for page, block in zip((2, 3), blocks[2:4]):
        assert np.array_equal(e.page(block), kv_bytes(prompt, (page + 1) * P, 64))
    e.cache.release("b")
    books_are_clean(e)


def test_three_turn_conversation():
    e = FakeEngine(config(host_pages=64))
    system = toks((0, 9))
    turn1 = np.concatenate([system, toks((100, 105))])
    answer1 = toks((200, 207))
    turn2 = np.concatenate([turn1, answer1, toks((300, 306))])
    answer2 = toks((400, 403))
    turn3 = np.concatenate([turn2, answer2, toks((500, 511))])

    def turn(rid: str, prompt: np.ndarray, answer: np.ndarray):
        m = e.cache.match(rid, prompt)
        blocks = e.allocate(-(-(len(prompt) + len(answer)) // P))
        e.cache.load(m, blocks)
        e.compute(prompt, blocks, m.hit_tokens // P)
        e.cache.store(rid, prompt, blocks)
        full = np.concatenate([prompt, answer])
        e.compute(full, blocks, len(prompt) // P)  # decode writes the answer's KV
        e.cache.store(rid, full[:-1], blocks)  # the last sampled token has no KV yet
        e.cache.release(rid)
        e.free.extend(blocks)
        return m

    assert turn("t1", turn1, answer1).hit_tokens == 0
    m2 = turn("t2", turn2, answer2)
    # turn 1's prompt and answer (minus its last token) = 20 tokens = 5 full pages
    assert m2.hit_tokens == 20
    m3 = turn("t3", turn3, toks((600, 602)))
    assert m3.hit_tokens == (len(turn2) + len(answer2) - 1) // P * P == 28
    books_are_clean(e)


def test_layer_first_pool_gets_exact_bytes():
    e = FakeEngine(config(page_bytes=96), layer_first=3)
    prompt = toks((0, 30))
    e.run("a", prompt)
    m = e.run("b", prompt)  # run() checks every loaded byte across the three segments
    assert m.load_pages == 7
    books_are_clean(e)


# -- isolation -------------------------------------------------------------------------------------


def test_tenant_salts_never_hit_each_other():
    e = FakeEngine(config())
    prompt = toks((0, 20))
    e.run("a", prompt, salt="tenant-a")
    assert e.run("b", prompt, salt="tenant-b").hit_tokens == 0
    assert e.run("c", prompt).hit_tokens == 0  # no salt is a namespace of its own
    assert e.run("d", prompt, salt="tenant-a").hit_tokens == 16


@pytest.mark.parametrize("change", [{"kv_dtype": "float8_e4m3fn"}, {"page_tokens": 8}])
def test_a_changed_layout_never_hits(change):
    cfg = load_config(config(), env={})
    writer = FakeEngine(cfg)
    prompt = toks((0, 40))
    writer.run("a", prompt)
    # a second engine with another layout that shares the writer's host tier object
    layout = cfg.layout.model_copy(update=change)
    reader = FakeEngine(cfg, layout=layout)
    reader.cache.host = writer.cache.host
    assert reader.cache.match("b", prompt).hit_tokens == 0
    assert writer.cache.match("c", prompt).hit_tokens == 36


# -- states (hybrid models) -----------------------------------------------------------------------


def hybrid(history: int = 8, **policy) -> FakeEngine:
    return FakeEngine(config(state_bytes=32, **policy), states=FakeStates(4, 32, history))


def test_states_stored_at_trailing_boundaries_and_hit_snaps_to_one():
    e = hybrid(history=8, state_boundaries=2)
    prompt = toks((0, 22))  # 5 full pages; states at 20 and 16 (history 8 reaches back to 14)
    e.run("a", prompt)
    assert e.cache.stats()["states_stored"] == 2
    # same prompt: 5 pages held, cap allows 5 (22 - 1 = 21 -> 20); state at 20 exists
    m = e.run("b", prompt)
    assert (m.hit_tokens, m.needs_state, m.limited_tokens) == (20, True, 0)
    # a prompt that diverges inside page 4: pages 0..3 held, state at 16 exists
    m = e.run("c", toks((0, 17), (900, 910)))
    assert (m.hit_tokens, m.needs_state) == (16, True)
    # diverging inside page 3: pages 0..2 held but no state at 12 or below: snap to a miss
    m = e.run("d", toks((0, 13), (900, 910)))
    assert (m.hit_tokens, m.load_pages, m.limited_tokens) == (0, 0, 12)
    books_are_clean(e)


def test_a_raising_save_hook_stores_pages_but_no_state():
    e = hybrid()
    e.states.fail = "save_state"
    prompt = toks((0, 22))
    with pytest.raises(
        StateHookError, match=r"save_state\(slot=0, boundary=20\) raised RuntimeError"
    ):
        e.run("a", prompt)
    s = e.cache.stats()
    assert (s["pages_stored"], s["states_stored"], s["state_used"], s["hook_errors"]) == (
        5,
        0,
        0,
        1,
    )
    e.states.fail = None
    assert e.run("b", prompt).hit_tokens == 0  # pages are there, but no state to resume from
    books_are_clean(e)


def test_a_raising_load_hook_leaves_the_request_a_miss():
    e = hybrid()
    prompt = toks((0, 22))
    e.run("a", prompt)
    e.states.fail = "load_state"
    m = e.cache.match("b", prompt)
    blocks = e.allocate(6)
    with pytest.raises(StateHookError, match="load_state"):
        e.cache.load(m, blocks, state_slot=1)
    with pytest.raises(ValueError, match="not the request's current one"):
        e.cache.load(m, blocks, state_slot=1)
    e.cache.release("b")
    books_are_clean(e)


# -- deferred allocation and pins ------------------------------------------------------------------


def test_match_pins_pages_until_the_engine_loads_them():
    e = FakeEngine(config(host_pages=6))
    a = toks((0, 24))
    e.run("a", a)  # six pages fill the host tier
    m = e.cache.match("b", a)  # the engine can't allocate yet: load comes later
    assert m.load_pages == 5
    e.run("c", toks((1000, 1024)))  # another request stores six new pages meanwhile
    s = e.cache.stats()
    assert (s["pages_stored"], s["pages_dropped"]) == (7, 5)  # only the unpinned page was free
    blocks = e.allocate(6)
    e.cache.load(m, blocks)  # the pinned pages are still exact
    for i in range(5):
        assert np.array_equal(e.page(blocks[i]), kv_bytes(a, (i + 1) * P, 64))
    e.cache.release("b")
    books_are_clean(e)


def test_a_newer_match_supersedes_the_older_one():
    e = FakeEngine(config())
    e.run("a", toks((0, 20)))
    old = e.cache.match("b", toks((0, 20)))
    new = e.cache.match("b", toks((0, 20)))
    assert e.cache.stats()["host_pinned"] == 4  # not 8: the first match's pins were dropped
    with pytest.raises(ValueError, match="not the request's current one"):
        e.cache.load(old, e.allocate(5))
    e.cache.load(new, e.allocate(5))
    e.cache.release("b")
    books_are_clean(e)


def test_a_match_under_another_salt_or_prompt_drops_the_older_requests_pins():
    """Asked again under another salt, or with a prompt that does not extend the first, the
    request starts afresh: what its first match pinned must go with it, not leak."""
    e = FakeEngine(config())
    e.run("a", toks((0, 20)), salt="t1")
    e.run("c", toks((100, 120)))
    assert e.cache.match("b", toks((0, 20)), salt="t1").hit_tokens == 16
    assert e.cache.stats()["host_pinned"] == 4
    assert e.cache.match("b", toks((0, 20)), salt="t2").hit_tokens == 0
    assert e.cache.stats()["host_pinned"] == 0  # the t1 match's pins were dropped
    assert e.cache.match("b", toks((100, 120))).hit_tokens == 16
    assert e.cache.match("b", toks((0, 20)), salt="t1").hit_tokens == 16
    assert e.cache.stats()["host_pinned"] == 4  # not 8: the other prompt's pins were dropped
    e.cache.release("b")
    books_are_clean(e)


def test_an_engine_that_reuses_its_token_buffer_gets_the_keys_of_what_it_holds_now():
    """An engine may write each prompt into the same token buffer. After `release` the memo
    must not compare a new prompt with the buffer it was handed (which now holds that new
    prompt, so every page would seem shared and reuse the old keys), and during a request a
    buffer changed in place is compared, not trusted by its identity. (Before the fix the
    second prompt hit 64 tokens, all but its first page another prompt's KV, and a store of the
    changed buffer was taken as extending the match.)"""
    e = FakeEngine(config(host_pages=64))
    buf = toks((0, 65))  # 16 pages
    e.run("a", buf)
    buf[P:] = toks((1000, 1061))  # another prompt sharing only the first page
    m = e.run("b", buf)  # checks every loaded byte
    assert m.hit_tokens == P
    m = e.cache.match("c", buf)
    buf[P:] = toks((2000, 2061))
    with pytest.raises(ValueError, match="must extend"):
        e.cache.store("c", buf, e.allocate(16))
    e.cache.release("c")
    assert e.cache.match("d", buf).hit_tokens == P
    e.cache.release("d")
    books_are_clean(e)


def test_the_seeds_of_many_salts_are_kept_bounded_and_stay_right():
    """One salt per tenant or user: the seeds `match` keeps are bounded (the oldest go), and a
    salt whose seed went is hashed again to the same namespace."""
    e = FakeEngine(config())
    e.run("a", toks((0, 20)), salt="t0")
    for i in range(3000):
        e.cache.match("x", toks((0, 20)), salt=f"user-{i}")
        e.cache.release("x")
    assert len(e.cache._matcher._seeds) <= 1024  # (before the bound: 3001)
    assert e.run("b", toks((0, 20)), salt="t0").hit_tokens == 16  # the same namespace again
    books_are_clean(e)


def test_store_keeps_the_sequence_head_when_evicting():
    e = FakeEngine(config(host_pages=4))
    e.run("a", toks((0, 16)))  # four pages: the host tier is full
    long = toks((0, 24))  # the same four pages and two more
    m = e.run("b", long)
    assert m.hit_tokens == 16
    # storing b needed two slots; they must not come from b's own head (pages 0..3)
    assert e.cache.stats()["pages_dropped"] == 2
    assert e.run("c", long).hit_tokens == 16
    books_are_clean(e)


def test_a_store_after_a_hit_on_its_head_leaves_the_sequence_to_be_evicted_tail_first():
    """The pages a store copies are unpinned before the pages it found held, each run from its
    last page to its first: the sequence's first page ends up the most recently used."""
    from hicache.core.keys import chain_seed, page_keys

    e = FakeEngine(config(host_pages=8))
    e.run("a", toks((0, 8)))  # pages 0, 1
    long = toks((0, 8), (100, 108))
    assert e.run("b", long).hit_tokens == 8  # pages 0, 1 held; pages 2, 3 copied
    keys = page_keys(chain_seed(e.cache.fingerprint), long, P)
    pool = e.cache.host.page_slots
    assert [keys.index(k) for k in pool.keys_of(pool.lru())] == [3, 2, 1, 0]  # oldest first
    books_are_clean(e)


# -- bad input -------------------------------------------------------------------------------------


def test_bad_input_names_the_problem_and_changes_nothing():
    e = FakeEngine(config())
    prompt = toks((0, 20))
    e.run("a", prompt)
    before = e.cache.stats()
    with pytest.raises(ValueError, match="the prompt is empty"):
        e.cache.match("x", [])
    with pytest.raises(ValueError, match="outside int32"):
        e.cache.match("x", np.array([2**40], dtype=np.int64))
    with pytest.raises(ValueError, match="computed_tokens=3 must be a multiple"):
        e.cache.match("x", prompt, computed_tokens=3)
    short = e.cache.match("y", toks((0, 3)))  # shorter than a page: a miss, not an error
    assert (short.hit_tokens, short.load_pages) == (0, 0)
    m = e.cache.match("z", prompt)
    with pytest.raises(ValueError, match="needs 4 block ids, got 2"):
        e.cache.load(m, [0, 1])
    with pytest.raises(ValueError, match="block id 64 is outside the engine's pool of 64 blocks"):
        e.cache.load(m, [0, 1, 2, 64])
    with pytest.raises(ValueError, match="block id -1 is outside the engine's pool of 64 blocks"):
        e.cache.load(m, np.array([0, -1, 2, 3], dtype=np.int32))
    with pytest.raises(ValueError, match="block ids must be int32 integers"):
        e.cache.load(m, [0, 1.5, 2, 3])
    with pytest.raises(ValueError, match="block ids must be int32 integers"):
        e.cache.load(m, [0, 2**40, 2, 3])
    with pytest.raises(ValueError, match="block ids must be integers, got dtype float64"):
        e.cache.load(m, np.array([0.0, 1, 2, 3]))
    with pytest.raises(ValueError, match="needs 5 block ids, got 1"):
        e.cache.store("z", prompt, [0])
    with pytest.raises(ValueError, match="must extend"):
        e.cache.store("z", toks((5, 25)), list(range(5)))
    e.cache.load(m, e.allocate(4))  # the match survived the bad calls
    for rid in ("x", "y", "z"):
        e.cache.release(rid)
    after = e.cache.stats()
    assert after["host_used"] == before["host_used"] and after["pages_stored"] == 0 + 5
    books_are_clean(e)


def test_a_pool_that_disagrees_with_the_layout_is_refused():
    cfg = load_config(config(page_bytes=64), env={})
    with pytest.raises(ValueError, match="pages are 128 bytes but the layout says page_bytes=64"):
        HiCache(cfg, PagedBuffer.page_first(torch.zeros(8, 128, dtype=torch.uint8)))
    layout = Layout(model="m", kv_dtype="bf16", page_tokens=4, segments=(32, 32))
    pool = PagedBuffer.layer_first([torch.zeros(8, 16, dtype=torch.uint8)] * 4)
    with pytest.raises(ValueError, match="segments"):
        HiCache(cfg, pool, layout=layout)
    with pytest.raises(ValueError, match="give states="):
        HiCache(
            load_config(config(state_bytes=8), env={}),
            PagedBuffer.page_first(torch.zeros(8, 64, dtype=torch.uint8)),
        )


def test_read_only_policy_never_stores():
    e = FakeEngine(config(write_policy="read_only"))
    e.run("a", toks((0, 20)))
    assert e.run("b", toks((0, 20))).hit_tokens == 0
    assert e.cache.stats()["pages_stored"] == 0


def test_kv_events_report_stored_and_evicted_pages():
    from hicache.core.keys import chain_seed, page_keys
    from hicache.observability.events import EventQueue, KVEvent

    sink = EventQueue()
    cfg = load_config(config(host_pages=4), env={})
    cache = HiCache(cfg, PagedBuffer.page_first(torch.zeros(8, 64, dtype=torch.uint8)), events=sink)
    assert cache.wait_ready(30)
    seed = chain_seed(cache.fingerprint)
    a, b = toks((0, 12)), toks((100, 108))
    cache.store("a", a, [0, 1, 2])
    cache.store("b", b, [3, 4])  # needs one slot more than is free: a's tail page goes
    ka, kb = page_keys(seed, a, P), page_keys(seed, b, P)
    assert sink.drain() == [
        KVEvent("stored", "host", tuple(ka)),
        KVEvent("removed", "host", (ka[2],)),
        KVEvent("stored", "host", tuple(kb)),
    ]
    assert sink.dropped == 0


@pytest.mark.parametrize("blocks_run", ["up", "down"])
def test_consecutive_blocks_are_stored_into_consecutive_slots(blocks_run):
    """Fresh host slots are ordered the way the block ids run, so that a copy of consecutive
    blocks is one row per run (the copy engines' cost is per row); on a full tier too, where
    the slots come from evicting earlier sequences (their last pages first)."""
    from hicache.core import native
    from hicache.core.keys import chain_seed, page_keys

    if native.library() is None:
        pytest.skip("no C compiler: slots are left as they come")
    e = FakeEngine(config(host_pages=16))
    pool = e.cache.host.page_slots
    for i in range(5):  # 8 pages each: the third and later evict
        p = np.random.default_rng(i).integers(0, 30_000, 8 * P + 1, dtype=np.int32)
        blocks = list(range(8)) if blocks_run == "up" else list(range(40, 32, -1))
        e.compute(p, blocks, 0)
        e.cache.store(f"r{i}", p, blocks)
        e.cache.release(f"r{i}")
        slots = [pool.slot_of(k) for k in page_keys(chain_seed(e.cache.fingerprint), p, P)]
        step = 1 if blocks_run == "up" else -1
        assert slots == list(range(slots[0], slots[0] + 8 * step, step)), (i, slots)
