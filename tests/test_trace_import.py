"""Traces as users have them: gzip, sessions and stop reasons, and kv-cache-tester sessions."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from hicache.tools.trace.cli import main
from hicache.tools.trace.importer import import_sessions
from hicache.tools.trace.workload import read_trace


def _session(path: Path, sid: str, requests: list[dict]) -> None:
    path.write_text(json.dumps({"id": sid, "block_size": 64, "requests": requests}))


def _req(t: float, tokens: int, ids: list[int], stop: str = "", model: str = "m") -> dict:
    return {
        "t": t,
        "type": "n",
        "model": model,
        "in": tokens,
        "out": 5,
        "hash_ids": ids,
        "stop": stop,
    }


@pytest.fixture
def sessions(tmp_path: Path) -> Path:
    """Two sessions (the same small ids, which must not be shared across sessions), one with a
    sub-agent, one request past the horizon."""
    folder = tmp_path / "sessions"
    folder.mkdir()
    ids = list(range(1, 33))  # 32 blocks of 64 tokens = 4 blocks of 512
    _session(
        folder / "a.json",
        "a",
        [
            _req(0.0, 1024, ids[:16], "tool_use"),  # 2 full blocks
            _req(10.0, 1100, ids[:18], "end_turn"),  # 2 full + a partial
            {
                "type": "subagent",
                "t": 20.0,
                "agent_id": "sa1",
                "requests": [_req(1.0, 512, ids[:8], "tool_use")],
            },
            _req(50_000.0, 512, ids[:8]),  # past a 6 h horizon from any start
        ],
    )
    _session(folder / "b.json", "b", [_req(0.0, 2048, ids, "end_turn")])
    return folder


def test_import_converts_sessions_as_the_readme_says(sessions: Path, tmp_path: Path) -> None:
    out = tmp_path / "t.jsonl.gz"
    s = import_sessions(sessions, out, seed=3)
    assert (s.sessions, s.requests, s.dropped) == (2, 4, 1)
    assert s.prompt_tokens == 1024 + 1100 + 512 + 2048
    reqs = read_trace(out)  # gzip, read back in timestamp order
    by = {(r.session, r.input_length): r for r in reqs}
    a1, a2 = by[("a", 1024)], by[("a", 1100)]
    sub, b = by[("a/sa1", 512)], by[("b", 2048)]
    assert a1.hash_ids == a2.hash_ids[:2] == sub.hash_ids + a1.hash_ids[1:]
    assert len(a2.hash_ids) == 3 and a2.hash_ids[2] not in a1.hash_ids  # the partial block
    assert not set(b.hash_ids) & set(a2.hash_ids)  # ids are scoped to the session
    assert (a1.stop, a2.stop, sub.stop, b.stop) == ("tool_use", "end_turn", "tool_use", "end_turn")
    assert a2.timestamp - a1.timestamp == 10_000  # offsets kept, in milliseconds
    assert sub.timestamp - a1.timestamp == 21_000  # the sub-agent's start plus its own offset
    assert all(r.timestamp >= 0 for r in reqs) and a1.timestamp <= 2 * 3600 * 1000
    assert [r.timestamp for r in reqs] == sorted(r.timestamp for r in reqs)
    again = tmp_path / "again.jsonl"
    import_sessions(sessions, again, seed=3)  # the seed fixes the start times
    assert read_trace(again) == reqs


def test_import_cli_and_its_errors(
    sessions: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "t.jsonl"
    assert main(["import", str(sessions), str(out)]) == 0
    assert "2 sessions, 4 requests (1 after the horizon dropped)" in capsys.readouterr().out
    assert main([str(out), "--page-tokens", "512", "--host-size", "100%"]) == 0
    assert main(["import", str(tmp_path / "none"), str(out)]) == 2
    assert capsys.readouterr().err.strip().endswith("none: not a folder")
    (sessions / "bad.json").write_text('{"id": "x", "requests": [{"t": 0, "in": 2048}]}')
    assert main(["import", str(sessions), str(tmp_path / "x.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "bad.json" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x.jsonl").exists()


def test_trace_reads_gzip_sessions_and_block_tokens(tmp_path: Path) -> None:
    lines = [
        {"timestamp": 0, "input_length": 300, "hash_ids": [1, 2, 3], "session": "s", "stop": "x"},
        {"timestamp": 1, "input_length": 260, "hash_ids": [1, 4, 5]},
    ]
    path = tmp_path / "t.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)
    reqs = read_trace(path, block_tokens=128)
    assert [(r.session, r.stop) for r in reqs] == [("s", "x"), ("", "")]
    with pytest.raises(ValueError, match="needs 1 hash ids of 512"):
        read_trace(path)
    out = tmp_path / "r.json"
    argv = [str(path), "--block-tokens", "128", "--page-tokens", "128", "--json", str(out)]
    assert main([*argv, "--host-size", "2", "--fractions", "0.5,1"]) == 0
    rows = json.loads(out.read_text())["sweep"]
    assert [r["capacity_pages"] for r in rows] == [2, 3]  # of 3 distinct full pages
    (tmp_path / "broken.jsonl.gz").write_bytes(b"not gzip")
    assert main([str(tmp_path / "broken.jsonl.gz")]) == 2
