"""What every result file under bench/results/ records about its run: commit, machine, command."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def commit() -> str:
    """The checked-out commit, with "+changes" if the tracked files differ from it; "unknown"
    outside a git checkout. ``HICACHE_BENCH_COMMIT`` names it for a copy of the tree without
    its git folder (a run on another machine)."""
    if os.environ.get("HICACHE_BENCH_COMMIT"):
        return os.environ["HICACHE_BENCH_COMMIT"]

    def git(*args: str) -> str:
        try:
            run = subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT)
        except OSError:
            return ""
        return run.stdout.strip()

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


def command() -> str:
    """This run's command line, as run from the repository root."""
    script = Path(sys.argv[0]).resolve()
    if script.is_relative_to(ROOT):
        script = script.relative_to(ROOT)
    return " ".join(["python", str(script), *sys.argv[1:]])


def write_result(result: dict, kind: str, machine: str, out: str | None) -> None:
    """Write `result` as JSON to `out`, or to bench/results/<kind>_<machine>.json; say where."""
    import json

    path = Path(out) if out else ROOT / "bench" / "results" / f"{kind}_{machine}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")
