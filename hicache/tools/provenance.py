"""What a result file records about its run, so that every figure can be traced to it: the
commit it ran at (`commit`) and the machine (`cpu_model`, `machine`)."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

__all__ = ["commit", "cpu_model", "machine"]


def commit(where: str | Path = ".") -> str:
    """The commit checked out at `where`, with "+changes" if the tracked files differ from it;
    "unknown" outside a git checkout. ``HICACHE_BENCH_COMMIT`` names it for a copy of the tree
    without its git folder (a run on another machine)."""
    if os.environ.get("HICACHE_BENCH_COMMIT"):
        return os.environ["HICACHE_BENCH_COMMIT"]

    def git(*args: str) -> str:
        try:
            run = subprocess.run(["git", *args], capture_output=True, text=True, cwd=where)
        except OSError:
            return ""
        return run.stdout.strip() if run.returncode == 0 else ""

    head = git("rev-parse", "HEAD") or "unknown"
    return head + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def cpu_model() -> str:
    """The host CPU's model name, for a result's machine line."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine(gpu: str | None = None) -> str:
    """A result's machine line: the GPU's name where one ran, the CPU model and its count."""
    cpus = f"{cpu_model()} ({os.cpu_count()} CPUs)"
    return f"{gpu}, {cpus}" if gpu else cpus
