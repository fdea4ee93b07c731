"""The reference engine's exact mode: matrix products, RMSNorm and attention whose result for one
token does not depend on how its sequence was cut into chunks or on what else shares the step.

With the mode on, a token's K/V and logits are bit-identical whether its row was computed in a
whole-prompt prefill, in a suffix chunk after a cache hit, or as one decode token, in bfloat16
on a GPU and on the CPU (in float32 the CPU's GEMMs round a row differently by row count, so
the mode does not make float32 CPU runs exact). Elementwise ops are invariant by nature; the
reductions are what this module makes invariant:

- on CUDA, by construction: `hicache.tools.refengine.invariant`'s Triton kernels reduce each
  output element in one program, in an order fixed by the code and the weights' shapes (tiles
  chosen from the weight, no split over K; attention over keys cut at absolute positions), so
  no row count and no GPU model changes a row's bits;
- on the CPU: products are `F.linear` (bfloat16 products round a row alike for any row count
  there); `rms_norm` sums the squares by a fixed pairwise tree of elementwise adds; `attend`
  is a plain online softmax in float32 over `KV_BLOCK`-key blocks aligned at absolute
  positions, in the same order whatever the chunk.

docs/decisions/exact-mode.md records what differed, on which device, and what the mode costs.
"""

from __future__ import annotations

import math

import torch

KV_BLOCK = 256
"""Keys per block of the CPU's online softmax (blocks start at multiples of it)."""

Q_TILE = 16
"""Queries per matrix product of the CPU's online softmax."""


def _kernels(t: torch.Tensor):
    """The invariant Triton kernels where `t` is on CUDA (imported there only), else None."""
    if not t.is_cuda:
        return None
    from hicache.tools.refengine import invariant

    return invariant


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` whose rows do not depend on each other's presence."""
    kernels = _kernels(x)
    if kernels is None:
        return torch.nn.functional.linear(x, w, b)
    return kernels.matmul(x, w, b)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, as transformers computes it (float32, then cast), with the mean
    of squares summed by `tree_sum` (on CUDA, one program per row)."""
    kernels = _kernels(x)
    if kernels is not None:
        return kernels.rms_norm(x, w, eps)
    h = x.to(torch.float32)
    ms = tree_sum(h * h) / h.shape[-1]
    return w * (h * torch.rsqrt(ms + eps)[..., None]).to(x.dtype)


def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim by halving it with elementwise adds (zero-padded to a power of two):
    the same additions in the same order for a row, however many rows `x` has."""
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        x = torch.nn.functional.pad(x, (0, width - n))
    while width > 1:
        width //= 2
        x = x[..., :width] + x[..., width:]
    return x[..., 0]


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    vals: torch.Tensor,
    qpos0: int,
    kpos0: int,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of queries ``q [L, H, D]`` at positions ``qpos0 ..`` over ``keys``/``vals``
    ``[E, Hk, D]`` at positions ``kpos0 ..`` (the last key is the last query's position; a group
    of ``H / Hk`` query heads reads one K/V head); with `window`, a query sees only its last
    `window` positions. Returns ``[L, H, D]`` in q's dtype."""
    L, E = q.shape[0], keys.shape[0]
    if kpos0 + E != qpos0 + L:
        raise ValueError(f"keys end at {kpos0 + E}, queries at {qpos0 + L}")
    kernels = _kernels(q)
    if kernels is not None:
        return kernels.attention(q, keys, vals, qpos0, kpos0, scale, window)
    rep = q.shape[1] // keys.shape[1]
    if rep > 1:
        keys, vals = keys.repeat_interleave(rep, dim=1), vals.repeat_interleave(rep, dim=1)
    return _blocked(q, keys, vals, qpos0, kpos0, scale, window)


def _blocked(
    q: torch.Tensor,
    keys: torch.Tensor,
    vals: torch.Tensor,
    qpos0: int,
    kpos0: int,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """Online softmax in float32 over key blocks ``[b, b + KV_BLOCK)``, b a multiple of
    KV_BLOCK, in increasing order. A block's keys past the query (or outside its window) weigh
    exactly zero and leave the running max, sum and output bit-unchanged, so the blocks a chunk
    adds after a query's last key do not change its result. The products run on tiles of
    `Q_TILE` queries (one shape, whatever the chunk's length)."""
    L, H, D = q.shape
    rows = -(-L // Q_TILE) * Q_TILE
    end = kpos0 + keys.shape[0]
    dev = q.device
    qf = torch.zeros(H, rows, D, device=dev)
    qf[:, :L] = q.transpose(0, 1)
    qf = qf.view(H, rows // Q_TILE, Q_TILE, D)
    qpos = torch.arange(qpos0, qpos0 + rows, device=dev).clamp(max=end - 1)[:, None]
    m = torch.full((H, rows), -math.inf, device=dev)
    total = torch.zeros(H, rows, device=dev)
    acc = torch.zeros(H, rows, D, device=dev)
    for b in range(kpos0 - kpos0 % KV_BLOCK, end, KV_BLOCK):
        lo, hi = max(b, kpos0), min(b + KV_BLOCK, end)
        kb = torch.zeros(H, KV_BLOCK, D, device=dev)
        vb = torch.zeros(H, KV_BLOCK, D, device=dev)
        kb[:, lo - b : hi - b] = keys[lo - kpos0 : hi - kpos0].transpose(0, 1)
        vb[:, lo - b : hi - b] = vals[lo - kpos0 : hi - kpos0].transpose(0, 1)
        kpos = torch.arange(b, b + KV_BLOCK, device=dev)[None, :]
        seen = (kpos <= qpos) & (kpos >= lo) & (kpos < hi)
        if window is not None:
            seen &= kpos > qpos - window
        s = torch.matmul(qf, kb.transpose(1, 2)[:, None]).view(H, rows, KV_BLOCK) * scale
        s = s.masked_fill(~seen, -math.inf)
        m_new = torch.maximum(m, s.amax(-1))
        live = m_new > -math.inf  # rows that have seen a key so far
        alpha = torch.where(live, torch.exp(m - m_new), 1.0)
        p = torch.where(live[..., None], torch.exp(s - m_new[..., None]), 0.0)
        total = total * alpha + tree_sum(p)
        pv = torch.matmul(p.view(H, rows // Q_TILE, Q_TILE, KV_BLOCK), vb[:, None])
        acc = acc * alpha[..., None] + pv.view(H, rows, D)
        m = m_new
    out = acc[:, :L] / total[:, :L, None]
    return out.transpose(0, 1).to(q.dtype)
