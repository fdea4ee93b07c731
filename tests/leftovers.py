"""What a doc's commands leave behind where a user runs them (the clone's root, in the tests a
folder standing in for it): each file or folder must be one the clone's .gitignore ignores, so
that following the docs leaves `git status` clean."""

from __future__ import annotations

import subprocess
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def not_ignored(where: Path, linked: Iterable[str] = ("configs", "examples")) -> list[str]:
    """The entries of `where` (its links to the clone's folders, `linked`, aside) that the
    clone's .gitignore does not ignore, as paths at the clone's root; [] outside a git clone
    (the installed wheel's tests run from a copy without one)."""
    if not (ROOT / ".git").exists():
        return []
    names = sorted(
        p.name + ("/" if p.is_dir() and not p.is_symlink() else "")
        for p in where.iterdir()
        if p.name not in set(linked)
    )
    if not names:
        return []
    done = subprocess.run(
        ["git", "check-ignore", "--no-index", "--stdin"],
        input="\n".join(names) + "\n", cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    ignored = set(done.stdout.splitlines())
    return [n for n in names if n not in ignored]
