"""Trace replay: every loaded byte checked, hicache against an exact LRU and an infinite cache."""

from __future__ import annotations

import io
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from extras import require_plot

from hicache import load_config
from hicache.tools.trace.cli import main, parse_host_size
from hicache.tools.trace.engine import ReplayEngine
from hicache.tools.trace.progress import Progress
from hicache.tools.trace.replay import ReplaySetup, Workload, replay, run_hicache, sweep
from hicache.tools.trace.simulate import LruSim, OracleSim, PolicySim, block_ceiling
from hicache.tools.trace.workload import TraceRequest, page_ids, prompt_tokens, read_trace

SHARED_TRACE = Path(__file__).resolve().parents[2] / "shared/traces/synthetic_trace.jsonl"


def make_trace(path: Path, n: int = 300, seed: int = 7) -> Path:
    """Multi-turn conversations over a few shared system prompts, Mooncake format."""
    rng = random.Random(seed)
    ids: dict[tuple[int, int], int] = {}
    systems = [[rng.randrange(10**6) for _ in range(rng.randint(1, 4))] for _ in range(3)]
    convs: list[list[int]] = []
    with open(path, "w") as f:
        for t in range(n):
            if convs and rng.random() < 0.6:
                conv = rng.choice(convs)
            else:
                conv = list(rng.choice(systems))
                convs.append(conv)
            conv.extend(rng.randrange(10**6) for _ in range(rng.randint(1, 3)))
            hash_ids, parent = [], -1
            for content in conv:
                parent = ids.setdefault((parent, content), len(ids))
                hash_ids.append(parent)
            length = 512 * (len(conv) - 1) + rng.randint(1, 512)
            line = {
                "timestamp": t,
                "input_length": length,
                "output_length": 8,
                "hash_ids": hash_ids,
            }
            f.write(json.dumps(line) + "\n")
    return path


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_trace(tmp_path_factory.mktemp("trace") / "trace.jsonl")


@pytest.mark.parametrize("page_tokens", [128, 512, 256])
def test_hicache_equals_exact_lru_and_loads_right_bytes(trace: Path, page_tokens: int) -> None:
    workload = Workload(read_trace(trace), page_tokens)
    setup = ReplaySetup(page_tokens=page_tokens, kv_bytes=64)
    pages = workload.unique_pages * 3 // 10  # under pressure: pages get evicted
    run = run_hicache(workload, setup, pages)
    lru = workload.simulate(LruSim(pages, page_tokens))
    oracle = workload.simulate(OracleSim(page_tokens))

    assert run.wrong_bytes == 0
    assert run.stats["pages_evicted"] > 0
    assert run.stats["pages_evicted"] == lru.evicted_pages
    assert run.prompt_tokens == lru.prompt_tokens == workload.prompt_tokens
    assert run.hit_tokens["host"] == lru.hit_tokens  # exactly, not within 2 %
    assert run.limited_tokens == lru.limited_tokens
    assert 0 < lru.hit_tokens < oracle.hit_tokens


def test_cap_counts_limited_tokens_the_same_way(trace: Path) -> None:
    base = load_config(
        {"tiers": [{"type": "host", "size": 4096}], "policy": {"min_recompute_tokens": 600}},
        env={},
    )
    workload = Workload(read_trace(trace), 128)
    setup = ReplaySetup(page_tokens=128, kv_bytes=64, base=base)
    run = run_hicache(workload, setup, workload.unique_pages // 2)
    lru = workload.simulate(LruSim(workload.unique_pages // 2, 128, 600))
    assert run.wrong_bytes == 0
    assert run.limited_tokens == lru.limited_tokens > 0
    assert run.hit_tokens["host"] == lru.hit_tokens
    assert run.stats["limited_tokens"] == run.limited_tokens


def test_sweep_is_monotone_and_reaches_the_oracle(trace: Path) -> None:
    workload = Workload(read_trace(trace), 128)
    setup = ReplaySetup(page_tokens=128, kv_bytes=64)
    fractions = (0.1, 0.25, 0.5, 1.0)
    rows = sweep(workload, setup, fractions)
    assert [r["policy"] for r in rows[:4]] == ["lru", "arc", "s3fifo", "prefix"]
    assert len(rows) == 4 * len(fractions)
    lru = [r["lru_share"] for r in rows if r["policy"] == "lru"]
    assert lru == [r["hit_share"] for r in rows if r["policy"] == "lru"]
    assert lru == sorted(lru) and lru[0] < lru[-1]
    for r in rows:  # the offline reference is the ceiling of every policy at its capacity
        assert r["hit_share"] <= r["belady_share"]
    oracle = workload.simulate(OracleSim(128)).share
    assert {r["hit_share"] for r in rows if r["host_fraction"] == 1.0} == {oracle}
    for frac, share in zip(fractions, lru):  # hicache's host tier is that exact LRU
        run = run_hicache(workload, setup, max(1, round(frac * workload.unique_pages)))
        assert run.wrong_bytes == 0 and run.share == share


@pytest.mark.parametrize("policy", ["arc", "s3fifo", "prefix"])
def test_hicache_evicts_exactly_as_the_policys_simulation(trace: Path, policy: str) -> None:
    workload = Workload(read_trace(trace), 128)
    setup = ReplaySetup(page_tokens=128, kv_bytes=64, policy=policy)
    pages = workload.unique_pages // 10
    run = run_hicache(workload, setup, pages)
    sim = workload.simulate(PolicySim(pages, 128, 1, policy))
    assert run.wrong_bytes == 0 and run.stats["pages_evicted"] == sim.evicted_pages > 0
    assert run.hit_tokens["host"] == sim.hit_tokens > 0
    assert sim.hit_tokens != workload.simulate(LruSim(pages, 128)).hit_tokens


def test_wrong_bytes_are_caught(trace: Path) -> None:
    """The check can fail: corrupt the host pool and the next hit shows wrong bytes."""
    req = read_trace(trace)[0]
    tokens = prompt_tokens(req)
    setup = ReplaySetup(page_tokens=128, kv_bytes=64)
    engine = ReplayEngine(setup.config(1000), setup.layout, 64)
    try:
        first = engine.run(tokens)
        assert first.hit_tokens == 0 and engine.wrong_bytes == 0
        engine.cache.host.pages.segments[0][:, 3] ^= 1  # flip one bit of every stored page
        again = engine.run(tokens)
        assert again.hit_tokens == (len(tokens) - 1) // 128 * 128  # all but the last token
        assert again.wrong_bytes == again.match.load_pages  # one byte per loaded page
    finally:
        engine.close()


def test_lru_sim_by_hand() -> None:
    sim = LruSim(capacity=3, page_tokens=1)
    assert sim.request([1, 2], 2) == 0  # held, oldest first: 2, 1
    assert sim.request([3, 4], 2) == 0  # evicts 2: 1, 4, 3
    assert sim.policy.order() == [1, 4, 3]
    assert sim.request([1, 5], 2) == 1  # 1 is held (pinned); evicts 4; 5 then 1 most recent
    assert sim.policy.order() == [3, 5, 1]
    assert (sim.result.evicted_pages, sim.result.hit_tokens, sim.result.prompt_tokens) == (2, 1, 6)
    assert sim.request([1, 5], 2) == 1  # the cap: one token of two recomputed
    assert sim.result.limited_tokens == 1


def test_lru_sim_keeps_the_head_of_a_prompt_longer_than_the_pool() -> None:
    sim = LruSim(capacity=2, page_tokens=1)
    sim.request([1, 2, 3, 4], 4)
    assert sim.policy.order() == [2, 1] and sim.result.dropped_pages == 2


def test_page_ids_name_prefixes() -> None:
    a = TraceRequest(0, 1024, 1, (5, 9))
    b = TraceRequest(1, 1000, 1, (5, 11))
    ia, ib = page_ids(a, 128), page_ids(b, 128)
    assert len(ia) == 8 and len(ib) == 7  # b's last page is partial
    assert ia[:4] == ib[:4] and not set(ia[4:]) & set(ib[4:])
    assert page_ids(a, 1024) == [ia[-1]]  # a page of two blocks is named by its last block
    assert (prompt_tokens(a)[:512] == prompt_tokens(b)[:512]).all()
    assert (prompt_tokens(a)[512:1000] != prompt_tokens(b)[512:]).any()


def test_block_ceiling_by_hand() -> None:
    reqs = [
        TraceRequest(0, 1000, 1, (1, 2)),
        TraceRequest(1, 1100, 1, (1, 2, 3)),  # 512 + 512 seen
        TraceRequest(2, 600, 1, (1, 4)),  # 512 seen
    ]
    assert block_ceiling(reqs) == pytest.approx((1024 + 512) / 2700)


def test_read_trace_orders_and_validates(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"timestamp": 5, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'
        '{"timestamp": 2, "input_length": 600, "output_length": 1, "hash_ids": [2, 3]}\n'
    )
    assert [r.timestamp for r in read_trace(path)] == [2, 5]
    assert len(read_trace(path, limit=1)) == 1
    path.write_text('{"timestamp": 1, "input_length": 600, "hash_ids": [2]}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:1: input_length 600 needs 2 hash ids"):
        read_trace(path)


def test_parse_host_size() -> None:
    assert parse_host_size("50%", 1000, None) == 500
    assert parse_host_size("123", 1000, None) == 123
    assert parse_host_size("64MiB", 1000, 1 << 20) == 64
    with pytest.raises(ValueError, match="needs --config"):
        parse_host_size("64MiB", 1000, None)
    with pytest.raises(ValueError, match="positive"):
        parse_host_size("0%", 1000, None)


def test_cli_writes_the_report(trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    require_plot()
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    rc = main(
        [
            str(trace),
            "--json",
            str(out),
            "--plot",
            str(png),
            "--limit",
            "150",
            "--host-size",
            "40%",
            "--fractions",
            "0.2,1",
            "--sweep",
        ]
    )
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["requests"] == 150 and r["wrong_bytes"] == 0
    assert r["hit_share"] == r["lru_share"] <= r["oracle_share"]
    assert r["match_us_per_page"] > 0 and r["store_us_per_page"] > 0
    assert r["default_policy"] == "lru" and r["policy"] == "lru"
    assert [(p["policy"], p["host_fraction"]) for p in r["sweep"]][:5] == [
        ("lru", 0.2),
        ("arc", 0.2),
        ("s3fifo", 0.2),
        ("prefix", 0.2),
        ("lru", 1.0),
    ]
    assert set(r["sweep"][0]) >= {"policy", "host_fraction", "hit_share", "lru_share"}
    assert all(p["hit_share"] <= p["belady_share"] for p in r["sweep"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "exact LRU" in capsys.readouterr().out


def test_cli_rejects_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    missing = tmp_path / "none.jsonl"
    assert main([str(missing)]) == 2
    assert "hicache trace:" in capsys.readouterr().err
    huge = tmp_path / "huge.jsonl"
    huge.write_text(f'{{"timestamp": 0, "input_length": 512, "hash_ids": [{2**70}]}}\n')
    assert main([str(huge)]) == 2
    assert "is too large (at most" in capsys.readouterr().err


def test_plot_without_matplotlib_fails_before_the_run(
    trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A child process where matplotlib cannot be imported: exit 2 at once, one line."""
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from hicache.tools.trace.cli import main\n"
        f"sys.exit(main([{str(trace)!r}, '--plot', {str(tmp_path / 'x.png')!r}]))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.strip() == "hicache trace: --plot needs matplotlib (pip install matplotlib)"
    assert done.stdout == "" and not (tmp_path / "x.png").exists()


@pytest.mark.skipif(not SHARED_TRACE.exists(), reason="the shared Mooncake trace is not here")
def test_first_requests_of_the_mooncake_trace() -> None:
    workload = Workload(read_trace(SHARED_TRACE, limit=300), 128)
    r = replay(workload, ReplaySetup(), workload.unique_pages // 3, fractions=(0.5,))
    assert r["wrong_bytes"] == 0
    assert r["hit_share"] == r["lru_share"] < r["oracle_share"]
    assert r["lru_share"] <= r["belady_share"] <= r["oracle_share"]


def test_the_sample_trace_in_the_repository_replays(capsys: pytest.CaptureFixture) -> None:
    sample = Path(__file__).resolve().parents[1] / "examples/traces/mooncake_synthetic_500.jsonl"
    assert main([str(sample), "--limit", "60", "--host-size", "5%"]) == 0
    out = capsys.readouterr().out
    assert "requests 60," in out and "wrong bytes in loaded pages: 0" in out


def test_progress_bar_draws_and_clears_only_when_shown() -> None:
    out = io.StringIO()
    with Progress(4, show=True, stream=out) as bar:
        for _ in range(4):
            bar.advance()
    text = out.getvalue()
    assert "[" + "#" * Progress.WIDTH + "] 100%" in text and text.endswith("\r")
    quiet = io.StringIO()
    with Progress(4, show=False, stream=quiet) as bar:
        bar.advance(4)
    assert quiet.getvalue() == "" and bar.done == 4


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--page-tokens", "0"], "--page-tokens: must be positive, got 0"),
        (["--json", "/missing/dir/x.json"], "--json /missing/dir/x.json: the folder"),
        (["--host-size", "-5"], "--host-size '-5' must be positive"),
        (["--host-size=-5%"], "--host-size '-5%' must be positive"),
    ],
)
def test_cli_checks_its_arguments_before_any_work(
    trace: Path, args: list[str], message: str, capsys: pytest.CaptureFixture
) -> None:
    try:
        rc = main([str(trace), *args])
    except SystemExit as done:  # argparse's own check
        rc = done.code
    assert rc == 2
    assert message in capsys.readouterr().err


def test_cli_takes_the_configs_host_size_over_its_page_size(
    trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(
        "layout: {model: m, kv_dtype: bf16, page_tokens: 128, page_bytes: 1048576}\n"
        "tiers: [{type: host, size: 40MiB}]\n"
    )
    out = tmp_path / "r.json"
    assert main([str(trace), "--config", str(config), "--limit", "50", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["host_pages"] == 40  # 40 MiB of 1 MiB pages
