"""Putting an engine together: model, KV memory and (optionally) hicache.

hicache is reached only through its public API (`hicache.HiCache`, `Layout`, `PagedBuffer`,
`load_config`), imported only when a cache is asked for, and the identity of the pages
(`hicache.core.identity`, `hicache.core.weights`: what decides a page's bytes, the fingerprint's
input).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hicache.core.identity import Identity, device_class
from hicache.core.weights import weights_digest
from hicache.tools.refengine.config import ModelConfig, resolve
from hicache.tools.refengine.engine import Engine
from hicache.tools.refengine.memory import KVMemory, RingStates
from hicache.tools.refengine.model import Transformer
from hicache.tools.refengine.prefix import PrefixCache

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineSpec:
    """How to build one engine. `model` is a folder with config.json or a named shape."""

    model: str = "tiny-llama"
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0  # random weights of a named shape
    page_tokens: int = 32
    num_blocks: int = 512
    num_slots: int = 16
    chunk_tokens: int = 512
    state_boundaries: int = 2
    by_layer: bool = False  # load hits layer by layer under the prefill (needs a cache)
    partial: bool = False  # let the cache plan partial fetches from its store tiers
    # The engine's own GPU prefix cache (`hicache.tools.refengine.prefix`): at most this share of
    # the pool's blocks kept for prefix hits, or `prefix_blocks` blocks where given; 0 turns it
    # off. Off for models with sliding-window layers, whatever is asked.
    prefix_share: float = 1.0
    prefix_blocks: int | None = None
    # The model's exact mode (`hicache.tools.refengine.exact`): a token's results do not depend on
    # how its sequence was chunked or batched, so runs with and without a cache agree bit for bit.
    exact: bool = False
    # Bump it where the weights change in place (they are named by content too): pages of
    # another version are never served (`hicache.core.identity`).
    weights_version: str = ""

    @property
    def prefix_cache_blocks(self) -> int:
        """Blocks the GPU prefix cache may keep (0: it is off)."""
        if not 0.0 <= self.prefix_share <= 1.0:
            raise ValueError(f"prefix_share must be in [0, 1], got {self.prefix_share}")
        if self.prefix_blocks is not None:
            if not 0 <= self.prefix_blocks <= self.num_blocks:
                raise ValueError(f"prefix_blocks must be in [0, {self.num_blocks}]")
            return self.prefix_blocks
        return int(self.prefix_share * self.num_blocks)


def load_model(spec: EngineSpec) -> tuple[Transformer, str]:
    """The model and the name of its weights (`Identity.weights`): a named shape and its seed,
    or a folder's name (`engine_identity` adds the digest of the folder's weight files)."""
    if spec.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {spec.dtype!r}")
    cfg, folder = resolve(spec.model)
    dtype = DTYPES[spec.dtype]
    if folder is None:
        model = Transformer.random(cfg, seed=spec.seed, device=spec.device, dtype=dtype)
        model.exact = spec.exact
        return model, f"{cfg.name}@random-seed{spec.seed}"
    model = Transformer.load(cfg, folder, device=spec.device, dtype=dtype)
    model.exact = spec.exact
    return model, Path(folder).resolve().name


def engine_identity(spec: EngineSpec, model: Transformer, weights: str) -> Identity:
    """The reference engine's `Identity`: the weights (`weights`, `load_model`'s name; a
    folder's weight files by content; `spec.weights_version`), the model's config, dtype
    (its KV's too), attention and RoPE, its exact mode and the device class it runs on."""
    cfg = model.cfg
    folder = resolve(spec.model)[1]
    dtype = str(model.dtype).removeprefix("torch.")
    return Identity(
        weights=weights,
        weights_digest=weights_digest(folder) if folder is not None else "",
        weights_version=spec.weights_version,
        config=cfg.hf or cfg.to_hf(),
        compute_dtype=dtype,
        kv_format=dtype,
        attention=_attention(cfg),
        position={"rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling},
        shard="tp0/1",
        arithmetic=f"{'exact' if model.exact else 'batched'}|{device_class(model.device)}",
    )


def _attention(cfg: ModelConfig) -> dict[str, Any]:
    """The attention's kind and geometry, and the pool's order (page-first)."""
    return {
        "family": cfg.family, "layers": list(cfg.layer_types), "heads": cfg.num_heads,
        "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "window": cfg.sliding_window,
        "pool": "page-first",
    }  # fmt: skip


def make_cache(
    config: Any, memory: KVMemory, model_id: str, wait_ready_s: float | None = 120.0
) -> Any:
    """A `hicache.HiCache` over `memory`'s pool (and rings, through `RingStates`).

    `config` is a `HiCacheConfig`, a YAML path, or a mapping. The layout is the engine's own:
    the config's layout section, if any, is ignored. hicache allocates its host pools in the
    background and stores nothing until they exist; with `wait_ready_s` (tests and benchmarks,
    which want the steady state) this waits up to that long for them, None does not wait.
    """
    import hicache

    if not isinstance(config, hicache.HiCacheConfig):
        config = hicache.load_config(config)
    states = RingStates(memory) if memory.rings is not None else None
    pool = memory.pool
    layout = hicache.Layout(
        model=model_id,
        kv_dtype=str(memory.dtype).removeprefix("torch."),
        page_tokens=memory.page_tokens,
        page_bytes=pool[0].numel() * pool.element_size(),
        state_bytes=states.state_bytes if states is not None else 0,
    )
    gpu = hicache.PagedBuffer.page_first(pool)
    layers = len(memory.full_index)  # a page holds the full layers, one after another
    cache = hicache.HiCache(config, gpu, layout=layout, states=states, layers=layers)
    if wait_ready_s is not None and not cache.wait_ready(wait_ready_s):
        cache.close()
        raise RuntimeError(f"hicache was not ready (host pools, L3 store) within {wait_ready_s} s")
    return cache


def build_engine(
    spec: EngineSpec, cache_config: Any = None, model: tuple[Transformer, str] | None = None
) -> Engine:
    """An engine per `spec`, with hicache embedded when `cache_config` is given.

    `model` reuses weights already loaded by `load_model` (the model and its weights' name).
    """
    model_obj, weights = model or load_model(spec)
    model_id = engine_identity(spec, model_obj, weights).name()
    memory = KVMemory(
        model_obj.cfg,
        num_blocks=spec.num_blocks,
        page_tokens=spec.page_tokens,
        num_slots=spec.num_slots,
        device=spec.device,
        dtype=DTYPES[spec.dtype],
        state_boundaries=spec.state_boundaries,
    )
    cache = make_cache(cache_config, memory, model_id) if cache_config is not None else None
    prefix_blocks = spec.prefix_cache_blocks if memory.rings is None else 0
    prefix = PrefixCache(spec.page_tokens, prefix_blocks) if prefix_blocks else None
    return Engine(
        model_obj,
        memory,
        chunk_tokens=spec.chunk_tokens,
        cache=cache,
        by_layer=spec.by_layer,
        partial=spec.partial,
        prefix=prefix,
    )
