"""`hicache replay`'s arguments and setup are checked before the run: a mistake is one line on
stderr and exit status 2 within seconds, never a traceback after minutes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

TINY = [
    "--model", "tiny-llama", "--conversations", "1", "--turns", "2", "--first-tokens", "256",
    "--message-tokens", "8", "--answer-tokens", "2", "--repeats", "1", "--quiet",
]  # fmt: skip


def hicache(*args: str, cwd: Path | None = None, pre: str = "") -> subprocess.CompletedProcess[str]:
    """Run ``hicache ARGS`` in a fresh interpreter (after the Python statements `pre`)."""
    code = f"import sys\n{pre}\nfrom hicache.cli import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=cwd, capture_output=True, text=True
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


def test_help_shows_the_defaults():
    done = hicache("replay", "--help")
    assert done.returncode == 0
    text = " ".join(done.stdout.split())
    assert "turns per conversation (default: 6)" in text
    assert "(default: off)" in text


def test_a_short_replay_with_a_local_store_keeps_mooncake_quiet(tmp_path: Path):
    from mooncake_master import require_mooncake

    require_mooncake()
    done = hicache("replay", *TINY, "--store", "local", "--json", "out.json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # no Mooncake log line without --verbose
    rows = [line.split()[0:3] for line in done.stdout.splitlines()]
    assert ["from", "store", "tiers"] in rows and ["outputs", "identical", "yes"] in rows
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]  # no plot unless asked
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["identical"] and result["requests"] == 2
    assert result["interleaved"] == "by turn"  # and the load it ran under, printed and kept:
    assert [len(result["load_average"][k]) for k in ("before", "after")] == [3, 3]
    assert any(
        line.startswith("load average (1, 5, 15 min): ") for line in done.stdout.splitlines()
    )
    # the last prompt (256 + 2 + 9 tokens, seeded) holds 8 pages of 32 tokens: two groups of 4 in
    # the store, and a second instance, started after the first closed, takes all from there
    assert result["second_instance"] == {
        **result["second_instance"],
        "prompt_tokens": 267,
        "cached_tokens_store": 256,
        "identical": True,
    }


def test_off_a_terminal_each_phase_is_a_line_on_stderr_and_l3_is_still_understood(
    tmp_path: Path,
):
    tiny = [a for a in TINY if a != "--quiet"]
    done = hicache("replay", *tiny, "--repeats", "2", "--l3", "off", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    # a long phase also prints how far it got every 30 s: a busy machine may show such lines
    lines = [
        line.split(" in ")[0]
        for line in done.stderr.splitlines()
        if not re.search(r": [0-9]+/4 requests in [0-9]+ s$", line)
    ]
    assert lines == [
        "hicache replay: engine / + hicache (by turn) 1/2: 4 requests",
        "hicache replay: engine / + hicache (by turn) 1/2: done",
        "hicache replay: engine / + hicache (by turn) 2/2: 4 requests",
        "hicache replay: engine / + hicache (by turn) 2/2: done",
    ]
    assert "median of 2 repetitions [smallest–largest]" in done.stdout
    assert "matplotlib" not in done.stdout + done.stderr
    assert list(tmp_path.iterdir()) == []


def test_plot_without_matplotlib_fails_before_the_run(tmp_path: Path):
    done = hicache(
        "replay", *TINY, "--plot", "t.png", cwd=tmp_path, pre="sys.modules['matplotlib'] = None"
    )
    assert (done.returncode, done.stderr) == (
        2,
        "hicache replay: --plot needs matplotlib, which is not installed (pip install "
        "matplotlib)\n",
    )


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_flag(flag):
    import hicache as package

    done = hicache(flag)
    assert (done.returncode, done.stdout) == (0, f"hicache {package.__version__}\n")


LIGHT = [
    ["--help"], ["--version"], ["config", "--help"], ["config", "check", "--help"],
    ["replay", "--help"], ["trace", "--help"], ["trace", "import", "--help"],
]  # fmt: skip


@pytest.mark.parametrize("argv", LIGHT, ids=" ".join)
def test_help_and_version_answer_without_importing_torch(argv):
    """`--help` and `--version` answer at once: neither hicache's cache nor torch is imported
    for them (torch alone takes seconds to import on a busy machine)."""
    code = (
        "import sys\nfrom hicache.cli import main\n"
        "try:\n    status = main(sys.argv[1:])\nexcept SystemExit as e:\n    status = e.code\n"
        "print(status, 'torch' in sys.modules, file=sys.stderr)"
    )
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True)
    assert done.stderr.splitlines()[-1] == "0 False", done.stderr
    assert done.stdout.strip()


def test_the_command_list_names_every_command_and_config_help_names_its_flag():
    listed = hicache("--help").stdout
    from importlib.metadata import entry_points

    names = [ep.name for ep in entry_points(group="hicache.commands")]
    lines = [line for line in listed.splitlines() if line.startswith("hicache ")]
    assert sorted({line.split()[1] for line in lines}) == sorted({"config", "COMMAND", *names})
    assert any(line.startswith("hicache trace import DIR OUT") for line in lines)
    assert "--kv-transfer-config" in hicache("config", "--help").stdout
