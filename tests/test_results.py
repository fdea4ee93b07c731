"""Every result file under bench/results/ records, at its top level, the commit, the machine and
the command that made it, so that every figure the docs cite can be traced to its run."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = sorted((ROOT / "bench" / "results").glob("*.json"))


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_a_result_file_records_its_commit_machine_and_command(path: Path) -> None:
    data = json.loads(path.read_text())
    assert isinstance(data, dict), "a result file is a JSON object"
    missing = [k for k in ("commit", "machine", "command") if not str(data.get(k) or "").strip()]
    assert missing == []


def test_the_results_are_found() -> None:
    assert len(RESULTS) > 10


SCRIPT = re.compile(r"(?<![\w./-])((?:[\w.-]+/)+[\w.-]+\.(?:py|sh))(?![\w/])")
"""A script named by its path in the tree: `bench/x.py`, `scripts/ab.py` (a bare `x.py` is
another program's argument, not a path this test can check)."""
MODULE = re.compile(r"\bpython3?\s+-m\s+(hicache(?:\.\w+)*)")


def scripts_named(command: str) -> list[str]:
    """The paths of the scripts and hicache modules that `command` runs."""
    named = SCRIPT.findall(command)
    for module in MODULE.findall(command):
        path = module.replace(".", "/")
        named.append(f"{path}/__main__.py" if (ROOT / path).is_dir() else f"{path}.py")
    return named


def test_scripts_named_finds_what_a_command_runs() -> None:
    assert scripts_named("python bench/tiers.py disk --dir /tmp/x --out bench/results/a.json") == [
        "bench/tiers.py"
    ]
    assert scripts_named("python scripts/ab.py BEFORE AFTER; bash scripts/test.sh") == [
        "scripts/ab.py",
        "scripts/test.sh",
    ]
    assert scripts_named("hicache replay --config bench/results/replay_h200.yaml") == []
    assert scripts_named("python -m hicache.tools.vllm_cli bench serve") == [
        "hicache/tools/vllm_cli.py"
    ]


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_a_result_files_command_runs_scripts_that_exist(path: Path) -> None:
    """A command whose script was renamed or removed cannot re-create its file: re-measure with
    the script that exists, or remove the file and the figures that quote it."""
    command = json.loads(path.read_text())["command"]
    assert [s for s in scripts_named(command) if not (ROOT / s).is_file()] == [], command
