"""hicache installs anywhere: the embedding example hits with or without the C helpers, any
failure to build them is one log line and the Python paths, and a built wheel carries every
source that is compiled at first use."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "embed.py"
HIT = "first request: 0 tokens from the cache; second: 128 tokens from the cache"


def run_example(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k not in ("CC", "HICACHE_NO_NATIVE")}
    environ.setdefault("HICACHE_CACHE_DIR", str(tmp_path / "cache"))
    environ.update(env)
    return subprocess.run(
        [sys.executable, str(EXAMPLE)], cwd=tmp_path, env=environ, capture_output=True, text=True
    )


def test_the_embedding_example_hits(tmp_path: Path):
    done = run_example(tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == HIT


@pytest.mark.parametrize(
    ("env", "why"),
    [
        ({"CC": "/no/such/cc", "HICACHE_CACHE_DIR": "{tmp}/fresh"}, "C helpers unavailable"),
        ({"CC": "false", "HICACHE_CACHE_DIR": "{tmp}/fresh"}, "building the C helpers failed"),
        ({"HICACHE_CACHE_DIR": "/proc/hicache-cannot-write-here"}, "C helpers unavailable"),
    ],
    ids=["no-compiler", "compiler-fails", "unwritable-cache"],
)
def test_a_failed_build_is_one_line_and_the_python_paths(tmp_path: Path, env: dict, why: str):
    done = run_example(tmp_path, **{k: v.format(tmp=tmp_path) for k, v in env.items()})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == HIT
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and why in lines[0] and "Python paths" in lines[0], lines


def test_hicache_no_native_takes_the_python_paths_silently(tmp_path: Path):
    done = run_example(tmp_path, HICACHE_NO_NATIVE="1", CC="/no/such/cc")
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.splitlines()[0] == HIT
    probe = "from hicache.core import native; print(native.available(), native.library())"
    out = subprocess.run(
        [sys.executable, "-c", probe],
        env={**os.environ, "HICACHE_NO_NATIVE": "1"},
        capture_output=True,
        text=True,
    )
    assert out.stdout.split() == ["False", "None"]


@pytest.mark.skipif(not (ROOT / "hicache").is_dir(), reason="needs the source tree")
def test_the_wheel_carries_the_sources_compiled_at_first_use(tmp_path: Path):
    tree = tmp_path / "src"  # a copy: the build leaves build/ and egg-info behind it
    for name in ("hicache",):
        shutil.copytree(ROOT / name, tree / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, tree / name)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(tree),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    (wheel,) = tmp_path.glob("hicache-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    native = {
        f"hicache/core/native/{p.name}"
        for p in (ROOT / "hicache" / "core" / "native").glob("*.[ch]")
    }
    assert native <= names and "hicache/kernels/page_copy.cu" in names
    sims = {"hicache/tools/trace/chainsim.c", "hicache/tools/trace/tiersim.c"}
    assert sims <= names  # built at first use by hicache.tools.trace.fastsim
    assert any(n.endswith("LICENSE") for n in names)
