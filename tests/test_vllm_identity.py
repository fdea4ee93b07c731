"""The perturbation table of the identity (`hicache.core.identity`) through vLLM's connector:
layouts made from vLLM's own configs (`layout_fields` over its VllmConfig and KVCacheConfig),
a worker per side (`WorkerCache`) over one disk tier. For each field, a worker that differs
only there finds none of the 3 pages another stored; for each setting of `NEUTRAL`, it finds
all 3; for `NAMING`'s, none. tests/test_identity_table.py is the same table through the
reference engine (and holds the docs' table equal to the declarations)."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from test_identity_table import free_port
from test_vllm_books import answered_by, stored_through, tiny_llama  # noqa: F401 (a fixture)

from hicache import load_config
from hicache.core.identity import FIELDS, NAMING, NEUTRAL, Identity
from hicache.integrations.vllm.meta import Lookup
from hicache.integrations.vllm.worker import WorkerCache, layout_fields, vllm_identity

pytestmark = pytest.mark.vllm

P = 4
PROMPT = list(range(100, 113))  # 3 full blocks of 4 and one token


@dataclass(frozen=True)
class Side:
    """One worker: vLLM's settings, the connector's and the shared disk tier's."""

    model: str
    model_args: dict[str, Any] = field(default_factory=dict)
    cache_dtype: str = "fp8_e4m3"
    model_id: str | None = None
    version: str = ""
    kv_heads: int = 1
    rank: tuple[int, int] = (0, 1)
    disk: dict[str, Any] = field(default_factory=dict)
    first: tuple[dict[str, Any], ...] = ()
    """Store tiers before the shared disk tier."""
    more: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)


def vllm_configs(side: Side) -> tuple[Any, Any]:
    from vllm.config import CacheConfig, ModelConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    model = ModelConfig(model=side.model, skip_tokenizer_init=True, **side.model_args)
    config = VllmConfig(model_config=model, cache_config=CacheConfig(cache_dtype=side.cache_dtype))
    spec = FullAttentionSpec(P, num_kv_heads=side.kv_heads, head_size=8, dtype=torch.uint8)
    return config, KVCacheConfig(16, [], [KVCacheGroupSpec(["layer.0", "layer.1"], spec)])


@contextlib.contextmanager
def environment(side: Side) -> Iterator[None]:
    """The side's environment (vLLM's ``VLLM_*`` settings) for the block."""
    saved = {name: os.environ.get(name) for name in side.env}
    os.environ.update(side.env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value


def identity_of(side: Side) -> Identity:
    config, kv = vllm_configs(side)
    spec = kv.kv_cache_groups[0].kv_cache_spec
    rank, size = side.rank
    with environment(side):
        return vllm_identity(config, spec, side.model_id, f"tp{rank}/{size}", side.version)


def worker(side: Side, root: Path) -> WorkerCache:
    disk = {"type": "disk", "path": str(root), "size": "64MiB", "group_pages": 1, **side.disk}
    tiers = [{"type": "host", "size": "1MiB"}, *side.first, disk]
    config = load_config({"tiers": tiers, **side.more}, env={})
    vllm_config, kv_config = vllm_configs(side)
    with environment(side):
        fields = layout_fields(vllm_config, kv_config, side.model_id, *side.rank, side.version)
    w = WorkerCache(config, fields)
    heads = side.kv_heads
    kv = {
        f"layer.{i}": torch.randint(0, 255, (2, 16, P, heads, 8), dtype=torch.uint8) for i in (0, 1)
    }
    w.register(kv, 16)
    return w


def shared(a: Side, b: Side, root: Path) -> int:
    """Tokens worker `b` is answered from the disk tier worker `a` stored the prompt to."""
    first = worker(a, root)
    try:
        stored_through(first, PROMPT)
    finally:
        first.close()
    second = worker(b, root)
    try:
        return answered_by(second, Lookup("q", PROMPT, 0)).hit
    finally:
        second.close()


def flipped(model: str, root: Path) -> str:
    """A copy of `model` with one byte of its weights changed (same names, sizes, config)."""
    folder = root / "flipped"
    shutil.copytree(model, folder)
    file = folder / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 1
    file.write_bytes(bytes(data))
    return str(folder)


Row = Callable[[str, Path], tuple[Side, Side, set[str]]]
ROWS: dict[str, Row | str] = {
    "weights": lambda m, _: (Side(m, model_id="a"), Side(m, model_id="b"), {"weights"}),
    "weights_digest": lambda m, tmp: (
        Side(m, model_id="m"),
        Side(flipped(m, tmp), model_id="m"),
        {"weights_digest"},
    ),
    "weights_version": lambda m, _: (Side(m), Side(m, version="2"), {"weights_version"}),
    "config": lambda m, _: (
        Side(m),
        Side(m, model_args={"hf_overrides": {"rms_norm_eps": 1e-3}}),
        {"config"},
    ),
    "compute_dtype": lambda m, _: (
        Side(m, model_args={"dtype": "float32"}),
        Side(m, model_args={"dtype": "bfloat16"}),
        {"compute_dtype"},
    ),
    "kv_format": lambda m, _: (Side(m), Side(m, cache_dtype="fp8_e5m2"), {"kv_format"}),
    "quantization": "a quantized checkpoint does not load on this CPU (its weights are digested "
    "apart anyway: row weights_digest)",
    "attention": lambda m, _: (Side(m), Side(m, kv_heads=2), {"attention"}),
    "position": lambda m, _: (
        Side(m),
        Side(m, model_args={"hf_overrides": {"rope_theta": 5e5}}),
        {"config", "position"},
    ),
    "shard": lambda m, _: (Side(m, rank=(0, 2)), Side(m, rank=(1, 2)), {"shard"}),
    "arithmetic": lambda m, _: (
        Side(m),
        Side(m, env={"VLLM_BATCH_INVARIANT": "1"}),
        {"arithmetic"},
    ),
    "adapters": "per request under vLLM: an adapter is in its requests' namespace "
    "(tests/test_vllm_books.py)",
    "multimodal": "per request under vLLM: features fold into the page keys "
    "(tests/test_vllm_books.py)",
    "salt": "per request under vLLM: cache_salt is in the request's namespace "
    "(tests/test_vllm_books.py)",
    "engine": "vLLM's drafter is in its kv_format (tests/test_vllm_books.py)",
    "codec": lambda m, _: (Side(m), Side(m, disk={"codec": "lossless"}), set()),
    "tier order": lambda m, tmp: (
        Side(m),
        Side(
            m,
            first=(
                {
                    "type": "disk",
                    "path": str(tmp / "x"),
                    "size": "8MiB",
                    "name": "x",
                    "group_pages": 1,
                },
            ),
        ),
        set(),
    ),
    "metrics port": lambda m, _: (Side(m), Side(m, more={"metrics": {"port": free_port()}}), set()),
    "threads": lambda m, _: (Side(m), Side(m, disk={"fetch_workers": 2}), set()),
    "worker CPUs": lambda m, _: (Side(m), Side(m, disk={"worker_cpus": [0]}), set()),
    "page group size": lambda m, _: (Side(m), Side(m, disk={"group_pages": 4}), set()),
}


def test_the_table_has_a_row_for_every_field_and_setting():
    assert list(ROWS) == [*FIELDS, *NEUTRAL, *NAMING]


@pytest.mark.parametrize("name", [n for n, row in ROWS.items() if not isinstance(row, str)])
def test_a_row_of_the_table(name, tiny_llama, tmp_path):  # noqa: F811
    """Identity fields and `NAMING` settings: 0 of the 12 tokens; `NEUTRAL` settings: all."""
    a, b, differ = ROWS[name](tiny_llama, tmp_path)  # type: ignore[operator]
    assert set(identity_of(a).differences(identity_of(b))) == differ
    if name in FIELDS:
        assert name in differ
    assert shared(a, b, tmp_path / "disk") == (12 if name in NEUTRAL else 0)
