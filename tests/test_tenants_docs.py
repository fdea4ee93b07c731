"""docs/tenants.md works as written: its YAML is configs/tenants.yaml, and its ```bash blocks run
verbatim, in order, in one shell, from a fresh directory that holds the clone's `configs/` and
`examples/`, and exit 0 (the example checks what the page says it shows)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from leftovers import not_ignored
from test_vllm_docs import blocks

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "tenants.md"

pytest.importorskip("cryptography")


def test_tenants_doc_yaml_is_the_config_file():
    yaml_blocks = [text for _, lang, text in blocks(DOC) if lang == "yaml"]
    assert yaml_blocks == [(ROOT / "configs" / "tenants.yaml").read_text()]


def test_tenants_doc_commands_run_as_written_encrypt_and_quota(tmp_path):
    script = "".join(text for _, lang, text in blocks(DOC) if lang == "bash")
    assert "examples/tenants.py" in script
    for name in ("examples", "configs"):
        (tmp_path / name).symlink_to(ROOT / name)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "PYTHONPATH": str(ROOT)}  # fmt: skip
    env.pop("HICACHE_KEY_ACME", None)
    done = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", script], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "tenants.0.key_env" not in out  # the key was set before the check
    assert "none: 8 of 8 pages in plaintext" in out and "acme: 0 of 8 pages" in out
    assert not_ignored(tmp_path) == []  # what the commands wrote, .gitignore ignores
