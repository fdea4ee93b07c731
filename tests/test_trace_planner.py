"""The planner: the tier chain simulated as hicache runs it, checked against the real cache."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from extras import require_plot
from test_trace import make_trace

from hicache import load_config
from hicache.backends.disk.records import HEADER
from hicache.core.plan import PrefillSpeed
from hicache.tools.trace.cli import main
from hicache.tools.trace.plancli import parse_tier
from hicache.tools.trace.planner import TtftModel, bytes_per_token, chain_from_config, plan
from hicache.tools.trace.replay import ReplaySetup, run_hicache
from hicache.tools.trace.workload import Workload, read_trace


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_trace(tmp_path_factory.mktemp("plan") / "trace.jsonl", n=200)


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_the_real_cache_hits_each_tier_as_the_planner_predicts(
    trace: Path, tmp_path: Path, policy: str
) -> None:
    """A host tier and a disk tier, both too small for the trace: the real HiCache (its writes
    settled after each request, one disk I/O thread, no fetch reserve) serves exactly the tokens
    per tier that the planner predicts, with every loaded byte right."""
    P, kv, G = 128, 64, 4
    workload = Workload(read_trace(trace), P)
    disk = {
        "type": "disk",
        "path": str(tmp_path / "disk"),
        "size": 100 * (HEADER + G * kv),  # 100 objects
        "io_threads": 1,
        "fetch_reserve": 0,
        "group_pages": G,
    }
    base = load_config(
        {
            "tiers": [{"type": "host", "size": 4096, "policy": policy}, disk],
            "policy": {"prefill_tokens_per_s": 1.0, "fetch_max_wait_ms": 60000},
        },
        env={},
    )
    setup = ReplaySetup(page_tokens=P, kv_bytes=kv, base=base, settle=True)
    host_pages = workload.unique_pages // 5
    run = run_hicache(workload, setup, host_pages)
    predicted = plan(workload, chain_from_config(setup.config(host_pages)), kv)
    tiers = {t["name"]: t for t in predicted["tiers"]}
    assert run.wrong_bytes == 0 and run.timeouts == 0
    assert tiers["host"]["capacity_pages"] == host_pages and tiers["disk"]["capacity_pages"] == 400
    assert run.hit_tokens == {
        "host": tiers["host"]["hit_tokens"],
        "disk": tiers["disk"]["hit_tokens"],
    }
    assert tiers["disk"]["hit_tokens"] > 0 and tiers["host"]["hit_tokens"] > 0
    assert tiers["disk"]["write_bytes"] > 400 * kv  # more was written than it holds: it evicted
    assert run.stats["pages_evicted"] == tiers["host"]["pages_evicted"] > 0


def test_ttft_estimate_by_hand() -> None:
    model = TtftModel(PrefillSpeed(1000.0), link_bytes_per_s=1000.0, layers=2)
    tokens, hit = np.array([1000, 1000]), np.array([500, 0])
    got = model.cached(tokens, hit, np.array([100.0, 0.0]), np.array([0.5, 0.0]))
    # fetch 0.5 s, then max(load 0.1 s, prefill of 500 tokens 0.5 s), plus one layer's load
    assert got.tolist() == pytest.approx([1.05, 1.0])
    assert model.no_cache(tokens).tolist() == pytest.approx([1.0, 1.0])
    assert bytes_per_token("llama-8b") == 131072  # 32 layers x 8 KV heads x 128 x K,V x bf16


def test_planner_cli_writes_tiers_ttft_and_the_plot(
    trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    require_plot()
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    argv = [str(trace), "--model", "llama-8b", "--tier", "host=3GiB", "--tier", "disk=8GiB"]
    assert main([*argv, "--json", str(out), "--plot", str(png)]) == 0
    r = json.loads(out.read_text())
    assert [t["name"] for t in r["tiers"]] == ["host", "disk"]
    for t in r["tiers"]:
        assert set(t) >= {"name", "capacity_pages", "hit_share", "read_bytes", "write_bytes"}
    page = 131072 * 512  # the planner's page is a trace block unless --page-tokens says
    assert r["tiers"][0]["capacity_pages"] == (3 << 30) // page
    assert r["hit_share"] == pytest.approx(sum(t["hit_share"] for t in r["tiers"]))
    e = r["ttft_estimate_s"]
    assert set(e) >= {"p50", "p90", "p99", "no_cache_p50"}
    assert e["p50"] < e["no_cache_p50"] and e["p50"] <= e["p90"] <= e["p99"]
    rows = r["host_sweep"]
    assert {row["with_stores"] for row in rows} == {True, False}
    alone = [row["hit_share"] for row in rows if not row["with_stores"]]
    assert alone == sorted(alone)  # a larger host never serves less here
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "estimated time to first token" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "llama-8b", "--tier", "disk=1GiB"], "give the host tier first"),
        (["--tier", "host=1GiB"], "needs --model NAME or --bytes-per-token"),
        (["--model", "llama-8b", "--tier", "host=-1GiB"], "is not a byte size"),
        (["--model", "llama-8b", "--tier", "ssd=1GiB"], "TYPE one of host"),
        (["--model", "llama-8b", "--tier", "host=1KiB"], "smaller than one page"),
    ],
)
def test_planner_rejects_bad_input_in_one_line(
    trace: Path, args: list[str], message: str, capsys: pytest.CaptureFixture
) -> None:
    assert main([str(trace), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_parse_tier_settings() -> None:
    t = parse_tier("disk=2TiB,read_gbps=3,group_pages=8")
    assert (t.type, t.size, t.read_gbps, t.group_pages) == ("disk", 2 << 40, 3.0, 8)
    with pytest.raises(ValueError, match="unknown setting 'speed'"):
        parse_tier("disk=2TiB,speed=3")


def test_planner_refuses_what_it_does_not_simulate(
    trace: Path, capsys: pytest.CaptureFixture
) -> None:
    argv = [str(trace), "--model", "llama-8b", "--tier", "host=1GiB"]
    assert main([*argv, "--tier", "disk=1GiB,write=on_evict"]) == 2
    assert "write: on_evict is not planned" in capsys.readouterr().err
    assert main([*argv[:-1], "host=1GiB,policy=mru"]) == 2
    assert "unknown eviction policy 'mru'" in capsys.readouterr().err


def test_a_lossless_tier_holds_ratio_times_the_pages_and_reads_kv_faster(trace: Path) -> None:
    """`--tier disk=...,codec=lossless`: the disk holds `codec_ratio` times the pages (whole
    records), serves at least the hits it served raw, and delivers KV at its read rate times the
    ratio, capped by what the codec decodes."""
    workload = Workload(read_trace(trace), 128)
    kv = 128 * 1024
    host = parse_tier("host=64MiB")
    raw = parse_tier("disk=256MiB,read_gbps=1.5,group_pages=4")
    coded = parse_tier(
        "disk=256MiB,read_gbps=1.5,group_pages=4,codec=lossless,codec_ratio=1.5,decode_gbps=4"
    )
    assert coded.raw_read_gbps == 2.25 > raw.raw_read_gbps == 1.5
    slow = parse_tier("disk=1GiB,read_gbps=1.5,codec=lossless,decode_gbps=1")
    assert slow.raw_read_gbps == 1.0  # decoding bounds it
    a, b = (plan(workload, [host, t], kv)["tiers"][1] for t in (raw, coded))
    assert a["capacity_pages"] == 256 * 1024 * 1024 // (4 * kv + HEADER) * 4
    assert b["capacity_pages"] == 256 * 1024 * 1024 // (4 * kv * 2 // 3 + HEADER) * 4
    assert (b["codec"], b["codec_ratio"]) == ("lossless", 1.5)
    assert b["hit_tokens"] >= a["hit_tokens"] > 0
    with pytest.raises(ValueError, match="codec is none or lossless"):
        parse_tier("disk=2TiB,codec=lz4")
