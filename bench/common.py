"""What every result file under bench/results/ records about its run: commit, machine, command."""

from __future__ import annotations

import sys
from pathlib import Path

from hicache.tools import provenance
from hicache.tools.provenance import cpu_model

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["ROOT", "command", "commit", "cpu_model"]


def commit() -> str:
    """The repository's checked-out commit (`hicache.tools.provenance.commit`)."""
    return provenance.commit(ROOT)


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
