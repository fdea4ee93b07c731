"""docs/vllm.md works as written: its install lines are the ones CI installs with (line for
line in scripts/test.sh), and every other ```bash block runs verbatim, in order, in one shell,
against a real vLLM (its CPU build), and prints every line of the ```text blocks of the
sections that hold those commands. The README's vLLM commands are blocks of docs/vllm.md, so
they run too.

The blocks run in a fresh directory holding the clone's `configs/` (as from the clone, without
leaving a model and a disk tier in it), with this test's Python first on PATH, and in a network
namespace of their own where the machine lets one be made (`unshare`): the ports the doc names
(vLLM's, Mooncake's) are then the script's alone, whatever else runs here.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from leftovers import not_ignored

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "vllm.md"
INSTALL = "Install"  # the section whose commands CI runs (scripts/test.sh) instead of this test
PORTS = (8000, 8001, 50051, 50052, 9003)  # vLLM's servers, Mooncake's master, node, metrics
UNINSTALL = "pip uninstall -y torchvision torchaudio torchcodec"
TEST_VENV = ".venv-test"
"""The tests' venv (scripts/test.sh): the doc's lines, in a directory apart from the demo's."""


def blocks(path: Path) -> list[tuple[str, str, str]]:
    """(section, language, text) of every fenced block of `path`, in order; the section is the
    title of the ``## `` heading above it."""
    found, section = [], ""
    text = path.read_text()
    for m in re.finditer(r"^## ([^\n]*)$|^```(\w*)[^\n]*\n(.*?)^```", text, flags=re.M | re.S):
        if m.group(1) is not None:
            section = m.group(1).strip()
        else:
            found.append((section, m.group(2), m.group(3)))
    return found


def commands(text: str) -> list[str]:
    """The command lines of a shell block, comments and blank lines left out."""
    lines = (line.split(" #", 1)[0].strip() for line in text.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def test_the_install_lines_are_the_ones_ci_runs():
    """Line for line, but for the venv's directory: CI's is `TEST_VENV`, the doc's `.venv`."""
    ci = commands((ROOT / "scripts" / "test.sh").read_text().replace(TEST_VENV, ".venv"))
    install = [t for s, lang, t in blocks(DOC) if s == INSTALL and lang == "bash"]
    assert install, f"{DOC.name} has no ```bash block under '## {INSTALL}'"
    missing = [
        line
        for line in commands("".join(install))
        if not any(c == line or c.endswith(f"|| {line}") for c in ci)
    ]
    assert missing == [], f"scripts/test.sh does not run these lines of {DOC.name}"


def test_every_install_of_the_vllm_extra_is_followed_by_the_uninstall_line():
    """vLLM's torchvision (and the rest) break it beside this torch, and every pip install of
    the `vllm` extra brings them back: in the doc and in CI, the uninstall line comes after the
    last such install."""
    doc = commands("".join(t for s, lang, t in blocks(DOC) if s == INSTALL and lang == "bash"))
    ci = commands((ROOT / "scripts" / "test.sh").read_text())
    for name, lines in (("docs/vllm.md", doc), ("scripts/test.sh", ci)):
        vllm = [i for i, line in enumerate(lines) if "pip install" in line and "vllm" in line]
        assert vllm, f"{name} installs no vllm extra"
        assert UNINSTALL in lines[vllm[-1] + 1 :], f"{name}: no uninstall after {lines[vllm[-1]]}"


def test_the_readme_vllm_commands_are_the_docs_own():
    readme = blocks(ROOT / "README.md")
    ours = {t for _, lang, t in blocks(DOC) if lang == "bash"}
    theirs = [t for s, lang, t in readme if "vLLM" in s and lang == "bash"]
    assert theirs, "the README's vLLM section has no ```bash block"
    assert [t for t in theirs if t not in ours] == []


def _free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def isolated() -> list[str]:
    """The command prefix that runs a shell in a network namespace of its own with loopback up,
    or [] where this machine cannot make one."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return []
    probe = subprocess.run(
        ["unshare", "-rn", "ip", "link", "set", "lo", "up"], capture_output=True, timeout=30
    )
    return ["unshare", "-rn"] if probe.returncode == 0 else []


@pytest.mark.vllm
@pytest.mark.slow
def test_the_first_hit_runs_as_written(tmp_path):
    from test_vllm import require_vllm

    require_vllm()
    namespace = isolated()
    busy = [p for p in PORTS if not _free(p)]
    if busy and not namespace:
        pytest.fail(f"ports {busy} are taken: the doc's commands need them", pytrace=False)
    found = blocks(DOC)
    run = {s for s, lang, _ in found if lang == "bash" and s != INSTALL}
    runnable = [(s, lang, t) for s, lang, t in found if s in run]
    script = "".join(t for _, lang, t in runnable if lang == "bash")
    shown = [line for _, lang, t in runnable if lang == "text" for line in t.splitlines()]
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    if namespace:
        script = "ip link set lo up\n" + script
    # What the commands print is their stdout: a line a command leaves unended on stderr (a
    # library's leak report as `vllm bench serve` exits) would start the next line printed.
    proc = subprocess.Popen(
        [*namespace, "bash", "-e", "-o", "pipefail", "-c", script], cwd=tmp_path, env=env,
        text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=3000)
    finally:
        with contextlib.suppress(ProcessLookupError):  # a server left behind by a failed step
            os.killpg(proc.pid, signal.SIGKILL)
    both = f"stdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"
    log = (tmp_path / "vllm.log").read_text()[-3000:] if (tmp_path / "vllm.log").exists() else ""
    assert proc.returncode == 0, f"the doc's commands failed:\n{both}\nvllm.log:\n{log}"
    printed = set(out.splitlines())
    assert [line for line in shown if line not in printed] == [], both
    assert not_ignored(tmp_path, ("configs",)) == []  # what the doc wrote, .gitignore ignores
    answers = [
        json.loads(line)["choices"][0]["text"]
        for line in out.splitlines()
        if line.startswith('{"id":"cmpl-')
    ]
    assert len(answers) == 5 and len(set(answers)) == 1, answers  # every instance's the same
