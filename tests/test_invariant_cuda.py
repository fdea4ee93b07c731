"""The exact mode's Triton kernels on a GPU: a row's bits do not depend on how many rows share
its call or where its chunk began (the products at Llama-3-8B's shapes for every row count that
cuBLAS rounds differently on an H100 or an H200, RMSNorm, attention over split keys with grouped
heads and sliding windows), and the results are those of the plain computation to rounding.

Run on a machine with CUDA (skipped elsewhere): ``pytest -m cuda tests/test_invariant_cuda.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ROWS = [*range(1, 18), 63, 64, 65, 127, 128, 129, 240, 241, 256, 288, 296, 297, 448, 1000, 4097]
"""Row counts to compare with the 8,192-row product (up to 296 rounded otherwise on an H200)."""

LLAMA_8B = {  # weight [N, K]
    "q_proj": (4096, 4096),
    "k_proj": (1024, 4096),
    "o_proj": (4096, 4096),
    "gate_proj": (14336, 4096),
    "down_proj": (4096, 14336),
    "lm_head": (32768, 4096),
}


@pytest.fixture(scope="module")
def invariant():
    from hicache.tools.refengine import invariant

    return invariant


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


@pytest.mark.parametrize("name", sorted(LLAMA_8B))
def test_a_product_row_has_the_same_bits_whatever_rows_share_the_call(invariant, name):
    n, k = LLAMA_8B[name]
    x = torch.randn(8192, k, device="cuda", generator=_gen(1)).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=_gen(2)) * 0.02).bfloat16()
    full = invariant.matmul(x, w)
    differ = [m for m in ROWS if not torch.equal(invariant.matmul(x[:m], w), full[:m])]
    shifted = [m for m in (1, 5, 300) if not torch.equal(invariant.matmul(x[77 : 77 + m], w),
                                                         full[77 : 77 + m])]  # fmt: skip
    assert (differ, shifted) == ([], [])
    reference = F.linear(x.float(), w.float())
    assert torch.allclose(full.float(), reference, rtol=2e-2, atol=2e-2)


def test_a_product_with_a_bias_in_float32_keeps_its_rows_too(invariant):
    x = torch.randn(600, 256, device="cuda", generator=_gen(3))
    w = torch.randn(320, 256, device="cuda", generator=_gen(4))
    b = torch.randn(320, device="cuda", generator=_gen(5))
    full = invariant.matmul(x, w, b)
    assert all(torch.equal(invariant.matmul(x[:m], w, b), full[:m]) for m in (1, 3, 64, 65))
    assert torch.allclose(full, F.linear(x, w, b), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("width", [128, 4096, 5120])
def test_an_rms_norm_row_has_the_same_bits_whatever_rows_share_the_call(invariant, width):
    x = torch.randn(3000, width, device="cuda", generator=_gen(6)).bfloat16()
    w = torch.rand(width, device="cuda", generator=_gen(7)).bfloat16() + 0.5
    full = invariant.rms_norm(x, w, 1e-5)
    assert all(torch.equal(invariant.rms_norm(x[:m], w, 1e-5), full[:m]) for m in ROWS[:-1])
    h = x.float()
    reference = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
    assert torch.allclose(full.float(), reference.float(), rtol=1e-2, atol=1e-2)


def _reference_attention(q, k, v, qpos0, kpos0, scale, window=None):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1).float(), v.repeat_interleave(rep, 1).float()
    qpos = torch.arange(qpos0, qpos0 + q.shape[0], device="cuda")[:, None]
    kpos = torch.arange(kpos0, kpos0 + k.shape[0], device="cuda")[None, :]
    seen = kpos <= qpos
    if window is not None:
        seen &= kpos > qpos - window
    s = torch.einsum("lhd,ehd->hle", q.float(), k) * scale
    p = torch.softmax(s.masked_fill(~seen, -torch.inf), dim=-1)
    return torch.einsum("hle,ehd->lhd", p, v)


@pytest.mark.parametrize("window", [None, 1000])
def test_a_query_has_the_same_bits_however_its_prompt_was_chunked(invariant, window):
    """Queries of a chunk (L queries ending at position `end`, with the keys a sliding layer
    keeps) against the same queries in one pass over 9,000 positions: three key segments,
    32 query heads over 8 K/V heads."""
    n, H, Hk, D = 9000, 32, 8, 128
    q = torch.randn(n, H, D, device="cuda", generator=_gen(8)).bfloat16()
    k = torch.randn(n, Hk, D, device="cuda", generator=_gen(9)).bfloat16()
    v = torch.randn(n, Hk, D, device="cuda", generator=_gen(10)).bfloat16()
    scale = D**-0.5
    full = invariant.attention(q, k, v, 0, 0, scale, window)
    differ = []
    for end in (n, 4096, 4097, 1000):
        for L in (1, 2, 16, 63, 64, 65, 112, 448, 1000):
            s = end - L
            first = 0 if window is None else max(0, s - (window - 1))
            chunk = invariant.attention(q[s:end], k[first:end], v[first:end], s, first, scale,
                                        window)  # fmt: skip
            if not torch.equal(chunk, full[s:end]):
                differ.append((L, end))
    assert differ == []
    reference = _reference_attention(q[n - 300 :], k, v, n - 300, 0, scale, window)
    assert torch.allclose(full[n - 300 :].float(), reference, rtol=2e-2, atol=2e-2)
