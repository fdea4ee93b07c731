"""Triton kernels whose result for one row does not depend on the other rows: the exact mode's
matrix product, RMSNorm and attention on CUDA, invariant by construction on any GPU.

Each output element is reduced by one program, in an order fixed by the kernel's code and by
the shapes of the weights, never by the number of rows:

- `matmul`: tiles of a size chosen from the weight's shape (`tiles`) and the whole K walked in
  `block_k` steps, in order, by the program that owns the output tile (no split over K, no
  choice made from M). A row's sums are the same whatever rows share its tile (rows are
  independent in a tile's product) and whatever tile it lands in.
- `rms_norm`: one program per row, its sum of squares a `tl.sum` over the whole row.
- `attention`: keys cut at absolute positions into `SPLIT`-key segments, and each segment into
  `BLOCK_N`-key blocks walked in order; a query's online softmax over a segment gives a partial
  (max, sum, output), and the partials are combined in segment order. Blocks and segments past
  a query (or outside its window) change its partials by exact no-ops (a weight of exactly
  zero, a rescale by exactly one), so a query's bits depend on its position and its keys only,
  not on how many queries share the step or where its chunk began.

The tile sizes are constants of the code (a function of the weight's shape and dtype), so the
same code gives the same bits on every GPU it compiles for; no per-device threshold.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

SPLIT = 4096
"""Keys per attention segment (segments start at multiples of it)."""

BLOCK_M = 64
"""Queries per attention tile (one tile shape for every chunk: the same instructions for all)."""

BLOCK_N = 64
"""Keys per attention block (blocks start at multiples of it; divides `SPLIT`)."""

_LOG2E = 1.4426950408889634

_PARTIAL_BYTES = 1 << 30
"""At most this many bytes of attention partials at once (queries are taken in chunks)."""


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.cache
def tiles(n: int, k: int, dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    """(block_m, block_n, block_k, warps, stages) for a product with an ``[n, k]`` weight: a
    function of the weight alone, so every row count gets the same reduction order."""
    if dtype == torch.float32:
        return 64, 64, 32, 4, 3
    return (128, 128, 64, 8, 3) if n >= 8192 else (128, 64, 64, 4, 4)


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, M, N, K,
    sxm, sxk, swn, swk, sym, syn,
    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    grid_m, grid_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    width = GROUP * grid_n
    first_m = (pid // width) * GROUP
    rows = min(grid_m - first_m, GROUP)
    pid_m = first_m + (pid % width) % rows
    pid_n = (pid % width) // rows
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    xs = x_ptr + rm[:, None] * sxm + rk[None, :] * sxk
    ws = w_ptr + rn[None, :] * swn + rk[:, None] * swk
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for i in range(0, tl.cdiv(K, BK)):
        k0 = i * BK
        a = tl.load(xs, mask=(rm[:, None] < M) & (rk[None, :] + k0 < K), other=0.0)
        b = tl.load(ws, mask=(rn[None, :] < N) & (rk[:, None] + k0 < K), other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        xs += BK * sxk
        ws += BK * swk
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    ys = y_ptr + rm[:, None] * sym + rn[None, :] * syn
    tl.store(ys, acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def matmul(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T + b`` (``F.linear``) for ``x [..., K]`` and ``w [N, K]``, a row's result
    independent of the other rows."""
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    M, N = x2.shape[0], w.shape[0]
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    if M:
        bm, bn, bk, warps, stages = tiles(N, K, w.dtype)
        grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
        _matmul_kernel[grid](
            x2, w, b if b is not None else w, y, M, N, K,
            x2.stride(0), x2.stride(1), w.stride(0), w.stride(1), y.stride(0), y.stride(1),
            HAS_BIAS=b is not None, PRECISION=_dot_precision(x.dtype),
            BM=bm, BN=bn, BK=bk, GROUP=8, num_warps=warps, num_stages=stages,
        )  # fmt: skip
    return y.view(*lead, N)


@triton.jit(do_not_specialize=["eps"])
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, D, sx, sy, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    live = cols < D
    h = tl.load(x_ptr + row * sx + cols, mask=live, other=0.0).to(tl.float32)
    ms = tl.sum(h * h, axis=0) / D
    normed = (h * tl.math.rsqrt(ms + eps)).to(y_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=live, other=0.0)
    y = (w.to(tl.float32) * normed.to(tl.float32)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * sy + cols, y, mask=live)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim as transformers computes it (float32, then cast, then the
    weight), one program per row."""
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, device=x.device, dtype=x.dtype)
    if x2.shape[0]:
        block = triton.next_power_of_2(D)
        warps = min(16, max(1, block // 256))
        _rms_norm_kernel[(x2.shape[0],)](
            x2, w, y, D, x2.stride(0), y.stride(0), eps, BLOCK=block, num_warps=warps
        )
    return y.view(x.shape)


@triton.jit(do_not_specialize=["L", "E", "qpos0", "kpos0", "seg0", "window"])
def _attend_partial_kernel(
    q_ptr, k_ptr, v_ptr, m_ptr, l_ptr, o_ptr,
    L, E, qpos0, kpos0, seg0, window, qk_scale,
    sqm, sqh, skm, skh, svm, svh, som, soh, sos, sms, smh,
    REP: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    SPLIT: tl.constexpr, WINDOWED: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One query tile of one head over one segment: the partial max (log2 units), sum and
    unnormalised output of each query's online softmax over the segment's keys."""
    tile, head, seg = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kv_head = head // REP
    rows = tile * BM + tl.arange(0, BM)
    qpos = qpos0 + rows
    d = tl.arange(0, D)
    q = tl.load(q_ptr + rows[:, None] * sqm + head * sqh + d[None, :], mask=rows[:, None] < L)
    lo = seg0 + seg * SPLIT  # the segment's absolute positions: [lo, lo + SPLIT)
    last = tl.minimum(qpos0 + tile * BM + BM - 1, qpos0 + L - 1)  # the tile's last query
    hi = tl.minimum(lo + SPLIT, last + 1)
    start = lo
    if WINDOWED:  # blocks wholly before every query's window are no-ops: skip them
        first = qpos0 + tile * BM - window + 1
        start = tl.maximum(lo, first - first % BN)
    m = tl.full((BM,), float("-inf"), dtype=tl.float32)
    total = tl.zeros((BM,), dtype=tl.float32)
    acc = tl.zeros((BM, D), dtype=tl.float32)
    kend = kpos0 + E
    for b in range(start, hi, BN):
        kpos = b + tl.arange(0, BN)
        have = (kpos >= kpos0) & (kpos < kend)
        idx = kpos - kpos0
        k = tl.load(k_ptr + idx[:, None] * skm + kv_head * skh + d[None, :],
                    mask=have[:, None], other=0.0)  # fmt: skip
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        seen = have[None, :] & (kpos[None, :] <= qpos[:, None])
        if WINDOWED:
            seen = seen & (kpos[None, :] > qpos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        live = m_new > float("-inf")
        alpha = tl.where(live, tl.math.exp2(m - m_new), 1.0)
        p = tl.where(live[:, None], tl.math.exp2(s - m_new[:, None]), 0.0)
        total = total * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + idx[:, None] * svm + kv_head * svh + d[None, :],
                    mask=have[:, None], other=0.0)  # fmt: skip
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    keep = rows < L
    tl.store(m_ptr + seg * sms + head * smh + rows, m, mask=keep)
    tl.store(l_ptr + seg * sms + head * smh + rows, total, mask=keep)
    out = o_ptr + seg * sos + rows[:, None] * som + head * soh + d[None, :]
    tl.store(out, acc, mask=keep[:, None])


@triton.jit(do_not_specialize=["L", "S"])
def _attend_combine_kernel(
    m_ptr, l_ptr, o_ptr, y_ptr, L, S,
    sms, smh, som, soh, sos, sym, syh,
    D: tl.constexpr, BM: tl.constexpr,
):  # fmt: skip
    """Each query's partials combined in segment order (empty segments add exact zeros)."""
    tile, head = tl.program_id(0), tl.program_id(1)
    rows = tile * BM + tl.arange(0, BM)
    keep = rows < L
    d = tl.arange(0, D)
    top = tl.full((BM,), float("-inf"), dtype=tl.float32)
    for s in range(0, S):
        top = tl.maximum(top, tl.load(m_ptr + s * sms + head * smh + rows, mask=keep,
                                      other=float("-inf")))  # fmt: skip
    total = tl.zeros((BM,), dtype=tl.float32)
    acc = tl.zeros((BM, D), dtype=tl.float32)
    for s in range(0, S):
        ms = tl.load(m_ptr + s * sms + head * smh + rows, mask=keep, other=float("-inf"))
        weight = tl.where(ms > float("-inf"), tl.math.exp2(ms - top), 0.0)
        total += weight * tl.load(l_ptr + s * sms + head * smh + rows, mask=keep, other=0.0)
        part = tl.load(o_ptr + s * sos + rows[:, None] * som + head * soh + d[None, :],
                       mask=keep[:, None], other=0.0)  # fmt: skip
        acc += weight[:, None] * part
    out = acc / total[:, None]
    tl.store(y_ptr + rows[:, None] * sym + head * syh + d[None, :],
             out.to(y_ptr.dtype.element_ty), mask=keep[:, None])  # fmt: skip


def attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    vals: torch.Tensor,
    qpos0: int,
    kpos0: int,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of ``q [L, H, D]`` at positions ``qpos0 ..`` over ``keys``/``vals``
    ``[E, Hk, D]`` at positions ``kpos0 ..`` (``H`` a multiple of ``Hk``: grouped queries read
    their group's keys); with `window`, a query sees its last `window` positions. Returns
    ``[L, H, D]`` in q's dtype; a query's bits depend on its position and keys alone."""
    L, H, D = q.shape
    E, Hk = keys.shape[0], keys.shape[1]
    if H % Hk or D & (D - 1) or D < 16:
        raise ValueError(f"attention: {H} heads over {Hk} K/V heads of width {D}")
    end = kpos0 + E
    seg0 = kpos0 - kpos0 % SPLIT
    segments = -(-(end - seg0) // SPLIT)
    bm = BLOCK_M
    y = torch.empty_like(q)
    chunk = max(bm, _PARTIAL_BYTES // (H * segments * (D + 2) * 4) // bm * bm)
    q, keys, vals = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, keys, vals))
    precision = _dot_precision(q.dtype)
    for c0 in range(0, L, chunk):
        n = min(chunk, L - c0)
        qc = q[c0 : c0 + n]
        ms = torch.empty(segments, H, n, device=q.device, dtype=torch.float32)
        ls = torch.empty_like(ms)
        os_ = torch.empty(segments, n, H, D, device=q.device, dtype=torch.float32)
        tiles_ = triton.cdiv(n, bm)
        _attend_partial_kernel[(tiles_, H, segments)](
            qc, keys, vals, ms, ls, os_,
            n, E, qpos0 + c0, kpos0, seg0, window or 0, scale * _LOG2E,
            qc.stride(0), qc.stride(1), keys.stride(0), keys.stride(1),
            vals.stride(0), vals.stride(1), os_.stride(1), os_.stride(2), os_.stride(0),
            ms.stride(0), ms.stride(1),
            REP=H // Hk, D=D, BM=bm, BN=BLOCK_N, SPLIT=SPLIT, WINDOWED=window is not None,
            PRECISION=precision, num_warps=4, num_stages=2,
        )  # fmt: skip
        yc = y[c0 : c0 + n]
        _attend_combine_kernel[(tiles_, H)](
            ms, ls, os_, yc, n, segments,
            ms.stride(0), ms.stride(1), os_.stride(1), os_.stride(2), os_.stride(0),
            yc.stride(0), yc.stride(1), D=D, BM=bm, num_warps=4,
        )  # fmt: skip
    return y
