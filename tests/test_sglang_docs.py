"""docs/sglang.md works as written: its install lines are the ones CI installs with (line for
line in scripts/test.sh), the README points SGLang users to it, and the ```bash block of its
CPU section runs verbatim, twice, in a fresh directory holding the clone's `configs/` and
`examples/`, with this test's Python first on PATH and nothing else added to the environment,
and prints every line of that section's ```text block each time (the doc says the example can
be run again on the same directory)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from leftovers import not_ignored
from test_vllm_docs import blocks, commands

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "sglang.md"
INSTALL = "Install"
LAUNCH = "Launch"
CPU = "Try it on a CPU"


def test_the_install_lines_are_the_ones_ci_runs():
    ci = commands((ROOT / "scripts" / "test.sh").read_text())
    install = [t for s, lang, t in blocks(DOC) if s == INSTALL and lang == "bash"]
    assert install, f"{DOC.name} has no ```bash block under '## {INSTALL}'"
    assert [line for line in commands("".join(install)) if line not in ci] == []


def test_the_readme_sends_sglang_users_to_the_docs():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("SGLang\n", 1)[1].split("\n## ", 1)[0]
    assert "hicache.integrations.sglang.HiCacheBackend" in section
    assert "[docs/sglang.md](docs/sglang.md)" in section


def run_as_written(script: str, where: Path) -> subprocess.CompletedProcess[str]:
    """`script` verbatim in `where`, beside the clone's `configs/` and `examples/`, with this
    test's Python first on PATH and nothing else added to the environment."""
    for folder in ("configs", "examples"):
        if not (where / folder).exists():
            (where / folder).symlink_to(ROOT / folder)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    proc = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", script], cwd=where, env=env, text=True,
        capture_output=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_the_launch_sections_check_runs_as_written(tmp_path):
    """The check of the launch line's extra config, before SGLang starts (no SGLang needed)."""
    script = "".join(t for s, lang, t in blocks(DOC) if s == LAUNCH and lang == "bash")
    assert "hicache config check" in script
    run_as_written(script, tmp_path)


@pytest.mark.sglang
def test_the_cpu_example_runs_as_written(tmp_path):
    import sglang_env  # noqa: F401  (skips without SGLang; fails under HICACHE_REQUIRE_SGLANG=1)

    found = [(lang, t) for s, lang, t in blocks(DOC) if s == CPU]
    script = "".join(t for lang, t in found if lang == "bash")
    shown = [line for lang, t in found if lang == "text" for line in t.splitlines()]
    assert script and shown
    for _ in range(2):
        out = run_as_written(script, tmp_path).stdout
        assert [line for line in shown if line not in out.splitlines()] == [], out
    assert not_ignored(tmp_path) == []  # what the commands wrote, .gitignore ignores
