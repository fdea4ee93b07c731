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
