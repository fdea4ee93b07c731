"""`hicache replay`'s arguments and setup are checked before the run: a mistake is one line on
stderr and exit status 2 within seconds, never a traceback after minutes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hicache.backends.mooncake_local import free_port

TINY = [
    "--model", "tiny-llama", "--conversations", "1", "--turns", "2", "--first-tokens", "256",
    "--message-tokens", "8", "--answer-tokens", "2", "--plot", "", "--quiet",
]  # fmt: skip


def hicache(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hicache.cli", *args], cwd=cwd, capture_output=True, text=True
    )


def config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "tiers.yaml"
    path.write_text(text)
    return str(path)


def test_bad_arguments_are_refused_before_the_run(tmp_path: Path):
    zero = hicache("replay", "--page-tokens", "0")
    assert zero.returncode == 2
    assert zero.stderr.splitlines()[-1] == (
        "hicache replay: error: argument --page-tokens: must be at least 1, got 0"
    )
    nowhere = hicache("replay", "--json", "/no/such/dir/x.json")
    assert (nowhere.returncode, nowhere.stderr) == (
        2,
        "hicache replay: --json /no/such/dir/x.json: the folder /no/such/dir does not exist\n",
    )


def test_an_unreachable_master_fails_at_once(tmp_path: Path):
    port = free_port()  # nobody listens there
    path = config(
        tmp_path,
        f"tiers:\n  - {{type: host, size: 64MiB}}\n"
        f"  - {{type: mooncake, master_address: '127.0.0.1:{port}'}}\n",
    )
    done = hicache("replay", "--config", path)
    assert (done.returncode, done.stderr) == (
        2,
        f"hicache replay: {path}: the Mooncake master at 127.0.0.1:{port} does not answer "
        "(Connection refused)\n",
    )


def test_a_host_tier_larger_than_the_machine_fails_at_once(tmp_path: Path):
    path = config(tmp_path, "tiers: [{type: host, size: 1PiB}]\n")
    done = hicache("replay", "--config", path)
    assert done.returncode == 2
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"hicache replay: {path}: tiers.0.size: 1.05e+06 GiB is more than")


def test_help_shows_the_defaults():
    done = hicache("replay", "--help")
    assert done.returncode == 0
    text = " ".join(done.stdout.split())
    assert "turns per conversation (default: 6)" in text
    assert "(default: off)" in text


def test_a_short_replay_with_a_local_store_keeps_mooncake_quiet(tmp_path: Path):
    from mooncake_master import require_mooncake

    require_mooncake()
    done = hicache("replay", *TINY, "--l3", "local", "--json", "out.json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # Mooncake's log lines go to a file without --verbose
    rows = [line.split()[0:2] for line in done.stdout.splitlines()]
    assert ["from", "L3"] in rows and ["outputs", "identical"] in rows
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["identical"] and result["requests"] == 2
    # the last prompt (256 + 2 + 9 tokens, seeded) holds 8 pages of 32 tokens: two groups of 4 in
    # the store, and a second instance takes all of them from there
    assert result["second_instance"] == {
        **result["second_instance"],
        "prompt_tokens": 267,
        "cached_tokens_l3": 256,
        "identical": True,
    }


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_flag(flag):
    import hicache as package

    done = hicache(flag)
    assert (done.returncode, done.stdout) == (0, f"hicache {package.__version__}\n")
