"""The tier chain: host, then store tiers walked in order (an in-memory tier from tests/, a disk
tier, a Mooncake tier on a real master on loopback). Every engine is a `FakeEngine` that checks
every byte it loads; a fresh engine (its own empty host tier) can only hit from the stores.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from fake_engine import FakeEngine, FakeStates, config, settle
from memory_tier import MemoryTier

from hicache import load_config
from hicache.backends.breaker import CircuitBreaker
from hicache.config import ConfigError

pytestmark = pytest.mark.mooncake

HERE = Path(__file__).resolve().parent
P = 4  # tokens per page in `config()`


def prompt(seed: int, n: int = 42) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, n).astype(np.int32)


def chain_config(*tiers: dict, host_pages: int = 64, **policy: object) -> dict:
    cfg = config(host_pages=host_pages, **policy)
    cfg["tiers"] += list(tiers)
    return cfg


def memory(space: str, **kw: object) -> dict:
    return {"type": "memory", "space": space, "group_pages": 2, **kw}


def mooncake(master, **kw: object) -> dict:
    return {"type": "mooncake", **master.tier_config, "group_pages": 2, **kw}


def disk(path: Path, **kw: object) -> dict:
    return {"type": "disk", "path": str(path), "size": "64MiB", "group_pages": 2, **kw}


def fresh_tier(kind: str, master, tmp_path: Path, **kw: object) -> dict:
    """A section of a store tier of `kind` that holds nothing yet."""
    if kind == "memory":
        return memory(uuid.uuid4().hex, **kw)
    if kind == "mooncake":
        return mooncake(master, key_prefix=f"t{uuid.uuid4().hex[:12]}", **kw)
    return disk(tmp_path / "d", **kw)


def link(engine: FakeEngine, name: str):
    return next(x for x in engine.cache._chain.links if x.name == name)


@pytest.fixture
def engines() -> Iterator[Callable[..., FakeEngine]]:
    made: list[FakeEngine] = []

    def make(cfg: dict, **kw: object) -> FakeEngine:
        e = FakeEngine(cfg, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.cache.close()


def test_a_walk_takes_each_tier_s_groups_in_order_and_promotes_them(mooncake_master, engines):
    """Mooncake holds all 5 groups of a prompt, the memory tier above it the first 2: a fresh
    cache gets groups 0-1 from memory and 2-4 from Mooncake (asked only for those), loads
    every byte exactly, counts each tier's tokens under its name, and puts Mooncake's groups
    behind to the memory tier above it. Asked again, the pages are host hits."""
    space = uuid.uuid4().hex
    p = prompt(101)  # 10 full pages, 5 groups of 2
    both = engines(chain_config(mooncake(mooncake_master)))
    both.run("w", p)
    top = engines(chain_config(memory(space)))
    top.run("w", p[:16])  # 4 pages: groups 0-1 in memory
    settle(both), settle(top)
    assert len(MemoryTier.spaces[space]) == 2
    MemoryTier.calls[space].clear()

    reader = engines(chain_config(memory(space), mooncake(mooncake_master), host_pages=128))
    reader.cache.poll()  # fills the fetch reserves: a fetch that fits is one get
    m = reader.run("r", p)  # checks every loaded page
    assert (m.hit_tokens, m.tier_tokens) == (40, (("memory", 16), ("mooncake", 24)))
    settle(reader)
    s = reader.cache.stats()
    assert (s["hit_tokens_memory"], s["hit_tokens_mooncake"], s["hit_tokens_host"]) == (16, 24, 0)
    assert (s["pages_fetched_memory"], s["pages_fetched_mooncake"]) == (4, 6)
    assert (s["fetches_memory"], s["fetches_mooncake"]) == (1, 1)
    # one get into the fetch reserve for memory (groups 0-4, a miss at 2 ends it), then the
    # promotion of Mooncake's three groups (and nothing else: the first two came from memory)
    assert MemoryTier.calls[space] == [("get", 5), ("put", 3)]
    assert len(MemoryTier.spaces[space]) == 5
    # the reader's own store puts to Mooncake the two groups it was not asked about (Mooncake
    # answers 0 for an object it holds); the memory tier knows it holds all five
    assert s["objects_put_memory"] == 3 and s["objects_put_mooncake"] == 2

    again = reader.run("r2", p)
    assert (again.hit_tokens, again.tier_tokens) == (40, ())  # promoted: in the host tier now
    assert reader.cache.stats()["hit_tokens_host"] == 40


def test_a_tier_that_is_down_or_fails_is_passed_over_and_the_walk_goes_on_below(
    mooncake_master, engines
):
    """The decision: a tier that cannot answer never ends the walk. Unavailable, it is not
    asked (skipped_down); failing its call, it counts the error; either way the tier below it
    is asked from the same page and the hit comes whole from there."""
    space = uuid.uuid4().hex
    p, q = prompt(102), prompt(103)
    writer = engines(chain_config(memory(space), mooncake(mooncake_master)))
    writer.run("w", p)
    writer.run("w2", q)
    settle(writer)
    writes = len(MemoryTier.calls[space])

    reader = engines(chain_config(memory(space), mooncake(mooncake_master)))
    store = link(reader, "memory").store
    store.down = True  # not available: not asked
    m = reader.run("r", p)
    assert (m.hit_tokens, m.tier_tokens) == (40, (("mooncake", 40),))
    settle(reader)  # the promotion of r's groups is offered while the tier is still down
    assert reader.cache.stats()["skipped_down_memory"] == 1
    assert reader.cache.stats()["call_errors_memory"] == 0

    store.down, store.fail = False, True  # available, but its call fails
    m = reader.run("r2", q)
    assert (m.hit_tokens, m.tier_tokens) == (40, (("mooncake", 40),))
    settle(reader)
    s = reader.cache.stats()
    # the fetch's call failed, and so did the put of the groups promoted from Mooncake: never a
    # hit. A failed put leaves its groups unheld, so the request's own store may offer them
    # again (a third failed call) if that failure was applied before the store.
    calls = [op for op, _ in MemoryTier.calls[space][writes:]]
    assert calls[0] in ("exists", "get") and set(calls[1:]) == {"put"} and len(calls) in (2, 3)
    assert (s["call_errors_memory"], s["get_failed_memory"], s["hit_tokens_memory"]) == (
        len(calls),
        0,
        0,
    )


def test_on_evict_writes_a_group_only_when_the_host_runs_short(engines):
    """write: on_evict (write-back): nothing is put while the host tier has room; once it runs
    short, its groups not yet written are put before they can be evicted, so a prompt evicted
    from the host still hits, from the tier, with its own bytes."""
    space = uuid.uuid4().hex
    cfg = chain_config(memory(space, write="on_evict", fetch_reserve=0), host_pages=16)
    e = engines(cfg)
    a, b, c = prompt(111, 33), prompt(112, 33), prompt(113, 33)  # 8 pages each
    e.run("a", a)
    settle(e)
    assert e.cache.stats()["write_back_pending_memory"] == 4
    assert MemoryTier.spaces.get(space, {}) == {}  # the host has room: nothing written
    e.run("b", b)  # the host is full now
    settle(e)
    s = e.cache.stats()
    assert (s["objects_put_memory"], s["write_back_pending_memory"], s["evict_lost_memory"]) == (
        8,
        0,
        0,
    )
    e.run("c", c)  # evicts the 8 least recently used pages, a's or b's
    settle(e)
    assert e.cache.stats()["pages_evicted"] == 8
    got = {e.run("a2", a).tier_tokens, e.run("b2", b).tier_tokens}  # checks the bytes
    assert got == {(), (("memory", 32),)}  # one from the host, the evicted one from the tier


def test_a_group_evicted_before_its_write_back_is_counted_lost(engines):
    """A write-back that cannot keep up (the tier is down meanwhile) loses the groups the host
    evicts first: counted, never a wrong hit."""
    space = uuid.uuid4().hex
    e = engines(chain_config(memory(space, write="on_evict", fetch_reserve=0), host_pages=16))
    link(e, "memory").store.down = True
    for i in range(3):
        e.run(f"r{i}", prompt(120 + i, 33))
    s = e.cache.stats()
    assert (s["evict_lost_memory"], s["write_back_pending_memory"]) == (4, 8)
    assert s["objects_put_memory"] == 0


def test_a_private_tier_is_asked_only_for_groups_the_chain_put_there(engines):
    """A tier that is neither shared nor persistent starts empty and only the chain writes it:
    a group it never put there is a miss without a call."""
    space = uuid.uuid4().hex
    e = engines(chain_config({**memory(space), "type": "memory_private"}))
    m = e.run("a", prompt(130))
    settle(e)
    assert m.hit_tokens == 0
    assert e.cache.stats()["skipped_unheld_memory_private"] == 1
    assert MemoryTier.calls[space] == [("put", 5)]


def test_the_cost_model_follows_the_reported_prefill_speed(engines):
    """With the defaults a fetch is taken (reading 64 bytes beats computing 4 tokens); once the
    engine reports a prefill so fast that recomputing wins, the tier is skipped, but for one
    fetch in EXPLORE_EVERY that measures it again. A completed get teaches the tier's rate."""
    from hicache.core.cost import EXPLORE_EVERY

    space = uuid.uuid4().hex
    writer = engines(chain_config(memory(space)))
    p = prompt(140)
    writer.run("w", p)
    settle(writer)
    reader = engines(chain_config(memory(space)))
    assert reader.cache.stats()["read_mbps_memory"] == 1000  # MemoryTier.read_gbps
    assert reader.run("r", p).tier_tokens == (("memory", 40),)
    assert link(reader, "memory").read.samples == 1
    for _ in range(30):  # the moving average follows: 1e12 tokens/s
        reader.cache.report_prefill(10**12, 1.0)
    assert reader.cache.stats()["prefill_tokens_per_s"] > 0.99e12
    hits = [reader.run(f"x{i}", prompt(1000 + i)).hit_tokens for i in range(EXPLORE_EVERY)]
    assert hits == [0] * EXPLORE_EVERY  # none of these prompts is held anywhere
    s = reader.cache.stats()
    assert (s["skipped_slow_memory"], s["fetches_memory"]) == (EXPLORE_EVERY - 1, 2)


@pytest.mark.parametrize("tier", ["memory", "mooncake", "disk"])
@pytest.mark.parametrize(
    ("n", "hit"),
    [(704, 640), (705, 704), (703, 640)],
)
def test_a_sliding_window_hit_is_the_longest_usable_one(tier, n, hit, mooncake_master, tmp_path):
    """#22.6: page 16, groups of 4. A tier holds the states at pages 40 and 44 of a 704-token
    prompt; a fresh cache asking for exactly 704 tokens can use at most 703 (43 pages), so the
    state at 44 is past the cap: the hit is the one at 40 (640 tokens), not 0."""
    P16 = 16
    cfg = config(page_tokens=P16, page_bytes=64, host_pages=128, state_bytes=32, state_slots=32)
    cfg["tiers"].append(fresh_tier(tier, mooncake_master, tmp_path, group_pages=4))
    p = prompt(150, 705)
    writer = FakeEngine(cfg, num_blocks=64, states=FakeStates(2, 32, history_tokens=64))
    try:
        writer.run("w1", p[:660])  # states at 41, 40 (and the group end 40)
        writer.run("w2", p[:n])  # states at its last two pages (and its last group end)
        settle(writer)
    finally:
        writer.cache.close()
    reader = FakeEngine(cfg, num_blocks=64, states=FakeStates(2, 32, history_tokens=64))
    try:
        m = reader.run("r", p[:n])  # checks the pages and the state
        assert (m.hit_tokens, m.fetched_tokens, m.needs_state) == (hit, hit, True)
    finally:
        reader.cache.close()


@pytest.mark.parametrize("tier", ["memory", "mooncake", "disk"])
def test_without_states_a_prompt_of_whole_groups_hits_up_to_its_cap(
    tier, mooncake_master, tmp_path
):
    """The same prompt on a layout without states: 43 of its 44 pages (688 tokens)."""
    cfg = config(page_tokens=16, page_bytes=64, host_pages=128)
    cfg["tiers"].append(fresh_tier(tier, mooncake_master, tmp_path, group_pages=4))
    p = prompt(151, 704)
    writer = FakeEngine(cfg, num_blocks=64)
    try:
        writer.run("w", p)
        settle(writer)
    finally:
        writer.cache.close()
    reader = FakeEngine(cfg, num_blocks=64)
    try:
        m = reader.run("r", p)
        assert (m.hit_tokens, m.fetched_tokens) == (688, 688)
    finally:
        reader.cache.close()


@pytest.mark.parametrize("tier", ["memory", "mooncake", "disk"])
def test_the_pages_past_the_last_whole_group_reach_a_second_instance(
    tier, mooncake_master, tmp_path
):
    """A prompt of 10 pages and 5 tokens, in groups of 4 pages: the writer puts 2 groups and a
    tail of 2 pages. A fresh instance asked the same prompt hits all 10 pages; asked its first
    160 tokens, 9 (the cap: a token is left to compute), from the same tail; asked a longer
    prompt, the 2 whole groups (the tail ends where that prompt does not)."""
    cfg = config(page_tokens=16, page_bytes=64, host_pages=128)
    cfg["tiers"].append(fresh_tier(tier, mooncake_master, tmp_path, group_pages=4))
    p = prompt(171, 240)
    writer = FakeEngine(cfg, num_blocks=64)
    try:
        writer.run("w", p[:165])
        settle(writer)
        assert writer.cache.stats()[f"objects_put_{tier}"] == 3
    finally:
        writer.cache.close()
    for n, hit in [(165, 160), (160, 144), (240, 128)]:
        reader = FakeEngine(cfg, num_blocks=64)
        try:
            m = reader.run("r", p[:n])  # checks every page it loads
            assert (m.hit_tokens, m.fetched_tokens) == (hit, hit), n
        finally:
            reader.cache.close()


def test_host_disk_mooncake_hits_from_each_tier_and_disk_survives_a_restart(
    mooncake_master, tmp_path
):
    """host + disk + mooncake. A writer stores a prompt's first 2 groups through the chain and
    closes (close drains the disk's writes); a second writer with Mooncake alone stores all 5.
    A new process on the same disk directory hits 2 groups from disk and 3 from Mooncake, with
    exact bytes."""
    d = tmp_path / "disk"
    key_prefix = f"chain{uuid.uuid4().hex[:8]}"
    full = chain_config(disk(d), mooncake(mooncake_master, key_prefix=key_prefix))
    p = prompt(160)
    w = FakeEngine(full)
    w.run("w", p[:16])  # 4 pages: groups 0-1, to disk and Mooncake
    w.cache.close()  # drains the disk's write-behind: nothing waits for a settle
    m_only = FakeEngine(chain_config(mooncake(mooncake_master, key_prefix=key_prefix)))
    try:
        m_only.run("w", p)
        settle(m_only)
    finally:
        m_only.cache.close()

    script = textwrap.dedent(
        f"""
        import json, sys
        sys.path.insert(0, {str(HERE)!r})
        import numpy as np
        from fake_engine import FakeEngine
        cfg = json.loads({json.dumps(json.dumps(full))})
        p = np.array({p.tolist()}, dtype=np.int32)
        e = FakeEngine(cfg)
        m = e.run("r", p)
        while not e.cache.tiers_idle:
            e.cache.poll()
        e.cache.poll()
        print(json.dumps({{"hit": m.hit_tokens, "tiers": m.tier_tokens, **e.cache.stats()}}))
        e.cache.close()
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600, check=True
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["hit"] == 40
    assert got["tiers"] == [["disk", 16], ["mooncake", 24]]
    assert (got["hit_tokens_disk"], got["hit_tokens_mooncake"]) == (16, 24)
    assert got["objects_put_disk"] == 3  # Mooncake's groups promoted to the disk above it


def test_a_tier_from_an_entry_point_and_one_from_a_module_path(tmp_path, monkeypatch):
    """A package declares a tier in the `hicache.tiers` entry-point group: naming its type in
    a config loads it, and a cache stores and hits through it. `type: module:Class` names a
    registered class directly."""
    (tmp_path / "ep_tier.py").write_text(
        textwrap.dedent(
            """
            from typing import Literal

            from memory_tier import MemoryConfig, MemoryTier

            from hicache.registry import register_tier


            class EntryConfig(MemoryConfig):
                type: Literal["from_entry_point"] = "from_entry_point"


            @register_tier("from_entry_point", EntryConfig)
            class EntryTier(MemoryTier):
                pass
            """
        )
    )
    info = tmp_path / "ep_tier-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ep-tier\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[hicache.tiers]\nfrom_entry_point = ep_tier\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "ep_tier", raising=False)

    space = uuid.uuid4().hex
    cfg = chain_config({"type": "from_entry_point", "space": space, "group_pages": 2})
    assert type(load_config(cfg, env={}).tiers[1]).__name__ == "EntryConfig"
    writer = FakeEngine(cfg)
    writer.run("w", prompt(170))
    settle(writer)
    reader = FakeEngine(cfg)
    try:
        m = reader.run("r", prompt(170))
        assert (m.hit_tokens, m.tier_tokens) == (40, (("from_entry_point", 40),))
    finally:
        writer.cache.close()
        reader.cache.close()

    by_path = chain_config({"type": "memory_tier:PrivateMemoryTier", "space": space})
    assert load_config(by_path, env={}).tiers[1].type == "memory_private"
    with pytest.raises(ConfigError, match=r"tiers\.1\.type: cannot load tier class 'nowhere:X'"):
        load_config(chain_config({"type": "nowhere:X"}), env={})
    with pytest.raises(ConfigError, match=r"tiers\.1\.type: unknown tier type 'nothing'"):
        load_config(chain_config({"type": "nothing"}), env={})


def test_two_tiers_of_one_type_need_their_own_names(engines):
    """Names key the stats, metrics and events: two memory tiers are told apart by `name:`."""
    a, b = uuid.uuid4().hex, uuid.uuid4().hex
    with pytest.raises(ConfigError, match="each tier needs its own name"):
        load_config(chain_config(memory(a), memory(b)), env={})
    e = engines(chain_config(memory(a, name="near"), memory(b, name="far")))
    e.run("w", prompt(180))
    settle(e)
    s = e.cache.stats()
    assert (s["objects_put_near"], s["objects_put_far"]) == (5, 5)


def test_a_tier_without_a_breaker_of_its_own_gets_one_from_the_chain(engines):
    """The memory tier keeps no breaker: the chain opens one for it after `breaker_failures`
    failed calls in a row (it is then passed over, and offered no writes), and lets one call
    through after `breaker_reprobe_s`; the call's success closes it. The breaker reads a clock
    of the test's (the chain's takes the same settings), so that the interval passes when the
    test says, however long the calls take."""
    space = uuid.uuid4().hex
    e = engines(chain_config(memory(space, breaker_failures=3, breaker_reprobe_s=0.3)))
    chain_link, now = link(e, "memory"), [0.0]
    chain_link.breaker = CircuitBreaker(3, 0.3, clock=lambda: now[0])
    store = chain_link.store
    store.fail = True
    for i in range(2):  # a failed get and a failed put, then a failed get that opens it
        e.run(f"f{i}", prompt(190 + i))
        settle(e)
    s = e.cache.stats()
    assert (s["call_errors_memory"], s["puts_skipped_memory"], s["available_memory"]) == (3, 5, 0)
    e.run("f2", prompt(192))
    assert e.cache.stats()["skipped_down_memory"] == 1
    now[0] += 0.3
    store.fail = False
    e.run("f3", prompt(193))  # the probe: a get that answers (a miss), so the breaker closes
    settle(e)
    s = e.cache.stats()
    assert (s["available_memory"], s["fetches_memory"], s["objects_put_memory"]) == (1, 3, 5)


def test_close_writes_back_what_a_persistent_on_evict_tier_still_lacks(tmp_path):
    """write: on_evict on the disk: while the host has room nothing is written, and `close`
    writes back every group still waiting (the disk is persistent), so a cache started on the
    same directory afterwards hits them all from disk."""
    cfg = chain_config(disk(tmp_path / "d", write="on_evict"))
    p = prompt(200)
    writer = FakeEngine(cfg)
    writer.run("w", p)
    settle(writer)
    s = writer.cache.stats()
    assert (s["objects_put_disk"], s["write_back_pending_disk"]) == (0, 5)
    writer.cache.close()
    reader = FakeEngine(cfg)
    try:
        m = reader.run("r", p)
        assert (m.hit_tokens, m.tier_tokens) == (40, (("disk", 40),))
    finally:
        reader.cache.close()


def test_a_request_asked_with_another_prompt_forgets_its_walk_and_its_slots(engines):
    """A request's walk brought pages from the memory tier (pinned by the fetch until the
    answer takes them); asked again with a prompt that does not extend the first, the request
    starts afresh and the old walk's slots are released, not left pinned for good."""
    space = uuid.uuid4().hex
    p = prompt(303)
    writer = engines(chain_config(memory(space)))
    writer.run("w", p)
    settle(writer)
    reader = engines(chain_config(memory(space), fetch_pending="wait"))
    reader.cache.poll()
    assert reader.cache.match("r", p).pending
    settle(reader)  # the fetch is in: its pages are published and pinned by it
    s = reader.cache.stats()
    assert s["host_pinned"] - s["fetch_reserve_memory"] > 0
    reader.cache.match("r", prompt(304))
    reader.cache.release("r")
    s = reader.cache.stats()
    assert s["host_pinned"] - s["fetch_reserve_memory"] == 0


RECORD = 4096 + 2 * 64  # a disk record of a group of `config()`'s pages: its header block, 2 pages


def put_names(e: FakeEngine) -> list[str]:
    """The names of the objects the engine's first store tier is asked to put, from now on."""
    store = e.cache._chain.links[0].store
    names: list[str] = []
    real = store.put_from

    def spy(keys, buffers):
        names.extend(keys)
        return real(keys, buffers)

    store.put_from = spy
    return names


@pytest.mark.parametrize("kind", ["disk", "mooncake"])
def test_a_group_the_tier_dropped_is_put_again(kind, mooncake_master, tmp_path):
    """The tier loses a prompt's groups after the chain put them: the disk tier's own LRU
    evicts them (room for 2 prompts of 5 groups: a third evicts the first), or they are
    removed from Mooncake. The prompt then comes again (the host tier has evicted it too): its
    fetch finds the groups missing, it is recomputed, and its store puts them again, so a
    fresh engine hits it whole from the tier. Before, the link remembered having put them and
    never put them again."""
    if kind == "disk":
        tier = disk(tmp_path / "d", size=10 * RECORD)
    else:
        tier = mooncake(mooncake_master, key_prefix=f"t{uuid.uuid4().hex[:12]}")
    cfg = chain_config(tier, host_pages=16)
    a = prompt(300)
    e = FakeEngine(cfg)
    try:
        names = put_names(e)
        e.run("a", a)
        settle(e)
        dropped = list(names)
        assert len(dropped) == 5
        if kind == "mooncake":
            assert e.cache._chain.links[0].store.remove(dropped, force=True) == [0] * 5
        for i, other in enumerate((prompt(301), prompt(302))):  # evict a from the host (and disk)
            e.run(f"o{i}", other)
            settle(e)
        m = e.run("a2", a)
        assert m.hit_tokens == 0
        settle(e)
        assert names[-5:] == dropped  # put again
    finally:
        e.cache.close()
    reader = FakeEngine(cfg)
    try:
        assert reader.run("r", a).tier_tokens == ((kind, 40),)  # checks every loaded byte
    finally:
        reader.cache.close()


def test_a_group_held_in_the_host_is_offered_again_once_the_tiers_word_is_old(tmp_path):
    """A prompt stays in the (large) host tier while the disk tier's LRU evicts its groups
    (two other prompts fill the disk). Requests for it hit the host and store it again; once
    the link's record of having put it is older than `HELD_TRUST_S`, that store puts its
    groups again, so the disk holds the prompt once more (a fresh engine hits it from disk).
    Before, a group put once was never put again while the link remembered it."""
    from hicache.chain.fetch import HELD_TRUST_S

    cfg = chain_config(disk(tmp_path / "d", size=10 * RECORD), host_pages=64)
    a = prompt(310)
    e = FakeEngine(cfg)
    try:
        e.run("a", a)
        for i, other in enumerate((prompt(311), prompt(312))):
            e.run(f"o{i}", other)
            settle(e)
        store = e.cache._chain.links[0].store
        assert store.stats().evicted == 5  # a's groups are gone from the disk
        assert e.run("a2", a).tier_tokens == ()  # from the host: the disk is not asked
        settle(e)
        assert store.stats().keys_put == 15  # a's, o0's and o1's: a not put again yet
        real = time.monotonic
        link(e, "disk").clock = lambda: real() + HELD_TRUST_S + 1
        assert e.run("a3", a).tier_tokens == ()
        settle(e)
        assert store.stats().keys_put == 20
    finally:
        e.cache.close()
    reader = FakeEngine(cfg)
    try:
        assert reader.run("r", a).tier_tokens == (("disk", 40),)  # checks every loaded byte
    finally:
        reader.cache.close()


def test_groups_whose_pages_the_host_dropped_behind_slow_puts_are_counted_by_the_tier(engines):
    """A store slower than the engine: each put pins the host slots of its groups until it
    returns, so while the puts of five prompts are out (50 pages) beside the fetch reserve (8),
    the sixth prompt's last 4 pages find no slot and the host drops them (`pages_dropped`).
    Their 2 groups never reach the tier: it counts them dropped, so that every group the
    engine stored is put, failed, dropped or skipped there. (Before, the tier counted nothing
    for them: 28 of 30 groups put and none failed, as a loaded machine's slow puts showed.)"""
    e = engines(chain_config(memory(uuid.uuid4().hex)))
    store = link(e, "memory").store
    go, real = threading.Event(), store.put_from

    def held(keys, buffers):
        go.wait(60)
        return real(keys, buffers)

    store.put_from = held
    for i in range(6):
        e.run(f"r{i}", prompt(320 + i))  # 10 pages each: 5 groups of 2
    go.set()
    settle(e)
    s = e.cache.stats()
    assert (s["pages_stored"], s["pages_dropped"]) == (56, 4)
    assert (s["objects_put_memory"], s["puts_dropped_memory"], s["put_failed_memory"]) == (28, 2, 0)
    assert s["puts_skipped_memory"] == 0
