"""A Mooncake tier through the cache, against a real mooncake_master on loopback.

Every engine here is a fresh `FakeEngine` with its own host tier, so a hit it gets on a prompt it
never saw can only have come from the store; every loaded byte is checked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from fake_engine import FakeEngine, FakeStates, config, kv_bytes

from hicache.backends.envelope import HEADER
from hicache.core import native

pytestmark = pytest.mark.mooncake

P = 4
HERE = Path(__file__).resolve().parent


def mooncake_config(
    master,
    *,
    group_pages: int = 2,
    fetch_reserve: int | None = None,
    host_pages: int = 64,
    **policy,
) -> dict:
    """Two fetch workers, as on the hosts engines run on (the default gives 2-core machines,
    such as CI's, one)."""
    cfg = config(host_pages=host_pages, **policy)
    tier = {"type": "mooncake", **master.tier_config, "group_pages": group_pages}
    tier["fetch_workers"] = 2
    if fetch_reserve is not None:
        tier["fetch_reserve"] = fetch_reserve
    cfg["tiers"].append(tier)
    return cfg


def wait_until(cond: Callable[[], bool], engine: FakeEngine | None = None, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        if engine is not None:
            engine.cache.poll()
        time.sleep(0.01)


def settled(engine: FakeEngine) -> None:
    """Wait until the write-behind queue has drained and its results are applied."""
    wait_until(lambda: engine.cache.tiers_idle, engine)


@pytest.fixture
def engines(mooncake_master) -> Iterator[Callable[..., FakeEngine]]:
    made: list[FakeEngine] = []

    def make(cfg: dict | None = None, **kw) -> FakeEngine:
        e = FakeEngine(cfg or mooncake_config(mooncake_master), **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.cache.close()


def prompt(seed: int, n: int = 42) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30_000, n, dtype=np.int32)


def remove_group(
    writer: FakeEngine, tokens: np.ndarray, last_page: int, group: int | None = 2
) -> None:
    """Remove from the store the group of 2 pages that ends at `last_page` of `tokens` (with
    `group` None: the state there), as another client would."""
    from hicache.core.keys import chain_seed, page_keys, store_key

    fp = writer.cache.fingerprint
    keys = page_keys(chain_seed(fp), tokens, P)
    name = store_key("hicache", fp, keys[last_page], group)
    assert writer.cache._chain.links[0].store.remove([name], force=True) == [0]


def test_a_fetch_that_fits_the_reserve_is_one_get_and_a_missing_group_ends_it(
    mooncake_master, engines
):
    writer = engines()
    p = prompt(4)
    writer.run("w", p)
    settled(writer)
    remove_group(writer, p, 5)  # group 2: pages 4, 5
    reader = engines(
        mooncake_config(mooncake_master, fetch_reserve=16 * 64)
    )  # 16 pages of 64 bytes
    reader.cache.poll()  # fills the reserve
    assert reader.cache.stats()["fetch_reserve_mooncake"] == 8  # an eighth of the 64 host pages
    m = reader.cache.match("r", p[:34])  # 8 full pages: fits the reserve
    assert m.pending
    wait_until(
        lambda: len(reader.cache._chain.links[0]._results) == 1
    )  # the get answered; no poll yet
    m = reader.cache.match("r", p[:34])  # asking again takes the answer at once
    assert (m.hit_tokens, m.fetched_tokens) == (16, 16)  # groups 0, 1; group 2 is missing
    s = reader.cache.stats()
    assert (
        s["fetches_mooncake"] == 1
        and s["get_failed_mooncake"] == 0
        and s["pages_fetched_mooncake"] == 4
    )
    h = reader.cache.histograms()
    assert h["hicache_tier_exists_seconds:mooncake"]["buckets"][-1][1] == 0  # no exists was asked
    assert h["hicache_tier_get_seconds:mooncake"]["buckets"][-1][1] == 1
    blocks = reader.allocate(9)
    reader.cache.load(m, blocks)
    for i in range(4):
        assert np.array_equal(reader.page(blocks[i]), kv_bytes(p, (i + 1) * P, 64))
    reader.cache.release("r")
    reader.cache.poll()
    assert reader.cache.stats()["fetch_reserve_mooncake"] == 8  # refilled
    reader.cache.host.page_slots.check()


def test_the_poll_that_finishes_a_fetch_leaves_the_refill_to_the_next_one(mooncake_master, engines):
    """The request a fetch answers is matched right after the poll that applies it: that poll
    does not stop to refill the reserve while half of it is left; the next poll does."""
    writer = engines()
    p = prompt(13, 17)  # 4 full pages: 2 groups
    writer.run("w", p)
    settled(writer)
    reader = engines(mooncake_config(mooncake_master, fetch_reserve=16 * 64))
    reader.cache.poll()
    assert reader.cache.stats()["fetch_reserve_mooncake"] == 8
    assert reader.cache.match("r", p).pending  # 4 of the 8 reserved slots lent to the get
    wait_until(lambda: len(reader.cache._chain.links[0]._results) == 1)
    reader.cache.poll()  # applies the get: 4 left of 8, not refilled yet
    assert reader.cache.stats()["fetch_reserve_mooncake"] == 4
    m = reader.cache.match("r", p)
    assert (m.pending, m.hit_tokens, m.fetched_tokens) == (False, 16, 16)
    reader.cache.poll()
    assert reader.cache.stats()["fetch_reserve_mooncake"] == 8
    reader.cache.release("r")


def test_a_fetch_of_objects_the_store_does_not_hold_gives_its_slots_back_to_the_reserve(
    mooncake_master, engines
):
    """A get from the reserve that reads nothing returns the same slots to the reserve: no
    refill, no eviction, and nothing left pinned but the reserve."""
    reader = engines(mooncake_config(mooncake_master, fetch_reserve=16 * 64))
    reader.cache.poll()  # fills the reserve
    before = sorted(reader.cache._chain.links[0].fetcher.reserve.slots)
    assert len(before) == 8
    m = reader.cache.match("r", prompt(21, 34))  # 8 full pages that L3 has never seen
    assert (
        m.pending and reader.cache.stats()["fetch_reserve_mooncake"] == 0
    )  # all 8 lent to the get
    wait_until(lambda: len(reader.cache._chain.links[0]._results) == 1)
    pool, reserved = reader.cache.host.page_slots, []
    pool.reserve = lambda n: reserved.append(n) or type(pool).reserve(pool, n)
    reader.cache.poll()  # applies the get: every group missing
    reader.cache.poll()
    del pool.reserve
    assert reserved == []  # the reserve was never refilled: its own slots came back
    assert sorted(reader.cache._chain.links[0].fetcher.reserve.slots) == before
    m = reader.cache.match("r", prompt(21, 34))
    assert (m.pending, m.hit_tokens, m.fetched_tokens) == (False, 0, 0)
    reader.cache.release("r")
    s = reader.cache.stats()
    assert (s["get_failed_mooncake"], s["pages_fetched_mooncake"]) == (
        0,
        0,
    )  # a miss, not a failure
    assert s["host_pinned"] == s["fetch_reserve_mooncake"] == 8
    reader.cache.host.page_slots.check()


@pytest.mark.parametrize("tokens", [34, 42])  # 8 pages: one get; 10: exists, then get
@pytest.mark.parametrize("prep", [2, 3, 128])
def test_the_engine_thread_hashes_a_fetch_only_up_to_its_bound(
    mooncake_master, engines, monkeypatch, tokens, prep
):
    """The engine thread hashes the first ENGINE_PREP_PAGES pages of a fetch, the worker the
    rest (with the GIL dropped), and the hit is the same either way, every byte checked."""
    import hicache.chain.fetch as l3
    import hicache.chain.jobs as l3_worker

    monkeypatch.setattr(l3, "ENGINE_PREP_PAGES", prep)
    writer = engines()
    p = prompt(5, tokens)
    writer.run("w", p)
    settled(writer)
    by_worker: list[int] = []
    hash_pages = l3_worker.page_keys

    def spy(prev, data, page_tokens, release_gil=False):
        if release_gil:
            by_worker.append(data.shape[0] // page_tokens)
        return hash_pages(prev, data, page_tokens, release_gil=release_gil)

    monkeypatch.setattr(l3_worker, "page_keys", spy)
    reader = engines()
    reader.cache.poll()  # fills the fetch reserve
    m = reader.run("r", p)
    pages = (tokens - 1) // P
    assert (m.hit_tokens, m.fetched_tokens) == (pages * P, pages * P)
    assert by_worker == ([pages - prep] if prep < pages else [])
    probes = reader.cache.histograms()["hicache_tier_exists_seconds:mooncake"]["buckets"][-1][1]
    assert probes == (1 if pages > 8 else 0)  # the reserve holds 8 pages (an eighth)


def test_a_fresh_process_hits_from_l3_with_exact_bytes_and_puts_nothing_again(
    mooncake_master, engines
):
    writer = engines()
    p = prompt(1)
    writer.run("w", p)
    settled(writer)
    assert writer.cache.stats()["objects_put_mooncake"] == 5  # 10 full pages in groups of 2

    script = f"""
import json, sys
sys.path.insert(0, {str(HERE)!r})
import numpy as np
from test_mooncake_tier import mooncake_config, settled, wait_until
from fake_engine import FakeEngine
class M: tier_config = json.loads(sys.argv[1])
e = FakeEngine(mooncake_config(M))
p = np.array(json.loads(sys.argv[2]), dtype=np.int32)
m = e.run("r", p)          # checks every loaded byte against a recompute
settled(e)
print(json.dumps({{"hit": m.hit_tokens, "l3": m.fetched_tokens, **e.cache.stats()}}))
e.cache.close()
"""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            script,
            json.dumps(mooncake_master.tier_config),
            json.dumps(p.tolist()),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONHASHSEED": "7"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    # 42 tokens: 10 pages, capped at 41 tokens -> 10 pages usable, all from L3
    assert (got["hit"], got["l3"], got["hit_tokens_host"]) == (40, 40, 0)
    assert got["pages_fetched_mooncake"] == 10
    assert got["objects_put_mooncake"] == 0 and got["put_failed_mooncake"] == 0


def test_a_store_after_a_prefix_hit_puts_only_its_new_groups_with_their_own_bytes(
    mooncake_master, engines
):
    """The second request holds 4 pages in the host tier and computes 6: write-behind puts
    the 3 new groups from the slots the store has just filled (it does not look them up)."""
    writer = engines()
    p = prompt(21)  # 10 full pages: 5 groups
    writer.run("a", p[:17])  # 4 full pages: groups 0 and 1
    settled(writer)
    assert writer.run("b", p).hit_tokens == 16
    settled(writer)
    assert writer.cache.stats()["objects_put_mooncake"] == 5  # 2, then 3
    reader = engines()
    m = reader.run("r", p)  # checks every loaded byte against a recompute
    assert (m.hit_tokens, m.fetched_tokens) == (40, 40)


def test_an_engine_that_sleeps_is_woken_when_its_fetch_has_landed(mooncake_master, engines):
    """An idle engine loop waits on `wake` instead of polling: it is woken once the fetch's
    result is posted, and the next match takes the hit without a poll in between."""
    writer = engines()
    p = prompt(7)
    writer.run("w", p)
    settled(writer)
    landed = threading.Event()
    reader = engines(wake=landed.set)
    m = reader.cache.match("r", p)
    wakes = 0
    while m.pending:  # clear, then match: a result posted in between is applied, not lost
        assert landed.wait(120)
        landed.clear()
        wakes += 1
        m = reader.cache.match("r", p)  # applies the posted result itself, no poll needed
    assert wakes == 2  # 10 pages do not fit the 8-page reserve: an exists, then the get
    assert (m.hit_tokens, m.fetched_tokens) == (40, 40)
    reader.cache.release("r")


def test_other_fingerprints_and_salts_never_share(mooncake_master, engines):
    writer = engines()
    p = prompt(2)
    writer.run("w", p, salt="tenant-a")
    settled(writer)
    other_tenant = engines()
    assert other_tenant.run("r", p, salt="tenant-b").hit_tokens == 0
    no_tenant = engines()
    assert no_tenant.run("r", p).hit_tokens == 0
    cfg = mooncake_config(mooncake_master)
    cfg["layout"]["kv_dtype"] = "float8_e4m3fn"
    other_dtype = engines(cfg)
    assert other_dtype.run("r", p, salt="tenant-a").hit_tokens == 0
    same = engines()
    m = same.run("r", p, salt="tenant-a")
    assert (m.hit_tokens, m.fetched_tokens) == (40, 40)


def test_an_object_removed_between_exists_and_get_is_never_a_hit(mooncake_master, engines):
    writer = engines()
    p = prompt(3)
    writer.run("w", p)
    settled(writer)
    reader = engines(mooncake_config(mooncake_master, fetch_reserve=0))  # exists, then get
    cache, l3 = reader.cache, reader.cache._chain.links[0]
    m = cache.match("r", p)
    assert m.pending
    wait_until(lambda: len(l3._results) == 1)  # the probe answered; the get is not asked yet
    remove_group(writer, p, 5)  # another client removes group 2 (pages 4, 5) before the get
    m = reader.match("r", p)
    # groups 0 and 1 arrived; group 2 failed, and groups after it are not used
    assert (m.hit_tokens, m.fetched_tokens) == (16, 16)
    s = cache.stats()
    assert s["get_failed_mooncake"] == 3 and s["pages_fetched_mooncake"] == 4
    blocks = reader.allocate(11)
    cache.load(m, blocks)
    for i in range(4):
        assert np.array_equal(reader.page(blocks[i]), kv_bytes(p, (i + 1) * P, 64))
    cache.release("r")


def test_a_hit_is_not_taken_from_l3_when_recomputing_is_cheaper(mooncake_master, engines):
    writer = engines()
    p = prompt(4)
    writer.run("w", p)
    settled(writer)
    # 64-byte pages of 4 tokens: at 1e-9 GB/s a page takes 64 s, recomputing it 4e-4 s
    cfg = mooncake_config(mooncake_master)
    cfg["tiers"][-1]["read_gbps"] = 1e-9
    slow = engines(cfg)
    m = slow.run("r", p)
    assert m.hit_tokens == 0
    assert slow.cache.stats()["skipped_slow_mooncake"] == 1


def test_a_full_store_and_an_oversized_put_never_reach_the_engine(start_mooncake_master, engines):
    # a master of its own: filling the suite's shared store node would fail later tests' puts
    master = start_mooncake_master()
    # one 160 MiB page per object: larger than the 128 MiB segment that holds the objects
    big = config(page_tokens=4, page_bytes=160 << 20, host_pages=3)
    big["tiers"].append({"type": "mooncake", **master.tier_config, "group_pages": 1})
    e = engines(big, num_blocks=3)
    e.run("big", np.arange(9, dtype=np.int32))
    settled(e)
    s = e.cache.stats()
    assert (s["objects_put_mooncake"], s["put_failed_mooncake"]) == (0, 2)
    # many 1 MiB objects: twice what the segment holds; eviction or refusals, no exception
    small = config(page_tokens=4, page_bytes=1 << 20, host_pages=80)
    small["tiers"].append({"type": "mooncake", **master.tier_config, "group_pages": 1})
    e = engines(small, num_blocks=80)
    for i in range(4):
        e.run(f"fill{i}", prompt(100 + i, 4 * 64 + 1))
        settled(e)
    s = e.cache.stats()
    assert s["objects_put_mooncake"] + s["put_failed_mooncake"] == 4 * 64
    assert s["objects_put_mooncake"] >= 64 and s["call_errors_mooncake"] == 0


def test_a_killed_master_never_stalls_the_engine_and_l3_comes_back(start_mooncake_master):
    """No engine-thread call waits on the dead store: none lets go of the GIL (a call that
    waited on the store, or on a worker that does, would)."""
    from gil_watch import GilWatch

    master = start_mooncake_master()
    cfg = mooncake_config(master)
    made = [FakeEngine(cfg)]
    watch = GilWatch()
    try:
        e = made[0]
        e.run("before", prompt(10))
        released: list[str] = []

        def watched(name):
            def call(*a, **kw):
                gave_up, result = watch.released(real[name], *a, **kw)
                if gave_up:
                    released.append(name)
                return result

            return call

        real = {name: getattr(e.cache, name) for name in ("match", "load", "store", "poll")}
        for name in real:
            setattr(e.cache, name, watched(name))
        master.kill()
        for i in range(20):  # requests go on, uncached beyond the host tier
            m = e.run(f"down{i}", prompt(20 + i))
            assert m.hit_tokens == 0
        s = e.cache.stats()
        # how many calls fail, time out or are refused depends on when the dead master's calls
        # return, which the scenario does not fix; that some do, and nothing reaches the engine
        assert s["call_errors_mooncake"] + s["skipped_down_mooncake"] + s["timeouts_mooncake"] > 0
        assert s["puts_skipped_mooncake"] > 0  # once the breaker opened, nothing is offered to it
        if native.enabled():  # the Python fallback's host copies (numpy) let go of the GIL
            assert released == []
        watch.close()  # restores the switch interval for the rest
        for name, fn in real.items():
            setattr(e.cache, name, fn)
        master.restart()
        assert e.cache.wait_ready(60)
        # The process holding the store's segment mounts it again in its own time; until then a
        # put finds no space. Store new prompts until one is put whole (it must come back).
        for attempt in range(40):
            p = prompt(100 + attempt)
            before = e.cache.stats()["objects_put_mooncake"]
            e.run(f"after{attempt}", p)
            settled(e)
            if e.cache.stats()["objects_put_mooncake"] - before == 5:
                break
            time.sleep(0.25)
        else:
            raise AssertionError("no put succeeded within 10 s of the restart")
        fresh = FakeEngine(cfg)
        made.append(fresh)
        m = fresh.run("again", p)
        assert (m.hit_tokens, m.fetched_tokens) == (40, 40)
    finally:
        watch.close()
        for engine in made:
            engine.cache.close()


@pytest.mark.native  # without the C helpers, numpy lets go of the GIL in long array calls
def test_no_engine_thread_call_lets_go_of_the_gil(mooncake_master, engines):
    """The L3 workers wait for the GIL after every call they make; an engine-thread call that
    released it would wait for them. Prompts of 2,048 tokens: numpy releases the GIL for array
    operations that long. A writer puts them; a fresh engine fetches them (match starts the
    fetch, poll applies it), loads them and stores their extension; one request gives its
    tokens as lists of ints, as engines often do."""
    from gil_watch import GilWatch

    cfg = mooncake_config(mooncake_master)
    cfg["tiers"][0]["size"] = 2048 * 64  # 2,048 pages of 64 bytes
    writer, reader = engines(cfg, num_blocks=1024), engines(cfg, num_blocks=1024)
    prompts = [prompt(40 + i, 2048) for i in range(3)]
    for i, p in enumerate(prompts):
        writer.run(f"w{i}", p)
    settled(writer)
    watch = GilWatch()
    released: list[str] = []

    def call(name: str, fn, *args, **kwargs):
        gave_up, result = watch.released(fn, *args, **kwargs)
        if gave_up:
            released.append(name)
        return result

    cache = reader.cache
    try:
        for i, p in enumerate(prompts):
            given = p.tolist() if i == 1 else p  # engines often pass lists of ints
            m = call("match", cache.match, f"r{i}", given)
            deadline = time.monotonic() + 30
            while m.pending:
                assert time.monotonic() < deadline, "the fetch did not land"
                time.sleep(0.002)
                call("poll", cache.poll)
                m = call("match", cache.match, f"r{i}", given)
            assert m.fetched_tokens == 2044  # 511 pages from L3; the last token is recomputed
            blocks = reader.allocate(-(-len(p) // P) + 1)
            call("load", cache.load, m, blocks)
            call("poll", cache.poll)
            longer = np.concatenate([p, prompt(50 + i, 4)])
            reader.compute(longer, blocks, m.hit_tokens // P)
            call("store", cache.store, f"r{i}", longer.tolist() if i == 1 else longer, blocks)
            call("poll", cache.poll)
            call("release", cache.release, f"r{i}")
            reader.free.extend(blocks)
    finally:
        watch.close()
    assert released == []


def test_fetches_behind_a_stalled_store_are_bounded(start_mooncake_master):
    """A master that stops answering holds the fetch worker's call until its timeout; new
    requests do not pile fetch jobs up behind it: beyond fetch_queue_depth they take their
    host hit at once, counted, and fetching resumes once the calls return. The calls are given
    longer than the test can take (a held call that timed out in the middle of it would free a
    place), and return when the master resumes."""
    master = start_mooncake_master()
    cfg = mooncake_config(master, fetch_pending="host_only")
    cfg["tiers"][1].update(fetch_queue_depth=2, call_timeout_s=60.0)
    e = FakeEngine(cfg)
    try:
        e.run("warm", prompt(60))
        settled(e)
        master.pause()
        try:
            for i in range(6):  # each starts a fetch unless two are out already
                m = e.cache.match(f"r{i}", prompt(70 + i))
                assert not m.pending and m.hit_tokens == 0
                e.cache.release(f"r{i}")
            assert e.cache.stats()["skipped_busy_mooncake"] == 4
            assert e.cache.stats()["jobs_in_flight_mooncake"] == 2
        finally:
            master.resume()
        settled(e)  # the held calls return (answered or timed out) and free their places
        m = e.cache.match("again", prompt(80))
        assert e.cache.stats()["skipped_busy_mooncake"] == 4  # this one was offered to the store
        e.cache.release("again")
    finally:
        e.cache.close()


def _threads_of_gets(store, monkeypatch) -> list[str]:
    """The names of the threads that called `store.get_into`, call by call."""
    ran_on: list[str] = []
    real = store.get_into

    def spy(*args):
        ran_on.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(store, "get_into", spy)
    return ran_on


@pytest.mark.parametrize("workers", [1, 2])
def test_each_fetch_worker_has_one_call_out(start_mooncake_master, workers, monkeypatch):
    """A fetch job goes to the least busy of `fetch_workers` threads: with the master paused,
    that many calls are out at once and the others queue. Once it answers, every request gets
    its pages, the jobs spread over the workers."""
    master = start_mooncake_master()
    writer = FakeEngine(mooncake_config(master))
    reader_cfg = mooncake_config(master)
    reader_cfg["tiers"][1]["fetch_workers"] = workers
    reader = FakeEngine(reader_cfg)
    store = reader.cache._chain.links[0].store
    ran_on = _threads_of_gets(store, monkeypatch)
    try:
        prompts = [prompt(120 + i, 17) for i in range(3)]  # 4 full pages each: 2 groups
        for i, p in enumerate(prompts):
            writer.run(f"w{i}", p)
        settled(writer)
        reader.cache.poll()
        calls = store.stats().calls
        master.pause()
        try:
            assert all(reader.cache.match(f"r{i}", p).pending for i, p in enumerate(prompts))
            wait_until(lambda: store.stats().calls - calls == workers)
            # each of the reader's fetch threads is inside a call: none is free to start another
            assert sorted(ran_on) == [f"hicache-mooncake-fetch-{i}" for i in range(workers)]
            assert store.stats().calls - calls == workers
            assert reader.cache.stats()["jobs_in_flight_mooncake"] == 3
        finally:
            master.resume()
        wait_until(lambda: reader.cache.tiers_idle, reader)
        for i, p in enumerate(prompts):
            m = reader.cache.match(f"r{i}", p)
            assert (m.pending, m.hit_tokens, m.fetched_tokens) == (False, 16, 16)
        # the reserve (8 slots) held the first two: a get each; the third asked exists first
        assert store.stats().calls - calls == 4
        assert sorted(set(ran_on)) == [f"hicache-mooncake-fetch-{i}" for i in range(workers)]
    finally:
        writer.cache.close()
        reader.cache.close()


def test_fetches_one_at_a_time_all_run_on_the_first_worker(mooncake_master, engines, monkeypatch):
    """The second fetch worker takes a job only while the first is busy: fetches that never
    overlap all run on the first thread."""
    writer = engines()
    reader = engines()
    store = reader.cache._chain.links[0].store
    ran_on = _threads_of_gets(store, monkeypatch)
    for i in range(4):
        p = prompt(140 + i, 17)
        writer.run(f"w{i}", p)
        settled(writer)
        assert reader.cache.match(f"r{i}", p).pending
        wait_until(lambda: reader.cache.tiers_idle, reader)
        assert reader.cache.match(f"r{i}", p).fetched_tokens == 16
        reader.cache.release(f"r{i}")
    assert ran_on == ["hicache-mooncake-fetch-0"] * 4


def test_asking_again_while_the_fetch_runs_returns_the_same_answer(start_mooncake_master):
    """An engine asks again every step while a request waits for L3: as long as the fetch is
    out, it gets the same pending answer back (its host hit still pinned, nothing walked again);
    once the result is in, the next ask takes it."""
    master = start_mooncake_master()
    writer, reader = FakeEngine(mooncake_config(master)), FakeEngine(mooncake_config(master))
    try:
        p = prompt(90)
        writer.run("w", p)
        settled(writer)
        reader.run("head", p[:9])  # pages 0, 1 in the reader's host tier
        settled(reader)
        master.pause()  # the fetch's get waits for the master
        try:
            m = reader.cache.match("r", p)
            assert m.pending and m.hit_tokens == 8
            pinned = reader.cache.stats()["host_pinned"]
            assert reader.cache.match("r", p) is m
            assert reader.cache.stats()["host_pinned"] == pinned
            other = reader.cache.match("r", p, computed_tokens=4)  # another question: answered anew
            assert other is not m and other.pending and other.hit_tokens == 8
        finally:
            master.resume()
        m = reader.match("r", p)
        assert (m.pending, m.hit_tokens, m.fetched_tokens) == (False, 40, 32)
    finally:
        writer.cache.close()
        reader.cache.close()


def _spy_fetched(monkeypatch) -> list:
    """What `Matcher._fetched` found, call by call (None: the general walk answered)."""
    from hicache.match import Matcher

    answers: list = []
    real = Matcher._fetched

    def spy(self, *args):
        answers.append(real(self, *args))
        return answers[-1]

    monkeypatch.setattr(Matcher, "_fetched", spy)
    return answers


def test_a_finished_fetch_grows_the_pending_answer_as_a_walk_would(
    mooncake_master, engines, monkeypatch
):
    """Asked again once its fetch is in, a request gets its pending host hit followed by the
    fetched pages, their pins moved from the fetch to the request, without walking the host
    tier again; a later request that walks it finds the same hit. Every byte is checked."""
    cfg = mooncake_config(mooncake_master, group_pages=4)
    writer = engines(cfg)
    p = prompt(7, 49)  # 12 full pages, 3 groups; the cap keeps the last token: 12 pages
    writer.run("w", p)
    settled(writer)
    reader = engines(cfg)
    reader.run("head", p[:9])  # pages 0, 1: the fetch's first group starts below the host hit
    settled(reader)
    answers = _spy_fetched(monkeypatch)
    m = reader.run("r", p)
    assert answers[-1] is not None  # the finished fetch answered
    assert (m.hit_tokens, m.first_page, m.load_pages, m.fetched_tokens) == (48, 0, 12, 40)
    walked = reader.cache.match("again", p)  # the host tier alone now
    assert (walked.hit_tokens, walked.load_pages, walked.fetched_tokens) == (48, 12, 0)
    reader.cache.release("again")
    settled(reader)
    stats = reader.cache.stats()
    assert stats["host_pinned"] == stats["fetch_reserve_mooncake"]  # every other pin was released
    reader.cache.host.page_slots.check()


def test_a_fetched_page_stored_meanwhile_leaves_the_answer_to_the_walk(
    start_mooncake_master, monkeypatch
):
    """Pages that another request stored in the host tier while the fetch was out are not the
    fetch's to hand over: the request is answered by the walk, which finds them in their own
    slots. Every byte is checked."""
    master = start_mooncake_master()
    cfg = mooncake_config(master, group_pages=4)
    writer, reader = FakeEngine(cfg), FakeEngine(cfg)
    try:
        p = prompt(8, 49)
        writer.run("w", p)
        settled(writer)
        reader.run("head", p[:9])  # pages 0, 1
        settled(reader)
        answers = _spy_fetched(monkeypatch)
        master.pause()  # the fetch waits for the master
        try:
            assert reader.cache.match("r", p).pending
            blocks = reader.allocate(6)  # meanwhile another request stores pages 0..5
            reader.compute(p[:25], blocks, 0)
            assert reader.cache.store("other", p[:25], blocks) == 4
            reader.cache.release("other")
            reader.free.extend(blocks)
        finally:
            master.resume()
        m = reader.run("r", p)
        assert answers == [None]
        assert (m.hit_tokens, m.load_pages) == (48, 12)
        settled(reader)
        stats = reader.cache.stats()
        assert stats["host_pinned"] == stats["fetch_reserve_mooncake"]
        reader.cache.host.page_slots.check()
    finally:
        writer.cache.close()
        reader.cache.close()


def test_a_host_tier_short_of_free_slots_fetches_the_whole_groups_that_fit(
    mooncake_master, engines
):
    """When pinned pages leave fewer free host slots than L3 holds pages, the fetch reads the
    whole groups that fit, and its other slots go back. Every byte is checked."""
    cfg = mooncake_config(mooncake_master, group_pages=4)
    writer = engines(cfg)
    b = prompt(9, 49)  # 12 pages: 3 groups in L3
    writer.run("w", b)
    settled(writer)
    small = mooncake_config(mooncake_master, group_pages=4)
    small["tiers"][0]["size"] = 20 * 64  # 20 host slots: a fetch reserve of 2
    reader = engines(small)
    a = prompt(10, 53)
    reader.run("a", a)
    settled(reader)
    held = reader.cache.match("held", a)  # pins 13 pages: 5 slots are left
    assert held.load_pages == 13 and not held.pending
    m = reader.run("r", b)  # 5 free slots: one group of 4
    assert (m.hit_tokens, m.fetched_tokens) == (16, 16)
    assert reader.cache.stats()["call_errors_mooncake"] == 0
    reader.cache.release("held")
    settled(reader)
    reader.cache.host.page_slots.check()


def _pieces(engine: FakeEngine, method: str) -> list[list[int]]:
    """Spy on the engine's store: the piece sizes of each object of every `method` call."""
    store = engine.cache._chain.links[0].store
    seen: list[list[int]] = []
    real = getattr(store, method)

    def spy(names, buffers):
        seen.extend(buffers.sizes)
        return real(names, buffers)

    setattr(store, method, spy)
    return seen


@pytest.mark.native  # without the C helpers a store's slots keep the order they were given
def test_a_group_in_consecutive_slots_travels_as_one_piece(mooncake_master, engines):
    """Mooncake moves fewer, larger pieces faster: a group whose pages lie in consecutive host
    slots, in order, is put and got as one piece, any other group as a piece per page. A store
    into blocks that run down takes slots that run down too (its GPU copy is then one row), so
    its groups go as pieces; a fetch takes its slots in order. Every byte is checked."""
    cfg = mooncake_config(mooncake_master, group_pages=4)
    writer = engines(cfg)
    puts = _pieces(writer, "put_from")
    p, q = prompt(11, 33), prompt(12, 33)  # 8 pages each: 2 groups of 4 pages of 64 bytes
    for rid, tokens, blocks in (("p", p, list(range(8))), ("q", q, list(range(15, 7, -1)))):
        writer.compute(tokens, blocks, 0)
        writer.cache.store(rid, tokens, blocks)
        writer.cache.release(rid)
    settled(writer)
    H = HEADER  # every object's header (hicache.backends.envelope) goes first, a piece of its own
    assert puts == [[H, 256], [H, 256], [H] + [64] * 4, [H] + [64] * 4]  # p's run up, q's down
    reader = engines(cfg)
    gets = _pieces(reader, "get_into")
    for rid, tokens in (("p", p), ("q", q)):
        m = reader.run(rid, tokens)
        assert (m.hit_tokens, m.fetched_tokens) == (32, 32)
    assert gets == [[H, 256]] * 4


def test_l3_threads_and_the_store_clients_run_on_the_worker_cpus(mooncake_master):
    """worker_cpus keeps every thread L3 starts off the engine's cores: its workers, the store
    client's threads, and the threads Mooncake's client starts on the connect thread."""
    cpu = min(os.sched_getaffinity(0))
    before = set(os.listdir("/proc/self/task"))
    cfg = mooncake_config(mooncake_master)
    cfg["tiers"][1]["worker_cpus"] = [cpu]
    del cfg["tiers"][1]["fetch_workers"]  # the default for one CPU
    e = FakeEngine(cfg)  # waits until the host tier and the store are ready
    try:
        e.run("r", prompt(3))
        settled(e)
        host = {str(t.native_id) for t in threading.enumerate() if t.name == "hicache-host-alloc"}
        new = set(os.listdir("/proc/self/task")) - before - host  # (the host tier's, if alive)
        named = {t.name for t in threading.enumerate() if t.native_id in {int(n) for n in new}}
        # one CPU: one fetch worker by default (transfers at once would compete for it)
        assert e.cache._chain.links[0].settings.fetch_workers == 1
        assert {
            "hicache-mooncake-fetch-0",
            "hicache-mooncake-put",
            "hicache-mooncake-connect",
        } <= named
        assert len(new) > len(named)  # Mooncake's own threads too
        assert {n: os.sched_getaffinity(int(n)) for n in new} == {n: {cpu} for n in new}
    finally:
        e.cache.close()


def test_worker_cpus_the_process_may_not_use_are_refused_by_name(mooncake_master):
    cfg = mooncake_config(mooncake_master)
    cfg["tiers"][1]["worker_cpus"] = [4096]
    with pytest.raises(ValueError, match=r"tiers\.1\.worker_cpus: CPU 4096 is not one this pro"):
        FakeEngine(cfg)


def test_a_state_layout_hits_from_l3_with_its_state_in_a_fresh_cache(mooncake_master):
    """Hybrid models: the page groups and the state at the last group end go to L3, and a cache
    that never saw the prompt fetches both and loads them exactly (the state's bytes too)."""
    cfg = mooncake_config(mooncake_master)
    cfg["layout"]["state_bytes"] = 32
    cfg["tiers"][0]["state_slots"] = 16
    made = [FakeEngine(cfg, states=FakeStates(4, 32, history_tokens=12)) for _ in range(2)]
    writer, reader = made
    try:
        p = prompt(70)  # the master outlives a test: a prompt of its own
        assert writer.run("w", p).hit_tokens == 0
        settled(writer)
        assert writer.cache.stats()["states_stored"] == 2  # at pages 10 and 9
        assert writer.cache.stats()["objects_put_mooncake"] == 6  # 5 groups, and the state at 10
        m = reader.run("r", p)  # checks every loaded page and the state
        assert (m.hit_tokens, m.fetched_tokens, m.needs_state) == (40, 40, True)
        assert reader.cache.stats()["pages_fetched_mooncake"] == 10
    finally:
        for e in made:
            e.cache.close()


def test_without_its_state_an_l3_prefix_of_a_state_layout_is_not_loaded(mooncake_master):
    """A hybrid model cannot resume from pages alone: with the state at the last group end gone
    from the store, a fresh cache fetches nothing and the prompt is recomputed."""
    cfg = mooncake_config(mooncake_master)
    cfg["layout"]["state_bytes"] = 32
    cfg["tiers"][0]["state_slots"] = 16
    made = [FakeEngine(cfg, states=FakeStates(4, 32, history_tokens=12)) for _ in range(2)]
    writer, reader = made
    try:
        p = prompt(72)
        writer.run("w", p)
        settled(writer)
        remove_group(writer, p, 9, group=None)  # the state at page 10, the only one in L3
        m = reader.run("r", p)
        assert (m.hit_tokens, m.fetched_tokens, m.needs_state) == (0, 0, False)
        assert reader.cache.stats()["pages_fetched_mooncake"] == 0
    finally:
        for e in made:
            e.cache.close()
