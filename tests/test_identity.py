"""One identity of a page's bytes (`hicache.core.identity`): what decides them, how it names the
page keys' namespace, and the weights by content, through the reference engine and the core.

Reproductions of issue 56: a fine-tune written over its base (q_proj only) and the reference
engine's exact mode, each through a real disk tier two engines share.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fake_engine import PATIENT_WAIT_MS

pytest.importorskip("hicache.cache")

from hicache.tools.refengine.build import EngineSpec, build_engine, load_model
from hicache.tools.refengine.config import FULL, ModelConfig
from hicache.tools.refengine.model import Transformer
from hicache.tools.refengine.workload import drive, make_workload

PAGE = 16
FOLDER_SHAPE = ModelConfig(
    family="llama", vocab_size=1000, hidden_size=256, intermediate_size=512, num_layers=4,
    num_heads=4, num_kv_heads=2, head_dim=64, layer_types=(FULL,) * 4, initializer_range=0.05,
    name="t-folder",
)  # fmt: skip
"""A model of about 10 MiB in one file: more than the three MiB the old digest sampled."""


def disk_config(path: Path) -> dict:
    return {
        "tiers": [
            {"type": "host", "size": "16MiB"},
            {"type": "disk", "path": str(path), "size": "64MiB", "sync": False},
        ],
        "policy": {"fetch_max_wait_ms": PATIENT_WAIT_MS},
    }


def spec(model: str = "tiny-llama", **kw) -> EngineSpec:
    base = dict(page_tokens=PAGE, num_blocks=128, num_slots=4, chunk_tokens=64, prefix_share=0.0)
    return EngineSpec(model=model, **{**base, **kw})


def convs(vocab: int = 1000):
    """One conversation of one 100-token prompt: 6 full pages of 16."""
    return make_workload(
        conversations=1, turns=1, first_tokens=100, message_tokens=8, answer_tokens=2,
        vocab_size=vocab, seed=5,
    )  # fmt: skip


def shared_tokens(first: EngineSpec, second: EngineSpec, root: Path) -> int:
    """Tokens engine `second` takes from the disk tier engine `first` stored to (each its own
    process's host tier): what the two share."""
    a = build_engine(first, disk_config(root))
    drive(a, convs())
    a.cache.close()
    b = build_engine(second, disk_config(root))
    try:
        done = drive(b, convs())
    finally:
        b.cache.close()
    return sum(r.l3_tokens for conv in done for r in conv)


def save_folder(folder: Path, model: Transformer) -> Path:
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(model.cfg.to_hf()))
    weights = {name: t.contiguous() for name, t in model.w.items()}
    save_file(weights, str(folder / "model.safetensors"))
    return folder


def tensor_span(path: Path, name: str) -> tuple[int, int]:
    """Where tensor `name`'s bytes lie in a safetensors file (absolute offsets)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    lo, hi = json.loads(raw[8 : 8 + n])[name]["data_offsets"]
    return 8 + n + lo, 8 + n + hi


def test_the_same_engine_shares_every_page_through_disk(tmp_path):
    """The baseline the reproductions need: one spec twice shares all 6 full pages."""
    assert shared_tokens(spec(), spec(), tmp_path / "d") == 96


def test_a_fine_tune_of_q_proj_written_over_its_base_shares_no_page(tmp_path):
    """A merged LoRA that changes one layer's q_proj (bytes away from the first, middle and last
    MiB of the file, where a sampling digest would look) keeps the file's name, size and config:
    before, it keyed as its base did and took the base's 6 pages from the disk tier."""
    base = Transformer.random(FOLDER_SHAPE, seed=3)
    folder = save_folder(tmp_path / "model", base)
    file = folder / "model.safetensors"
    size = file.stat().st_size
    mib = 1 << 20
    sampled = [(0, mib), (size // 2 - mib // 2, size // 2 + mib // 2), (size - mib, size)]
    name = next(
        n for n in sorted(base.w) if n.endswith("q_proj.weight")
        and not any(lo < tensor_span(file, n)[1] and tensor_span(file, n)[0] < hi
                    for lo, hi in sampled)
    )  # fmt: skip
    shared_base = shared_tokens(spec(str(folder)), spec(str(folder)), tmp_path / "base")
    assert shared_base == 96

    lo, hi = tensor_span(file, name)
    data = bytearray(file.read_bytes())
    delta = torch.frombuffer(bytearray(data[lo:hi]), dtype=torch.float32) * 1.01
    data[lo:hi] = delta.numpy().tobytes()
    a = build_engine(spec(str(folder)), disk_config(tmp_path / "ft"))
    drive(a, convs())
    a.cache.close()
    file.write_bytes(bytes(data))  # the fine-tune written over its base, same size
    b = build_engine(spec(str(folder)), disk_config(tmp_path / "ft"))
    try:
        done = drive(b, convs())
    finally:
        b.cache.close()
    assert sum(r.l3_tokens for conv in done for r in conv) == 0


def test_runs_with_and_without_exact_mode_share_no_page(tmp_path):
    """The exact mode computes K/V with other arithmetic (other bits): before, a run with
    `exact` took the 96 tokens a run without it had stored on one disk tier."""
    assert shared_tokens(spec(exact=False), spec(exact=True), tmp_path / "d") == 0
    assert shared_tokens(spec(exact=True), spec(exact=True), tmp_path / "e") == 96


def test_load_model_names_the_weights_only(tmp_path):
    """What `load_model` names is the weights; the mode and the device are the engine's."""
    _, exact = load_model(spec(exact=True))
    _, plain = load_model(spec(exact=False))
    assert exact == plain
