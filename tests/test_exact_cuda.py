"""The reference engine's exact mode on a GPU: in bfloat16, a token's logits and K/V do not depend
on how its prompt was chunked (the invariant Triton kernels of
`hicache.tools.refengine.invariant`), and the engine alone and the engine with hicache (loads by
layer) answer with identical logits.

Run on a machine with CUDA (skipped elsewhere): ``pytest -m cuda tests/test_exact_cuda.py``.
"""

from __future__ import annotations

import pytest
import torch
from test_refengine_exact import chunking_differences, on_off_differences
from test_refengine_hicache import SHAPES

from hicache.tools.refengine.config import FULL, ModelConfig
from hicache.tools.refengine.model import Transformer

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GPU_SHAPES = {
    # two layers of Llama-3-8B (32 query heads, 8 K/V, 128 wide; its projections' shapes, which
    # cuBLAS rounds by row count for up to 240 rows on an H100 and 296 on an H200)
    "llama": ModelConfig(
        family="llama",
        vocab_size=4096,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=2,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        layer_types=(FULL, FULL),
        initializer_range=0.02,
        name="g-llama",
    ),
    # sliding layers: attention over a window
    "qwen3": SHAPES["qwen3"],
}


@pytest.mark.parametrize("family", sorted(GPU_SHAPES))
@pytest.mark.parametrize("exact_mode", [True, False])
def test_a_token_has_the_same_bits_however_its_prompt_is_chunked_only_in_exact_mode(
    family, exact_mode
):
    model = Transformer.random(GPU_SHAPES[family], seed=3, device="cuda", dtype=torch.bfloat16)
    model.exact = exact_mode
    differences = chunking_differences(model)
    if exact_mode:
        assert differences == []
    elif family == "llama":  # the mode is needed: cuBLAS and SDPA round by chunk shape
        assert differences, "no chunking changed a bit without the exact mode"


@pytest.mark.parametrize("family", sorted(GPU_SHAPES))
def test_exact_mode_answers_with_identical_logits_with_the_cache_on_and_off(family):
    assert on_off_differences(GPU_SHAPES[family], "cuda", exact_mode=True) == []
