"""The stored objects' checksum (`hicache.core.checksum`): the compiled loop and numpy agree, on
any split of the bytes into pieces, and every change of one word is seen."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hicache.core import native
from hicache.core.checksum import checksum, checksum_bytes, checksum_numpy


def _pieces(data: np.ndarray, cuts: list[int]) -> tuple[list[int], list[int]]:
    bounds = [0, *sorted(cuts), data.size]
    spans = [(a, b) for a, b in itertools.pairwise(bounds) if b > a]
    return [data.ctypes.data + a for a, _ in spans], [b - a for a, b in spans]


@pytest.mark.native
def test_the_compiled_checksum_equals_numpy_s_on_any_pieces():
    assert native.library(release_gil=True) is not None
    rng = np.random.default_rng(0)
    for n in (0, 1, 7, 8, 9, 15, 17, 63, 64, 100, 4096, 100_003):
        data = rng.integers(0, 256, n, dtype=np.uint8)
        for _ in range(4):
            cuts = [int(c) for c in rng.integers(0, n + 1, 3)] if n else []
            ptrs, sizes = _pieces(data, cuts)
            assert checksum(ptrs, sizes, 7) == checksum_numpy(ptrs, sizes, 7), (n, cuts)


def test_a_change_of_any_word_the_length_or_the_seed_changes_it():
    rng = np.random.default_rng(1)
    data = bytearray(rng.integers(0, 256, 1000, dtype=np.uint8).tobytes())
    base = checksum_bytes(data, 3)
    assert checksum_bytes(data, 4) != base
    assert checksum_bytes(data + b"\0", 3) != base  # zero padding is not the same bytes
    for at in range(0, 1000, 37):
        for bit in (0, 7):
            data[at] ^= 1 << bit
            assert checksum_bytes(data, 3) != base, at
            data[at] ^= 1 << bit
    swapped = data[8:16] + data[:8] + data[16:]  # two words trade places
    assert checksum_bytes(swapped, 3) != base


def test_the_checksum_benchmark_records_commit_machine_and_command(tmp_path):
    """docs/tiers.md's command, on a few MiB."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "c.json"
    cmd = [sys.executable, "bench/checksum.py", "--machine", "test", "--total", "4MiB"]
    cmd += ["--numpy-total", "1MiB", "--repeats", "1", "--out", str(out)]
    subprocess.run(cmd, cwd=root, check=True, capture_output=True, timeout=300)
    result = json.loads(out.read_text())
    assert {"commit", "machine", "command", "rows"} <= result.keys()
    assert {r["path"] for r in result["rows"]} >= {"numpy"}
    assert all(r["gbps"] > 0 for r in result["rows"])
