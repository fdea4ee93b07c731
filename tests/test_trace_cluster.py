"""The cluster simulation: routers, per-engine tiers and the shared store, on hand-made traces."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import pytest

from hicache.tools.trace.cli import main
from hicache.tools.trace.cluster import ClusterSetup, simulate_cluster
from hicache.tools.trace.replay import Workload
from hicache.tools.trace.simulate import LruSim
from hicache.tools.trace.workload import TraceRequest, read_trace

SAMPLE = Path(__file__).resolve().parents[1] / "examples/traces/mooncake_synthetic_500.jsonl"
P = 4  # tokens per page; every request below has one token more than its pages


def req(t: float, session: str, *pages: int) -> tuple[TraceRequest, list[int]]:
    """A request at `t` ms whose full pages are `pages` (plus one token: the cap never bites)."""
    r = TraceRequest(t, len(pages) * P + 1, 1, (*pages, 10**6 + int(t)), session=session)
    return r, list(pages)


def run(trace: list[tuple[TraceRequest, list[int]]], **kw: object):
    setup = ClusterSetup(
        **{"page_tokens": P, "page_bytes": 100, "host_pages": 8, "group_pages": 1, **kw}
    )
    requests, prompts = zip(*trace)
    return simulate_cluster(requests, prompts, setup), setup


TWO_SESSIONS = [
    req(0, "a", 1, 2),
    req(1, "a", 1, 2, 3),
    req(2, "b", 10, 11),
    req(3, "b", 10, 11, 12),
]


def test_session_router_keeps_each_session_on_its_engine() -> None:
    res, setup = run(TWO_SESSIONS, instances=2, router="session")
    assert res.requests == [2, 2]  # a on engine 0; b on the one with fewer requests
    assert (res.host_tokens, res.store_tokens) == (4 * P, 0)  # a's 2 pages, b's 2 pages
    row = res.row(setup)
    assert row["host_share"] == 16 / 44 and row["store_share"] == 0
    assert row["max_over_mean_requests"] == 1.0
    assert res.store_write_pages == 6 and row["store_read_bytes"] == 0


def test_round_robin_reads_from_the_shared_store_what_the_other_engine_computed() -> None:
    res, setup = run(TWO_SESSIONS, instances=2, router="round-robin")
    assert res.requests == [2, 2]
    assert (res.host_tokens, res.store_tokens) == (0, 4 * P)
    assert res.row(setup)["store_read_bytes"] == 4 * 100
    assert res.store_write_pages == 6  # the pages read are not put back
    alone, _ = run(TWO_SESSIONS, instances=2, router="round-robin", store_pages=0)
    assert (alone.host_tokens, alone.store_tokens) == (0, 0)


def test_cache_aware_follows_the_events_it_has_been_told() -> None:
    trace = [req(0, "a", 1, 2, 3), req(1, "b", 20), req(2, "a", 1, 2, 3, 4)]
    told, _ = run(trace, instances=2, router="cache-aware", event_delay_s=0.002)
    assert told.requests == [2, 1] and told.host_tokens == 3 * P
    late, _ = run(trace, instances=2, router="cache-aware", event_delay_s=0.003)
    # a's pages reach the router at 3 ms: at 2 ms engines 0 and 1 tie; the first is chosen
    assert late.requests == [2, 1] and late.host_tokens == 3 * P
    trace[1] = req(1, "a", 1, 2, 3)  # engine 0 now has two requests when the third comes
    told, _ = run(trace, instances=2, router="cache-aware", event_delay_s=0.0)
    assert told.requests == [3, 0] and (told.host_tokens, told.store_tokens) == (6 * P, 0)
    late, _ = run(trace, instances=2, router="cache-aware", event_delay_s=10)
    assert late.requests == [2, 1]  # knows nothing: by load, a's next turn goes to engine 1
    assert (late.host_tokens, late.store_tokens) == (3 * P, 3 * P)


def test_cache_aware_learns_evictions() -> None:
    trace = [
        req(0, "a", 1, 2, 3),
        req(1000, "b", 10, 11, 12),
        req(2000, "c", 20, 21, 22),  # engines tie at one request: engine 0, which evicts a
        req(2500, "a", 1, 2, 3, 4),
    ]
    told, _ = run(trace, instances=2, router="cache-aware", host_pages=3)
    assert told.requests == [2, 2]  # knows a is gone: by load, to engine 1
    stale, _ = run(trace, instances=2, router="cache-aware", host_pages=3, event_delay_s=1)
    assert stale.requests == [3, 1]  # a's store event is known, c's eviction not yet
    assert told.host_tokens == stale.host_tokens == 0
    assert told.store_tokens == stale.store_tokens == 3 * P


def test_disk_tier_and_bounded_store() -> None:
    trace = [req(0, "a", 1, 2, 3), req(1, "b", 5, 6, 7), req(2, "a", 1, 2, 3, 4)]
    res, _ = run(trace, instances=1, router="session", host_pages=3, disk_pages=6, store_pages=0)
    assert (res.host_tokens, res.disk_tokens, res.store_tokens) == (0, 3 * P, 0)
    # a store of 3 pages holds b's only; the fetch of a's finds them missing, so the link forgets
    # them and a's are computed and put again (the store's evictions are learnt only that way)
    res, _ = run(trace, instances=1, router="session", host_pages=3, store_pages=3)
    assert (res.host_tokens, res.store_tokens, res.store_write_pages) == (0, 0, 9)
    # pages read from the store go to the disk tier, not back to the store
    res, _ = run(trace, instances=1, router="session", host_pages=3, disk_pages=3)
    assert (res.disk_tokens, res.store_tokens, res.store_write_pages) == (0, 3 * P, 6)


def test_one_engine_without_lower_tiers_is_the_exact_lru() -> None:
    requests = read_trace(SAMPLE)
    w = Workload(requests, 512, 512)
    for cap in (40, 300):
        lru = w.simulate(LruSim(cap, 512))
        for router in ("round-robin", "session", "cache-aware"):
            setup = ClusterSetup(1, router, cap, 512, 1, store_pages=0)
            res = simulate_cluster(w.requests, w.pages, setup)
            assert res.host_tokens == lru.hit_tokens
            assert res.prompt_tokens == lru.prompt_tokens


def test_shares_add_up_and_more_engines_never_lose_the_store_hits() -> None:
    rng = random.Random(3)
    trace, convs = [], [[rng.randrange(10**5)] for _ in range(12)]
    for t in range(300):
        conv = rng.choice(convs)
        conv.append(rng.randrange(10**5))
        trace.append(req(t * 100, f"s{convs.index(conv)}", *conv))
    base, _ = run(trace, instances=1, router="session", host_pages=10**6)
    for n in (1, 2, 8):
        for router in ("round-robin", "session", "cache-aware"):
            res, setup = run(trace, instances=n, router=router, host_pages=64)
            row = res.row(setup)
            assert res.host_tokens + res.store_tokens == base.host_tokens  # unbounded store
            assert row["hit_share"] == pytest.approx(row["host_share"] + row["store_share"])
            assert sum(res.requests) == len(trace)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"router": "random"}, "unknown router 'random'"),
        ({"instances": 0}, "instances must be >= 1"),
        ({"event_delay_s": -1}, "event delay must be >= 0"),
    ],
)
def test_bad_setup_is_named(kw: dict, message: str) -> None:
    args = {"instances": 2, "router": "session", "host_pages": 4, "page_tokens": 4}
    args.update(page_bytes=1, **kw)
    with pytest.raises(ValueError, match=message):
        ClusterSetup(**args)


def write_trace(path: Path, trace: list[tuple[TraceRequest, list[int]]]) -> Path:
    with gzip.open(path, "wt") as f:
        for r, _ in trace:
            row = {
                "timestamp": r.timestamp,
                "input_length": r.input_length,
                "hash_ids": list(r.hash_ids),
                "session": r.session,
                "stop": "tool_use",
            }
            f.write(json.dumps(row) + "\n")
    return path


def test_cli_sweeps_routers_and_engine_counts(tmp_path: Path, capsys) -> None:
    # objects of 4 pages (hicache's default group_pages): a's and b's first groups reach the store
    sessions = [req(0, "a", 1, 2, 3, 4), req(1, "a", 1, 2, 3, 4, 5)]
    sessions += [req(2, "b", 10, 11, 12, 13), req(3, "b", 10, 11, 12, 13, 14)]
    trace = write_trace(tmp_path / "t.jsonl.gz", sessions)
    out = tmp_path / "c.json"
    args = [str(trace), "--instances", "1,2", "--host-size", "8", "--block-tokens", str(P)]
    assert main([*args, "--json", str(out), "--bytes-per-token", "25"]) == 0
    rows = json.loads(out.read_text())["cluster"]
    assert [(r["router"], r["instances"]) for r in rows] == [
        (router, n) for router in ("round-robin", "session", "cache-aware") for n in (1, 2)
    ]
    by = {(r["router"], r["instances"]): r for r in rows}
    assert by["session", 2]["host_share"] == 32 / 76
    assert by["round-robin", 2]["store_read_bytes"] == 8 * 100  # 25 bytes a token, 4 a page
    for key in ("hit_share", "host_share", "store_share", "max_over_mean_requests"):
        assert key in rows[0]
    assert "cache-aware" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--router", "random"], "unknown router 'random'"),
        (["--instances", "0"], "engine counts must be >= 1"),
        (["--disk-size", "lots"], "--disk-size 'lots': not a percentage"),
        (["--event-delay", "-1"], "--event-delay must be >= 0"),
        (["--tier", "host=1GiB"], "not --tier"),
        (["--model", "llama-8b", "--bytes-per-token", "8"], "not both"),
    ],
)
def test_cli_names_bad_options(tmp_path: Path, capsys, extra: list[str], message: str) -> None:
    trace = write_trace(tmp_path / "t.jsonl.gz", TWO_SESSIONS)
    args = [str(trace), "--block-tokens", str(P), "--instances", "2", *extra]
    code = None
    try:
        code = main(args)
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    assert code == 2
    assert message in capsys.readouterr().err
