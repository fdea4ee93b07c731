"""`hicache replay --dp 2`: two engine ranks (processes, each with its own pool and host tier) on
one real Mooncake store on loopback, a conversation's consecutive turns on different ranks.

Every turn after the first finds the previous turn's full page groups (4 pages of 32 tokens) in
the store, whichever rank wrote them, and the answers are the one-rank run's, token for token
(CPU, float32).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fake_engine import PATIENT_WAIT_MS
from mooncake_master import require_mooncake

from hicache.tools.refengine.replay import main

GROUP_TOKENS = 4 * 32  # the store's group of pages, in tokens
ANSWER = 2
WORKLOAD = [
    "--model", "tiny-llama", "--conversations", "2", "--turns", "3", "--first-tokens", "256",
    "--message-tokens", "200", "--answer-tokens", str(ANSWER), "--repeats", "1", "--quiet",
]  # fmt: skip
# a message of 150 to 250 tokens: each turn adds at least one full group to the store


def test_two_ranks_take_every_later_turn_through_the_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    require_mooncake()
    tiers = tmp_path / "host.yaml"
    # a busy machine's slow store calls are waited for, and never judged slower than recompute
    tiers.write_text(
        "tiers: [{type: host, size: 64MiB}]\n"
        f"policy: {{fetch_max_wait_ms: {PATIENT_WAIT_MS}, prefill_tokens_per_s: 1.0}}\n"
    )
    out = tmp_path / "r.json"
    assert main([*WORKLOAD, "--config", str(tiers), "--dp", "2", "--json", str(out)]) == 0
    dp = json.loads(out.read_text())["dp"]
    assert (dp["identical"], dp["identical_requests"], dp["ranks_n"]) == (True, 6, 2)
    assert "outputs identical to the one-rank run: yes" in capsys.readouterr().out

    turns = {(t["cid"], t["turn"]): t for t in dp["turns"]}
    assert sorted(turns) == [(c, t) for c in range(2) for t in range(3)]
    for (cid, turn), t in turns.items():
        assert t["rank"] == (cid + turn) % 2  # consecutive turns on different ranks
        hit = t["gpu_hit_tokens"] + t["host_hit_tokens"] + t["store_hit_tokens"]
        assert hit + t["recomputed_tokens"] == t["prompt_tokens"]
        if turn == 0:
            assert (hit, t["prompt_tokens"]) == (0, 256)  # a fresh store: nothing to hit
            continue
        # the previous turn ran on the other rank; its KV (prompt + answer but the last token)
        # reached this one as whole groups, through the store
        before = turns[cid, turn - 1]["prompt_tokens"] + ANSWER - 1
        assert hit == before // GROUP_TOKENS * GROUP_TOKENS
        assert t["store_hit_tokens"] >= GROUP_TOKENS
        if turn == 1:  # this rank never saw the conversation: all of it from the store
            assert t["store_hit_tokens"] == hit

    ranks = dp["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    keys = ("requests", "prompt_tokens", "host_hit_tokens", "store_hit_tokens",
            "recomputed_tokens")  # fmt: skip
    for key in keys:
        assert sum(r[key] for r in ranks) == dp["total"][key]
    assert dp["total"]["requests"] == 6
    for key in keys[1:]:
        assert dp["total"][key] == sum(t[key] for t in dp["turns"])
    for r in ranks:
        assert r["cache_stats"]["put_failed_mooncake"] == 0
        assert r["ttft_p50_s"] > 0


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--dp", "1"], "--dp must be at least 2 (one rank is the run without it), got 1"),
        (
            ["--dp", "2", "--config", "{tiers}"],
            "--dp runs its ranks on the host tier and a Mooncake store started for them: the "
            "configuration may name a host tier only, not disk",
        ),
    ],
)
def test_dp_arguments_that_cannot_work_are_refused_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], error: str
) -> None:
    tiers = tmp_path / "tiers.yaml"
    tiers.write_text(
        f"tiers: [{{type: host, size: 64MiB}}, {{type: disk, path: {tmp_path}, size: 64MiB}}]\n"
    )
    argv = [a.replace("{tiers}", str(tiers)) for a in args]
    assert main([*WORKLOAD, *argv]) == 2
    assert capsys.readouterr().err == f"hicache replay: {error}\n"
