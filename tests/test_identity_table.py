"""The perturbation table of the identity (`hicache.core.identity`), through the reference
engine: for each field, two engines that differ only there share 0 pages on one disk tier; for
each setting that must not matter (`NEUTRAL`), they share every page. Each row also checks which
fields of the two identities differ, so a field an engine stops filling, or one the identity's
name stops covering, fails its row. docs/identity.md's table is generated from the same
declarations (`hicache.tools.docgen identity`) and held equal to them here.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
from test_identity import convs, save_folder, spec
from test_vllm_docs import blocks

from hicache.core.identity import FIELDS, NAMING, NEUTRAL, Identity
from hicache.tools import docgen
from hicache.tools.refengine.build import EngineSpec, build_engine, engine_identity, load_model
from hicache.tools.refengine.config import NAMED
from hicache.tools.refengine.model import Transformer
from hicache.tools.refengine.workload import drive

FULL = 96
"""Tokens of the workload's 6 full pages: what two engines of one identity share."""


@dataclass(frozen=True)
class Row:
    """Two engines: specs, and what each one's config changes on the shared disk tier."""

    a: EngineSpec
    b: EngineSpec
    differ: frozenset[str] = frozenset()
    """The identity fields in which the two differ (for a `FIELDS` row, its own among them)."""
    disk_a: dict[str, Any] = field(default_factory=dict)
    disk_b: dict[str, Any] = field(default_factory=dict)
    config_b: dict[str, Any] = field(default_factory=dict)
    first_b: list[dict[str, Any]] = field(default_factory=list)
    """Store tiers B lists before the shared disk tier."""


def folders(root: Path, change_config: dict | None = None, flip: bool = False) -> str:
    """tiny-llama saved under `root`/m (its config changed by `change_config`, one weight's
    byte flipped with `flip`): a folder model named ``m`` wherever it lies."""
    model = Transformer.random(NAMED["tiny-llama"], seed=0)
    folder = save_folder(root / "m", model)
    if change_config:
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**cfg, **change_config}))
    if flip:
        file = folder / "model.safetensors"
        data = bytearray(file.read_bytes())
        data[len(data) // 2] ^= 1
        file.write_bytes(bytes(data))
    return str(folder)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rope(theta: float) -> dict:
    return {"rope_parameters": {"rope_type": "default", "rope_theta": theta}}


BASE = spec()
ROWS: dict[str, Callable[[Path], Row] | str] = {
    "weights": lambda _: Row(BASE, replace(BASE, seed=1), frozenset({"weights"})),
    "weights_digest": lambda tmp: Row(
        spec(folders(tmp / "a")),
        spec(folders(tmp / "b", flip=True)),
        frozenset({"weights_digest"}),
    ),
    "weights_version": lambda _: Row(
        BASE, replace(BASE, weights_version="2"), frozenset({"weights_version"})
    ),
    "config": lambda tmp: Row(
        spec(folders(tmp / "a")),
        spec(folders(tmp / "b", {"rms_norm_eps": 1e-3})),
        frozenset({"config"}),
    ),
    "compute_dtype": lambda _: Row(
        BASE, replace(BASE, dtype="bfloat16"), frozenset({"compute_dtype", "kv_format"})
    ),
    "kv_format": "the reference engine keeps K/V in its compute dtype (row compute_dtype)",
    "quantization": "the reference engine has no quantized weights",
    "attention": "the reference engine's heads and window are its config's (row config)",
    "position": lambda tmp: Row(
        spec(folders(tmp / "a", rope(1e4))),
        spec(folders(tmp / "b", rope(5e5))),
        frozenset({"config", "position"}),
    ),
    "shard": "the reference engine runs one rank",
    "arithmetic": lambda _: Row(BASE, replace(BASE, exact=True), frozenset({"arithmetic"})),
    "adapters": "the reference engine has no adapters",
    "multimodal": "the reference engine reads text only",
    "salt": "the reference engine has no tenant salt",
    "engine": "the reference engine has no other setting of the bytes",
    "codec": lambda _: Row(BASE, BASE, disk_b={"codec": "lossless"}),
    "tier order": lambda tmp: Row(
        BASE, BASE, first_b=[{"type": "disk", "path": str(tmp / "x"), "size": "8MiB", "name": "x"}]
    ),
    "metrics port": lambda _: Row(BASE, BASE, config_b={"metrics": {"port": free_port()}}),
    "threads": lambda _: Row(BASE, BASE, disk_a={"fetch_workers": 1}, disk_b={"fetch_workers": 2}),
    "worker CPUs": lambda _: Row(BASE, BASE, disk_b={"worker_cpus": [0]}),
    "page group size": lambda _: Row(
        BASE, BASE, disk_a={"group_pages": 4}, disk_b={"group_pages": 1}
    ),
}
"""Every identity field and every setting of `NEUTRAL` and `NAMING`: two engines (a `Row`,
made in a test's folder), or why the reference engine has no such input."""


def config(root: Path, disk: dict, first: list | None = None, more: dict | None = None) -> dict:
    shared = {"type": "disk", "path": str(root), "size": "64MiB", "sync": False, **disk}
    return {
        "tiers": [{"type": "host", "size": "16MiB"}, *(first or []), shared],
        "policy": {"fetch_max_wait_ms": 60_000},
        **(more or {}),
    }


def identity(s: EngineSpec) -> Identity:
    return engine_identity(s, *load_model(s))


def shared(row: Row, root: Path) -> int:
    a = build_engine(row.a, config(root, row.disk_a))
    drive(a, convs())
    a.cache.close()
    b = build_engine(row.b, config(root, row.disk_b, row.first_b, row.config_b))
    try:
        return sum(r.l3_tokens for conv in drive(b, convs()) for r in conv)
    finally:
        b.cache.close()


def test_the_table_has_a_row_for_every_field_and_setting():
    assert list(ROWS) == [*FIELDS, *NEUTRAL, *NAMING]


@pytest.mark.parametrize("name", [n for n, row in ROWS.items() if not isinstance(row, str)])
def test_a_row_of_the_table(name, tmp_path):
    """Identity fields and `NAMING` settings: 0 tokens shared; `NEUTRAL` settings: all 96."""
    row = ROWS[name](tmp_path)  # type: ignore[operator]
    differ = identity(row.a).differences(identity(row.b))
    assert set(differ) == row.differ
    if name in FIELDS:
        assert name in differ
    assert shared(row, tmp_path / "disk") == (FULL if name in NEUTRAL else 0)


DOC = Path(__file__).parents[1] / "docs" / "identity.md"


@pytest.mark.parametrize(("section", "lang", "text"), blocks(DOC), ids=lambda v: str(v)[:16])
def test_the_docs_blocks_run_as_written(section, lang, text, tmp_path):
    """docs/identity.md's code: the Python builds its layout; the command prints the table the
    page holds (the declared one)."""
    if lang == "python":
        scope: dict[str, Any] = {}
        exec(compile(text, str(DOC), "exec"), scope)
        assert scope["layout"].model == scope["identity"].name()
        return
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    done = subprocess.run(
        ["bash", "-e", "-c", text], cwd=DOC.parents[1], env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == docgen.identity_table()
    assert done.stdout in DOC.read_text(), "docs/identity.md's table is stale: run the command"


def test_a_field_the_name_leaves_out_fails_its_row(tmp_path, monkeypatch):
    """The table catches a dropped field: with `arithmetic` left out of the identity's name,
    its row's two engines share all 96 tokens (the row asks 0)."""
    canonical = Identity.canonical

    def without_arithmetic(self: Identity) -> bytes:
        return canonical(replace(self, arithmetic=""))

    monkeypatch.setattr(Identity, "canonical", without_arithmetic)
    row = ROWS["arithmetic"](tmp_path)  # type: ignore[operator]
    assert shared(row, tmp_path / "disk") == FULL
