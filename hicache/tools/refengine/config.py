"""Model shapes: parsed from a Hugging Face ``config.json`` or picked by name.

Two families are supported, Llama and Qwen3. Qwen3's sliding-window layers follow transformers'
semantics exactly:

- ``sliding_window`` counts only when ``use_sliding_window`` is true (else it is None);
- ``layer_types`` (``full_attention`` / ``sliding_attention`` per layer), when given, is used as is;
  when absent, layer ``i`` slides iff a window is set and ``i >= max_window_layers``;
- a sliding layer's query at position ``q`` sees the keys at positions ``q - W + 1 .. q``
  (``W = sliding_window``; transformers' ``kv_idx > q_idx - sliding_window``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

FULL = "full_attention"
SLIDING = "sliding_attention"


@dataclass(frozen=True)
class ModelConfig:
    """Everything the engine needs to build or load a decoder-only transformer."""

    family: str  # "llama" or "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    sliding_window: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    max_position_embeddings: int = 131072
    name: str = "custom"
    hf: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.family not in ("llama", "qwen3"):
            raise ValueError(f"family must be 'llama' or 'qwen3', got {self.family!r}")
        if len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers"
            )
        bad = sorted(set(self.layer_types) - {FULL, SLIDING})
        if bad:
            raise ValueError(f"layer_types: unknown layer type(s) {bad}")
        if SLIDING in self.layer_types and not self.sliding_window:
            raise ValueError(
                "layer_types has sliding_attention layers but no sliding_window is in effect "
                "(Qwen3 needs use_sliding_window: true and a sliding_window)"
            )
        if FULL not in self.layer_types:
            raise ValueError("the engine needs at least one full_attention layer")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"rope type {rope_type!r} is not supported (default, llama3)")

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == SLIDING)

    @property
    def qk_norm(self) -> bool:
        """Qwen3 normalises q and k per head before RoPE; Llama does not."""
        return self.family == "qwen3"

    # -- Hugging Face config.json ------------------------------------------------------------

    @classmethod
    def from_hf(cls, d: dict[str, Any], name: str = "custom") -> ModelConfig:
        """Parse a transformers config dict (``model_type`` llama or qwen3)."""
        family = d.get("model_type")
        if family not in ("llama", "qwen3"):
            raise ValueError(f"model_type must be 'llama' or 'qwen3', got {family!r}")
        n_layers = int(d["num_hidden_layers"])
        heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        window: int | None = None
        if family == "qwen3":
            window = d.get("sliding_window") if d.get("use_sliding_window") else None
            types = d.get("layer_types")
            if types is None:
                mwl = int(d.get("max_window_layers", 28))
                types = [
                    SLIDING if window is not None and i >= mwl else FULL for i in range(n_layers)
                ]
        else:
            types = d.get("layer_types") or [FULL] * n_layers
        rope = dict(d.get("rope_parameters") or {})
        if "rope_theta" not in rope:
            rope["rope_theta"] = d.get("rope_theta", 10000.0)
        legacy = d.get("rope_scaling")
        if legacy:
            rope = {**legacy, **rope}
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
        theta = float(rope.pop("rope_theta"))
        scaling = rope if rope.get("rope_type", "default") != "default" else None
        return cls(
            family=family,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=n_layers,
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            layer_types=tuple(types),
            sliding_window=int(window) if window else None,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            attention_bias=bool(d.get("attention_bias", False)),
            mlp_bias=bool(d.get("mlp_bias", False)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            initializer_range=float(d.get("initializer_range", 0.02)),
            max_position_embeddings=int(d.get("max_position_embeddings", 131072)),
            name=name,
            hf=dict(d),
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        path = Path(folder) / "config.json"
        try:
            data = json.loads(path.read_text())
        except OSError as err:
            raise ValueError(f"{path}: cannot read: {err.strerror}") from None
        return cls.from_hf(data, name=Path(folder).resolve().name)

    def to_hf(self) -> dict[str, Any]:
        """A transformers config dict for this shape (used to build reference models in tests)."""
        d: dict[str, Any] = {
            "model_type": self.family,
            "architectures": ["LlamaForCausalLM" if self.family == "llama" else "Qwen3ForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": self.rope_theta,
                **(self.rope_scaling or {}),
            },
            "attention_bias": self.attention_bias,
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": self.initializer_range,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
        }
        if self.family == "llama":
            d["mlp_bias"] = self.mlp_bias
        else:
            d["use_sliding_window"] = self.sliding_window is not None
            d["sliding_window"] = self.sliding_window
            d["layer_types"] = list(self.layer_types)
            d["max_window_layers"] = self.num_layers
        return d


def _llama(
    name: str,
    layers: int,
    hidden: int,
    inter: int,
    heads: int,
    kv: int,
    vocab: int,
    theta: float = 500000.0,
) -> ModelConfig:
    return ModelConfig(
        family="llama",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=hidden // heads,
        layer_types=(FULL,) * layers,
        rms_norm_eps=1e-5,
        rope_theta=theta,
        name=name,
    )


NAMED: dict[str, ModelConfig] = {
    # Llama-3-8B dimensions (random weights).
    "llama-8b": _llama("llama-8b", 32, 4096, 14336, 32, 8, 128256),
    "llama-1b": _llama("llama-1b", 16, 2048, 8192, 32, 8, 128256),
    # Small shapes for CPU runs.
    "small-llama": _llama("small-llama", 8, 512, 1536, 8, 2, 4096, theta=10000.0),
    "tiny-llama": _llama("tiny-llama", 4, 256, 768, 8, 2, 2048, theta=10000.0),
    "tiny-qwen3-swa": ModelConfig(
        family="qwen3",
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=768,
        num_layers=4,
        num_heads=8,
        num_kv_heads=2,
        head_dim=32,
        layer_types=("full_attention", "sliding_attention", "full_attention", "sliding_attention"),
        sliding_window=256,
        rope_theta=10000.0,
        name="tiny-qwen3-swa",
    ),
}


def resolve(model: str) -> tuple[ModelConfig, Path | None]:
    """A named shape (random weights, folder None) or a folder holding config.json."""
    if model in NAMED:
        return NAMED[model], None
    path = Path(model)
    if (path / "config.json").is_file():
        return ModelConfig.from_folder(path), path
    raise ValueError(
        f"--model {model!r} is neither a folder with config.json nor a named shape "
        f"({', '.join(sorted(NAMED))})"
    )


def with_overrides(cfg: ModelConfig, **changes: Any) -> ModelConfig:
    return replace(cfg, **changes)
