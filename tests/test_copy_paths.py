"""The copy-path choice: the fastest measured path per pool shape, the copy engines within a
margin, kept per device in a table file that later processes reuse (CPU: the measurement is a
stand-in here; tests/test_kernels_cuda.py measures on a GPU)."""

from __future__ import annotations

import json

import pytest
import torch

from hicache.kernels import PagedBuffer
from hicache.kernels.cuda import shape_of
from hicache.kernels.paths import MARGIN, PathTable, Shape, pick

H2D = Shape("h2d", (65536,), (65536,), True)


def test_the_fastest_path_wins_but_the_copy_engines_keep_a_near_tie():
    assert pick({"copy_engine": 1.0, "kernel": 0.95}) == "kernel"
    assert pick({"copy_engine": 1.0, "kernel": 1.0 - MARGIN / 2}) == "copy_engine"
    assert pick({"copy_engine": 1.0, "kernel": 1.2, "staged": 0.9}) == "staged"
    assert pick({"kernel": 2.0, "staged": 1.0}) == "staged"
    with pytest.raises(ValueError, match="no path"):
        pick({})


def test_a_shape_is_measured_once_and_the_file_is_reused(tmp_path):
    file = tmp_path / "paths.json"
    calls = []

    def measure(shape):
        calls.append(shape.key)
        return {"copy_engine": 2.0, "kernel": 1.0, "staged": 1.5}

    table = PathTable(file, "GPU-A")
    assert table.choose(H2D, measure) == "kernel"
    assert table.choose(H2D, measure) == "kernel"
    assert calls == [H2D.key]
    again = PathTable(file, "GPU-A")  # another process on the same kind of GPU
    assert again.choose(H2D, measure) == "kernel" and calls == [H2D.key]
    other = PathTable(file, "GPU-B")  # another kind of GPU measures for itself
    assert other.choose(H2D, lambda s: {"copy_engine": 1.0, "kernel": 3.0}) == "copy_engine"
    saved = json.loads(file.read_text())
    assert saved["GPU-A"][H2D.key]["path"] == "kernel"
    assert saved["GPU-B"][H2D.key]["path"] == "copy_engine"


def test_a_broken_file_or_a_path_that_does_not_apply_is_measured_again(tmp_path):
    file = tmp_path / "paths.json"
    file.write_text("{not json")
    table = PathTable(file, "GPU-A")
    assert table.choose(H2D, lambda s: {"copy_engine": 1.0, "kernel": 0.5}) == "kernel"
    d2d = Shape("d2d", (4096,), (4096,), False)
    file.write_text(json.dumps({"GPU-A": {d2d.key: {"path": "staged"}}}))
    table = PathTable(file, "GPU-A")
    assert table.get(d2d) is None  # staged is no candidate between two GPU pools
    assert table.choose(d2d, lambda s: {"copy_engine": 1.0, "kernel": 0.5}) == "kernel"


def test_an_unwritable_folder_keeps_the_choice_in_memory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    table = PathTable(blocker / "sub" / "paths.json", "GPU-A")
    assert table.choose(H2D, lambda s: {"copy_engine": 1.0, "kernel": 0.5}) == "kernel"
    assert table.get(H2D) == "kernel"


def test_the_shape_names_direction_rows_and_whole_host_pages():
    host = PagedBuffer.page_first(torch.zeros(2, 64 * 1024, dtype=torch.uint8))
    rows = host.resegment((32 * 1024, 32 * 1024))
    layer_first = PagedBuffer.layer_first([torch.zeros(2, 32 * 1024, dtype=torch.uint8)] * 2)
    shape = shape_of(rows, layer_first)
    assert shape.src_rows == (32 * 1024, 32 * 1024) and shape.host_whole_pages is False
    assert shape.key == "d2d:2x32768->2x32768:rows"  # two CPU buffers read as one device's
    assert Shape("d2h", (1024,) * 3, (3072,), True).key == "d2h:3x1024->3072:whole"
    assert Shape("h2d", (256, 16), (272,), True).candidates == ("copy_engine", "kernel", "staged")
    assert "staged" not in Shape("d2d", (256,), (256,), False).candidates
