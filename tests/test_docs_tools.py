"""docs/tools.md and docs/planner.md work as written: every ```bash block runs verbatim, from a
fresh directory that holds the clone's `examples/` and `configs/` (as from the clone, leaving
the files it writes elsewhere), and exits 0. `--plot` needs the `plot` extra, which the tests
install."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from extras import require_plot
from leftovers import not_ignored
from test_vllm_docs import blocks

ROOT = Path(__file__).resolve().parent.parent
DOCS = (ROOT / "docs" / "tools.md", ROOT / "docs" / "planner.md")
COMMANDS = [(s, t) for doc in DOCS for s, lang, t in blocks(doc) if lang == "bash"]


@pytest.mark.parametrize(("section", "text"), COMMANDS, ids=lambda v: str(v).split()[:3])
def test_the_block_runs_as_written(tmp_path, section, text):
    require_plot()
    for name in ("examples", "configs"):
        (tmp_path / name).symlink_to(ROOT / name)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    done = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", text], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, f"{section}:\n{text}\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
    assert not_ignored(tmp_path) == []  # what the block wrote, .gitignore ignores
