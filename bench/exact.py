"""What makes a token's bits depend on how its prompt was chunked, and what the exact mode costs.

    python bench/exact.py --parts kernel_cost,gemm_rows,cost --contexts 2048,32768 \
        --json bench/results/exact_h100.json

On a GPU, Llama-3-8B's shapes in bfloat16 (random weights):

- ``gemm_rows``: for each projection's shape, the largest difference between the rows of an
  M-row product and the same rows of the 8,192-row product, over M from 1 to 8,191, and the M
  for which a row differed: cuBLAS (``F.linear``) and the exact mode's product;
- ``rms_rows``: the same for RMSNorm, as transformers computes it and as the exact mode does;
- ``attention``: the largest difference between the queries of a chunk (L queries ending at
  position E, keys 0..E) and the same queries in one causal pass over all positions, for
  SDPA as the engine calls it, FlashAttention 2 on the chunk's queries alone, and the exact
  mode's attention;
- ``kernel_cost``: the exact mode's kernels against cuBLAS, SDPA and transformers' RMSNorm,
  one call each at the model's shapes (CUDA events);
- ``model``: the largest difference in the last token's logits and in the K/V between a prompt
  prefilled whole and prefilled in chunks (a suffix, decode-sized steps), mode off and on;
- ``cost``: prefill tokens per second and decode step times, mode off and on, at a few context
  lengths (median of `--repeats`, after one warm-up).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import command, commit, cpu_model
from hicache.tools.refengine import exact
from hicache.tools.refengine.config import resolve
from hicache.tools.refengine.memory import KVMemory
from hicache.tools.refengine.model import Item, Transformer, rms_norm

ROWS = [
    *range(1, 17),
    31,
    64,
    100,
    112,
    128,
    129,
    160,
    192,
    200,
    224,
    *range(240, 300),
    *range(300, 8192, 97),
    8191,
]
PAGE = 128


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def gemm_rows(cfg, gen: torch.Generator) -> dict[str, dict]:
    hid, inter, H, Hk, D = (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
    )
    shapes = {
        "q_proj": (hid, H * D),
        "k_proj": (hid, Hk * D),
        "o_proj": (H * D, hid),
        "gate_proj": (hid, inter),
        "down_proj": (inter, hid),
        "lm_head": (hid, cfg.vocab_size),
    }
    out = {}
    for name, (k, n) in shapes.items():
        x = torch.randn(8192, k, device="cuda", generator=gen).bfloat16()
        w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).bfloat16()
        for way, fn in (("cublas", F.linear), ("exact", exact.linear)):
            full = fn(x, w)
            diffs = {m: _diff(fn(x[:m], w), full[:m]) for m in ROWS}
            out[f"{name}_{way}"] = {
                "max": max(diffs.values()),
                "rows_that_differ": [m for m, d in diffs.items() if d],
            }
        del x, w, full
    return out


def _kernel_time(fn, repeats: int = 20) -> float:
    """Median seconds of `fn` over `repeats` calls timed with CUDA events, after a warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def kernel_cost(cfg, gen: torch.Generator) -> dict[str, dict]:
    """The exact mode's kernels against what the engine calls without it, one call each: the
    products at the model's shapes for a few row counts (cuBLAS), attention of a decode token
    and of a 512-token suffix after a long context (SDPA), RMSNorm (as transformers does it)."""
    hid, inter, H, Hk, D = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads,
                            cfg.num_kv_heads, cfg.head_dim)  # fmt: skip
    res: dict[str, dict] = {}
    shapes = {"qkv": (hid, (H + 2 * Hk) * D), "o_proj": (H * D, hid),
              "gate_up": (hid, 2 * inter), "down_proj": (inter, hid)}  # fmt: skip
    for name, (k, n) in shapes.items():
        w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).bfloat16()
        for m in (1, 16, 512, 8192):
            x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
            base = _kernel_time(functools.partial(F.linear, x, w))
            ours = _kernel_time(functools.partial(exact.linear, x, w))
            res[f"{name}_m{m}"] = {"cublas_s": base, "exact_s": ours, "ratio": ours / base}
    scale = D**-0.5
    for ctx in (2048, 32768):
        k = torch.randn(ctx + 512, Hk, D, device="cuda", generator=gen).bfloat16()
        q = torch.randn(512, H, D, device="cuda", generator=gen).bfloat16()
        for L in (1, 512):
            qs, keys = q[:L], k[: ctx + L]
            kr = keys.repeat_interleave(H // Hk, 1)
            base = _kernel_time(functools.partial(_sdpa, qs, kr, kr, scale))
            ours = _kernel_time(functools.partial(exact.attend, qs, keys, keys, ctx, 0, scale))
            row = {"sdpa_s": base, "exact_s": ours, "ratio": ours / base}
            res[f"attention_L{L}_ctx{ctx}"] = row
    x = torch.randn(512, hid, device="cuda", generator=gen).bfloat16()
    w = torch.ones(hid, device="cuda", dtype=torch.bfloat16)
    for m in (1, 512):
        base = _kernel_time(functools.partial(rms_norm, x[:m], w, 1e-5))
        ours = _kernel_time(functools.partial(exact.rms_norm, x[:m], w, 1e-5))
        res[f"rms_norm_m{m}"] = {"torch_s": base, "exact_s": ours, "ratio": ours / base}
    return res


def rms_rows(cfg, gen: torch.Generator) -> dict[str, float]:
    x = torch.randn(8192, cfg.hidden_size, device="cuda", generator=gen).bfloat16()
    w = torch.ones(cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    res = {}
    for name, fn in (("transformers", rms_norm), ("exact", exact.rms_norm)):
        full = fn(x, w, 1e-5)
        res[name] = max(_diff(fn(x[:m], w, 1e-5), full[:m]) for m in ROWS)
    return res


def _sdpa(q, k, v, scale):
    """The engine's attention without the mode: SDPA, bottom-right causal (none for one query)."""
    L, E = q.shape[0], k.shape[0]
    mask = causal_lower_right(L, E) if L > 1 else None
    qt, kt, vt = (t.transpose(0, 1)[None] for t in (q, k, v))
    return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale)[0].transpose(
        0, 1
    )


def _flash(q, k, v, scale):
    """FlashAttention 2 (bottom-right causal) on the chunk's queries alone."""
    qt, kt, vt = (t.transpose(0, 1)[None] for t in (q, k, v))
    out = torch.ops.aten._scaled_dot_product_flash_attention(
        qt, kt, vt, 0.0, True, False, scale=scale
    )
    return out[0][0].transpose(0, 1)


def attention(cfg, gen: torch.Generator, n: int = 4096) -> dict[str, dict]:
    H, D = cfg.num_heads, cfg.head_dim
    q, k, v = (torch.randn(n, H, D, device="cuda", generator=gen).bfloat16() for _ in range(3))
    scale = D**-0.5
    ways = {
        "sdpa": lambda q, k, v, s: _sdpa(q, k, v, scale),
        "flash": lambda q, k, v, s: _flash(q, k, v, scale),
        "exact": lambda q, k, v, s: exact.attend(q, k, v, s, 0, scale),
    }
    res = {}
    for name, fn in ways.items():
        full = fn(q, k, v, 0)
        cases = {}
        for end in (n, 3000, 1000):
            for L in (1, 2, 16, 112, 256, 384, 447, 448, 449, 512, 1000):
                s = end - L
                cases[f"L{L}_end{end}"] = _diff(fn(q[s:end], k[:end], v[:end], s), full[s:end])
        res[name] = {"max": max(cases.values()), "cases": cases}
    return res


def _prefill(model, tokens, chunks, mem=None):
    cfg = model.cfg
    pages = -(-len(tokens) // PAGE)
    mem = mem or KVMemory(cfg, pages + 1, PAGE, num_slots=1, device="cuda", dtype=model.dtype)
    table = torch.arange(pages, device="cuda")
    start = 0
    for c in chunks:
        logits = model.forward([Item(tokens[start : start + c], start, table, None)], mem)
        start += c
    return logits, mem.pool[:pages]


def model_diffs(model, n: int = 2048) -> dict[str, dict]:
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model.cfg.vocab_size, (n,), generator=gen).tolist()
    res = {}
    for mode in (False, True):
        model.exact = mode
        whole_logits, whole_kv = _prefill(model, tokens, [n])
        whole_kv = whole_kv.clone()
        cases = {}
        for name, chunks in (
            ("suffix_112", [n - 112, 112]),
            ("suffix_512", [n - 512, 512]),
            ("decode_8", [n - 8] + [1] * 8),
            ("chunks_600", [600, 600, 600, n - 1800]),
        ):
            logits, kv = _prefill(model, tokens, chunks)
            cases[name] = {"logits": _diff(logits, whole_logits), "kv": _diff(kv, whole_kv)}
        res["exact" if mode else "off"] = cases
    return res


def _timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def cost(model, repeats: int, contexts: list[int]) -> list[dict]:
    """Per context length C: a whole prefill of C tokens, a 512-token suffix after C, one decode
    token after C; seconds and tokens per second, mode off and on."""
    rows = []
    for ctx in contexts:
        rows.append(_cost_row(model, repeats, ctx))
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    return rows


def _cost_row(model, repeats: int, ctx: int) -> dict:
    cfg, total = model.cfg, ctx + 512
    pages = -(-total // PAGE)
    mem = KVMemory(cfg, pages + 1, PAGE, num_slots=1, device="cuda", dtype=model.dtype)
    table = torch.arange(pages, device="cuda")
    tokens = torch.randint(0, cfg.vocab_size, (total,)).tolist()
    cases = {  # name: (tokens computed, the step's items)
        "prefill": (ctx, [Item(tokens[:ctx], 0, table, None)]),
        "suffix_512": (512, [Item(tokens[ctx:total], ctx, table, None)]),
        "decode": (1, [Item(tokens[ctx : ctx + 1], ctx, table, None)]),
    }
    row: dict = {"context": ctx}
    for mode in (False, True):
        model.exact = mode
        tag = "exact" if mode else "off"
        for name, (n, items) in cases.items():  # the prefill first: the others read its K/V
            s = _timed(functools.partial(model.forward, items, mem), repeats)
            row[f"{name}_{tag}_s"] = s
            row[f"{name}_{tag}_tok_s"] = n / s
    for name in cases:
        row[f"{name}_cost"] = row[f"{name}_exact_s"] / row[f"{name}_off_s"] - 1
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="llama-8b")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--contexts", default="2048,8192,32768")
    p.add_argument("--parts", default="gemm_rows,rms_rows,attention,kernel_cost,model,cost")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench/exact.py needs a CUDA GPU", file=sys.stderr)
        return 2
    cfg, _ = resolve(args.model)
    gen = torch.Generator(device="cuda").manual_seed(0)
    res: dict = {
        "commit": commit(),
        "machine": f"{torch.cuda.get_device_name()}, {cpu_model()}",
        "command": command(),
        "torch": torch.__version__,
        "model": args.model,
    }
    parts = args.parts.split(",")
    for name, fn in (
        ("gemm_rows", gemm_rows),
        ("rms_rows", rms_rows),
        ("attention", attention),
        ("kernel_cost", kernel_cost),
    ):
        if name in parts:
            res[name] = fn(cfg, gen)
            print(name, json.dumps(res[name]), flush=True)
            torch.cuda.empty_cache()
    model = Transformer.random(cfg, seed=0, device="cuda", dtype=torch.bfloat16)
    if "model" in parts:
        res["model"] = model_diffs(model)
        print("model", json.dumps(res["model"]), flush=True)
    if "cost" in parts:
        res["cost"] = cost(model, args.repeats, [int(c) for c in args.contexts.split(",")])
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
