"""The identity of the pages under SGLang (`hicache.core.identity.Identity`), from what SGLang
publishes of its settings (its runtime context) and the host pool it hands the backend.

SGLang keeps every fp8 KV cache in uint8 pools: the format comes from its ``--kv-cache-dtype``.
A controller made outside a server (no settings published) is keyed by its pool alone, and one
whose pool is uint8 is refused at start: its format cannot be told. SGLang keys each request's
LoRA adapter and cache salt itself (its storage chains are seeded by them), so neither is an
instance field here. SGLang's weight version (``weight_version``, set by its update-weights
calls) is the identity's `weights_version` where the extra config gives none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hicache.core.identity import Identity, current_device_class, unknown_setting
from hicache.core.weights import file_digest, weights_digest

MODEL_FIELDS = ("revision", "json_model_override_args", "load_format", "model_impl")
"""SGLang's model settings that change the model it builds (its `config`, beside config.json)."""
QUANT_FIELDS = ("quantization", "modelopt_quant", "rl_quant_profile")
"""SGLang's settings of the weights' quantization."""


def published(name: str) -> Any:
    """SGLang's published setting `name`; KeyError where SGLang published no settings (a
    controller made outside a server) or has no such setting."""
    try:
        from sglang.srt.runtime_context import get_context

        return get_context().config_leaf(name)
    except (ImportError, ValueError, AttributeError) as err:
        raise KeyError(name) from err


def weight_version() -> str | None:
    """SGLang's published weight version (None where SGLang published no settings)."""
    try:
        from sglang.srt.runtime_context import get_serving

        return str(get_serving().weight_version or "")
    except (ImportError, ValueError, AttributeError):
        return None


def sglang_identity(
    model_name: str,
    settings: Any,
    pool_dtype: str,
    pool_layout: str,
    shard: str,
) -> Identity:
    """The identity of SGLang's pages: `settings` (`Settings`: `model_id`, `weights_version`)
    over SGLang's `model_name`, its published settings, the host pool's storage dtype
    (`pool_dtype`) and layout (`pool_layout`) and this rank's `shard`. ValueError (one line)
    where the KV format cannot be told."""
    name = settings.model_id or model_name
    if not name:
        raise ValueError('SGLang gave no model name: give "model_id" in the extra config')
    try:
        kv = str(published("kv_cache_dtype"))
    except KeyError:
        kv = None
    if kv is None and pool_dtype == "uint8":
        raise unknown_setting(
            "SGLang", "kv_cache_dtype", "unpublished", "its pool stores uint8 (an fp8 format) "
            "and SGLang published no --kv-cache-dtype to tell e4m3 from e5m2",
        )  # fmt: skip
    path = _get("model_path") or model_name
    folder = Path(str(path))
    scales = _get("quantization_param_path")
    return Identity(
        weights=name,
        weights_digest=weights_digest(folder) if folder.is_dir() else "",
        weights_version=settings.weights_version or weight_version() or "",
        config={
            "config.json": _text(folder / "config.json"),
            **{f: _get(f) for f in MODEL_FIELDS},
        },
        compute_dtype=str(_get("dtype")),
        kv_format=f"{kv or 'auto'}:{pool_dtype}|scales={_scales(scales)}",
        quantization="|".join(str(_get(f)) for f in QUANT_FIELDS),
        attention=pool_layout,
        shard=shard,
        arithmetic=f"deterministic={_get('enable_deterministic_inference')}|{current_device_class()}",
    )


def _get(name: str) -> Any:
    try:
        return published(name)
    except KeyError:
        return None


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _scales(path: Any) -> str:
    """The KV scales' file (``--quantization-param-path``) by content; '' where none."""
    if not path:
        return ""
    return f"{path}:{file_digest(path)}" if Path(str(path)).is_file() else str(path)
