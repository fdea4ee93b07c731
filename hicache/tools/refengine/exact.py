"""The reference engine's exact mode: matrix products, RMSNorm and attention whose result for one
token does not depend on how its sequence was cut into chunks or on what else shares the step.

With the mode on, a token's K/V and logits are bit-identical whether its row was computed in a
whole-prompt prefill, in a suffix chunk after a cache hit, or as one decode token, in bfloat16
on a GPU and on the CPU (in float32 the CPU's GEMMs round a row differently by row count, so
the mode does not make float32 CPU runs exact). Elementwise ops are invariant by nature; the
reductions are what this module makes invariant:

- a step on CUDA gets at least `GEMM_MIN_ROWS` rows (`step_padding`; `linear` for a product
  outside it): cuBLAS picks other kernels (other reduction orders) for fewer rows, and rounds a
  row alike for any count above;
- `rms_norm` sums the squares by a fixed pairwise tree of elementwise adds, so a row's sum does
  not depend on how many rows the reduction kernel sees;
- `attend` computes every query over keys in fixed blocks aligned at absolute positions, in the
  same order whatever the chunk: on CUDA in half precision, FlashAttention 2 (bottom-right causal)
  with at least `flash_rows` query rows, so that its split-KV path (taken for few queries) is never
  used; elsewhere, a plain online softmax in float32 over `KV_BLOCK`-key blocks.

docs/decisions/exact-mode.md records what differed, on which device, and what the mode costs.
"""

from __future__ import annotations

import math

import torch

KV_BLOCK = 256
"""Keys per block of the plain online softmax (blocks start at multiples of it)."""

Q_TILE = 16
"""Queries per matrix product of the plain online softmax."""

GEMM_MIN_ROWS = 256
"""Rows below which a CUDA step is padded (on an H100, bf16 products of Llama-3-8B's shapes
rounded a row differently for up to 240 rows, alike from 241 to 8,191; other shapes may need
more: bench/exact.py measures it)."""

_SPLIT_FREE_SHARE = 1.6
"""FlashAttention 2 runs without splitting the keys once heads x 64-row query blocks reach this
share of the multiprocessors (its ``num_splits_heuristic``: 0.8 of twice their number)."""

PADDED_DEVICES = ("cuda",)
"""Device types whose products get `GEMM_MIN_ROWS` rows (the CPU's bfloat16 products round a
row alike for any count)."""


def step_padding(rows: int, device: torch.device) -> int:
    """Rows to add to a step of `rows` rows on `device` so that its products have enough."""
    return max(0, GEMM_MIN_ROWS - rows) if device.type in PADDED_DEVICES else 0


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` with `step_padding` zero rows added (their results dropped)."""
    n, pad = x.shape[0], step_padding(x.shape[0], x.device)
    if not pad:
        return torch.nn.functional.linear(x, w, b)
    padded = torch.cat((x, x.new_zeros(pad, *x.shape[1:])))
    return torch.nn.functional.linear(padded, w, b)[:n]


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, as transformers computes it (float32, then cast), with the mean
    of squares summed by `tree_sum`."""
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


def flash_rows(heads: int, device: torch.device) -> int:
    """Query rows from which FlashAttention 2 keeps every key block of a head in one pass."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return 64 * math.ceil(_SPLIT_FREE_SHARE * sms / heads)


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
    ``[E, H, D]`` at positions ``kpos0 ..`` (the last key is the last query's position); with
    `window`, a query sees only its last `window` positions. Returns ``[L, H, D]`` in q's dtype."""
    L, E = q.shape[0], keys.shape[0]
    if kpos0 + E != qpos0 + L:
        raise ValueError(f"keys end at {kpos0 + E}, queries at {qpos0 + L}")
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and window is None and kpos0 == 0:
        return _flash(q, keys, vals, scale)
    return _blocked(q, keys, vals, qpos0, kpos0, scale, window)


def _flash(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, scale: float) -> torch.Tensor:
    L, H, D = q.shape
    rows = max(L, flash_rows(H, q.device))
    if rows > L:  # unused queries in front: bottom-right alignment keeps the real ones in place
        q = torch.cat((q.new_zeros(rows - L, H, D), q))
    qt, kt, vt = (t.transpose(0, 1)[None] for t in (q, keys, vals))
    out = torch.ops.aten._scaled_dot_product_flash_attention(
        qt, kt, vt, 0.0, True, False, scale=scale
    )[0]
    return out[0, :, rows - L :].transpose(0, 1)


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
