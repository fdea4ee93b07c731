"""Every result file under bench/results/ records, at its top level, the commit, the machine and
the command that made it, so that every figure the docs cite can be traced to its run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

RESULTS = sorted((Path(__file__).resolve().parents[1] / "bench" / "results").glob("*.json"))


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_a_result_file_records_its_commit_machine_and_command(path: Path) -> None:
    data = json.loads(path.read_text())
    assert isinstance(data, dict), "a result file is a JSON object"
    missing = [k for k in ("commit", "machine", "command") if not str(data.get(k) or "").strip()]
    assert missing == []


def test_the_results_are_found() -> None:
    assert len(RESULTS) > 10
