"""A decoder-only transformer (Llama / Qwen3) in plain torch, reading and writing a `KVMemory`.

`Transformer.forward(items, memory)` runs one engine step: every item is a run of consecutive tokens
of one sequence starting at position ``start`` (a prefill chunk or one decode token). Projections
and MLPs run on all tokens of the step at once; attention runs per item against that sequence's
pages (full layers) or ring (sliding layers). The arithmetic mirrors transformers' modeling code op
for op (RMSNorm in float32, RoPE tables in float32 cast to the model dtype, SDPA). With `exact`,
matrix products, RMSNorm and attention are those of `hicache.tools.refengine.exact`: a token's
results then do not depend on how its sequence was chunked or batched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from hicache.tools.refengine import exact as exact_ops
from hicache.tools.refengine.config import ModelConfig
from hicache.tools.refengine.memory import KVMemory


@dataclass
class Item:
    """One sequence's tokens in a step."""

    tokens: list[int]
    start: int  # position of tokens[0]
    table: torch.Tensor  # the sequence's block ids (int64, on the model's device)
    slot: int | None  # its state slot (models with sliding layers)
    loading: Any = None  # a layer-wise load this item's pages come from (``wait_layer(i)``)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    sc = cfg.rope_scaling
    if not sc or sc.get("rope_type", "default") == "default":
        return inv
    # llama3: long wavelengths slowed by `factor`, a smooth ramp in between.
    factor = float(sc["factor"])
    low, high = float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
    old = float(sc["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) * ~(wavelen > old / low)
    return torch.where(medium, smoothed, scaled)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Transformer:
    """Weights as a flat dict named like Hugging Face checkpoints (``model.layers.0...``)."""

    def __init__(
        self, cfg: ModelConfig, weights: dict[str, torch.Tensor], exact: bool = False
    ) -> None:
        self.cfg = cfg
        self.exact = exact  # chunk- and batch-invariant products, norms, attention (module doc)
        self.w = weights
        first = weights["model.embed_tokens.weight"]
        self.device, self.dtype = first.device, first.dtype
        self.inv_freq = rope_inv_freq(cfg).to(self.device)
        self.lm_head = weights.get("lm_head.weight", first)

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def random(
        cls,
        cfg: ModelConfig,
        seed: int = 0,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> Transformer:
        """Random weights (normal, std = initializer_range; norms at 1), generated on `device`."""
        gen = torch.Generator(device=device).manual_seed(seed)
        w: dict[str, torch.Tensor] = {}

        def normal(*shape: int) -> torch.Tensor:
            t = torch.empty(shape, dtype=dtype, device=device)
            return t.normal_(0.0, cfg.initializer_range, generator=gen)

        for name, shape in _shapes(cfg).items():
            if name.endswith("norm.weight"):
                w[name] = torch.ones(shape, dtype=dtype, device=device)
            elif name.endswith(".bias"):
                w[name] = torch.zeros(shape, dtype=dtype, device=device)
            else:
                w[name] = normal(*shape)
        return cls(cfg, w)

    @classmethod
    def load(
        cls,
        cfg: ModelConfig,
        folder: str | Path,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> Transformer:
        """Load ``*.safetensors`` from a Hugging Face-style folder."""
        from safetensors.torch import load_file

        files = sorted(Path(folder).glob("*.safetensors"))
        if not files:
            raise ValueError(f"{folder}: no .safetensors files")
        w: dict[str, torch.Tensor] = {}
        for f in files:
            for name, t in load_file(str(f), device="cpu").items():
                w[name] = t.to(device=device, dtype=dtype)
        missing = sorted(set(_shapes(cfg)) - set(w))
        if missing:
            raise ValueError(f"{folder}: missing weights {missing[:4]}")
        return cls(cfg, w)

    # -- forward ------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, items: list[Item], memory: KVMemory) -> torch.Tensor:
        """Run one step; return float32 logits ``[len(items), vocab]`` of each item's last token.

        Writes every token's K/V into the item's blocks (full layers) and ring (sliding layers)
        and advances ``memory.slot_len`` of the items' slots.
        """
        cfg, w, dev = self.cfg, self.w, self.device
        lens = [len(it.tokens) for it in items]
        T = sum(lens)
        ids = torch.tensor([t for it in items for t in it.tokens], device=dev)
        spans = [torch.arange(it.start, it.start + n) for it, n in zip(items, lens)]
        pos_d = torch.cat(spans).to(dev)
        P = memory.page_tokens
        blocks = torch.cat([it.table[(span // P).to(dev)] for it, span in zip(items, spans)])
        offsets = pos_d % P
        freqs = pos_d[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos().to(self.dtype)[:, None, :]
        sin = emb.sin().to(self.dtype)[:, None, :]

        H, Hk, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        norm = exact_ops.rms_norm if self.exact else rms_norm
        h = F.embedding(ids, w["model.embed_tokens.weight"])
        loads = [it.loading for it in items if it.loading is not None]
        for layer in range(cfg.num_layers):
            p = f"model.layers.{layer}."
            if loads and layer in memory.full_index:  # the pool holds full layers only
                for load in loads:
                    load.wait_layer(memory.full_index[layer])  # the stream waits, not the host
            x = norm(h, w[p + "input_layernorm.weight"], cfg.rms_norm_eps)
            q = self._lin(x, p + "self_attn.q_proj").view(T, H, D)
            k = self._lin(x, p + "self_attn.k_proj").view(T, Hk, D)
            v = self._lin(x, p + "self_attn.v_proj").view(T, Hk, D)
            if cfg.qk_norm:
                q = norm(q, w[p + "self_attn.q_norm.weight"], cfg.rms_norm_eps)
                k = norm(k, w[p + "self_attn.k_norm.weight"], cfg.rms_norm_eps)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            if layer in memory.full_index:
                memory.write_full(layer, blocks, offsets, k, v)
            outs = []
            for it, qi, ki, vi in zip(items, q.split(lens), k.split(lens), v.split(lens)):
                outs.append(self._attend(layer, it, qi, ki, vi, memory))
            o = torch.cat(outs).reshape(T, H * D)
            h = h + self._lin(o, p + "self_attn.o_proj")
            x = norm(h, w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
            gate = F.silu(self._lin(x, p + "mlp.gate_proj"))
            h = h + self._lin(gate * self._lin(x, p + "mlp.up_proj"), p + "mlp.down_proj")
        for it, n in zip(items, lens):
            if it.slot is not None:
                memory.slot_len[it.slot] = it.start + n
        last = torch.tensor([sum(lens[: i + 1]) - 1 for i in range(len(lens))], device=dev)
        hl = norm(h[last], w["model.norm.weight"], cfg.rms_norm_eps)
        linear = exact_ops.linear if self.exact else F.linear
        return linear(hl, self.lm_head).float()

    def _lin(self, x: torch.Tensor, name: str) -> torch.Tensor:
        linear = exact_ops.linear if self.exact else F.linear
        return linear(x, self.w[name + ".weight"], self.w.get(name + ".bias"))

    def _attend(
        self,
        layer: int,
        it: Item,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        memory: KVMemory,
    ) -> torch.Tensor:
        """Attention of one item's queries ``[L, H, D]``; returns ``[L, H, D]``."""
        L, s = q.shape[0], it.start
        if layer in memory.full_index:
            keys, vals = memory.read_full(layer, it.table, s + L)
            mask = causal_lower_right(L, s + L) if L > 1 else None
        else:
            if it.slot is None:
                raise ValueError("a model with sliding layers needs a state slot per sequence")
            first = max(0, s - (memory.window - 1))
            pk, pv = memory.read_ring(layer, it.slot, first, s)
            keys, vals = torch.cat((pk, k)), torch.cat((pv, v))
            memory.write_ring(layer, it.slot, s, k, v)
            qpos = torch.arange(s, s + L, device=q.device)[:, None]
            kpos = torch.arange(first, s + L, device=q.device)[None, :]
            mask = (kpos <= qpos) & (kpos > qpos - memory.window)
        rep = self.cfg.num_heads // self.cfg.num_kv_heads
        scale = self.cfg.head_dim**-0.5
        if self.exact:
            window = None if layer in memory.full_index else memory.window
            return exact_ops.attend(q, keys, vals, s, s + L - keys.shape[0], scale, window)
        qt = q.transpose(0, 1)[None]
        kt = keys.transpose(0, 1).repeat_interleave(rep, dim=0)[None]
        vt = vals.transpose(0, 1).repeat_interleave(rep, dim=0)[None]
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale)
        return out[0].transpose(0, 1)


def _shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight's name and shape, Hugging Face naming."""
    hid, H, Hk, D, inter = (
        cfg.hidden_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.intermediate_size,
    )
    s: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, hid)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        s[p + "input_layernorm.weight"] = (hid,)
        s[p + "post_attention_layernorm.weight"] = (hid,)
        for proj, out_dim in (("q", H * D), ("k", Hk * D), ("v", Hk * D)):
            s[p + f"self_attn.{proj}_proj.weight"] = (out_dim, hid)
            if cfg.attention_bias:
                s[p + f"self_attn.{proj}_proj.bias"] = (out_dim,)
        s[p + "self_attn.o_proj.weight"] = (hid, H * D)
        if cfg.attention_bias:
            s[p + "self_attn.o_proj.bias"] = (hid,)
        if cfg.qk_norm:
            s[p + "self_attn.q_norm.weight"] = (D,)
            s[p + "self_attn.k_norm.weight"] = (D,)
        s[p + "mlp.gate_proj.weight"] = (inter, hid)
        s[p + "mlp.up_proj.weight"] = (inter, hid)
        s[p + "mlp.down_proj.weight"] = (hid, inter)
        if cfg.mlp_bias:
            for n, dim in (("gate", inter), ("up", inter), ("down", hid)):
                s[p + f"mlp.{n}_proj.bias"] = (dim,)
    s["model.norm.weight"] = (hid,)
    if not cfg.tie_word_embeddings:
        s["lm_head.weight"] = (cfg.vocab_size, hid)
    return s
