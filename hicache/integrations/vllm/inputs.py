"""What names a vLLM request's pages beyond its token ids: the tenant salt, the LoRA adapter
and the multimodal inputs (vLLM's own block hash covers the same). Prompt embeddings are
refused at start (`refuse_unsupported`).

- `request_salt`: the request's `cache_salt` and its LoRA adapter (name and path, as vLLM's
  block hash has them; never vLLM's per-process adapter id) in one tagged, length-prefixed
  encoding (`hicache.core.keys.namespace`), hicache's salt: two adapters never share a page,
  nor two tenants, and no `cache_salt` can name an adapter's namespace.
- `keyed_tokens`: the token ids with each full page that a multimodal feature overlaps
  replaced by words drawn from the page's tokens and the whole content hash (vLLM's
  `identifier`) and position of every feature on it (`hicache.core.keys.fold_features`): two
  images behind the same placeholder ids give different pages from the first page that holds
  either, and the pages before the first image stay shared. A page of fewer than 5 tokens
  cannot carry 128 bits of a hash that way: with such pages the request's namespace takes its
  features' whole hashes and positions too (`with_features`), and shares no page with a
  request whose features differ.

Both are pure functions of the request's content, the same in every process and instance
(unlike vLLM's `block_hashes`, whose seed is per process unless PYTHONHASHSEED is set or the
hash is cryptographic).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hicache.config import ConfigError
from hicache.core.keys import features_salt, fold_features, namespace

if TYPE_CHECKING:
    from vllm.v1.request import Request


def refuse_unsupported(vllm_config: Any) -> None:
    """ConfigError (one line) for what the page keys cannot cover: prompt embeddings."""
    if getattr(vllm_config.model_config, "enable_prompt_embeds", False):
        raise ConfigError(
            "hicache: prompt embeddings (enable_prompt_embeds) are not supported: the page keys "
            "cover token ids, LoRA adapters and multimodal inputs only"
        )


def request_salt(request: Request) -> bytes | None:
    """hicache's salt for `request`: its cache_salt and LoRA adapter, encoded as one namespace
    (None for a request with neither)."""
    lora = request.lora_request
    return namespace(
        salt=request.cache_salt,
        lora=lora.lora_name if lora is not None else None,
        lora_path=lora.lora_path if lora is not None else None,
    )


def keyed_tokens(request: Request, start: int, end: int, page_tokens: int) -> list[int]:
    """The request's tokens [start, end) (`start` a page boundary) as the page keys see them:
    the full pages its multimodal features overlap folded with them (see the module
    docstring)."""
    tokens = request.all_token_ids[start:end]
    features = _features(request)
    if not features:
        return list(tokens)
    return fold_features(tokens, start, page_tokens, features)


def with_features(salt: bytes | None, request: Request, page_tokens: int) -> bytes | None:
    """`salt` (`request_salt`'s) where pages of `page_tokens` tokens carry the whole hashes of
    the request's multimodal features; with pages too short for that (fewer than 5 tokens),
    extended by the features' whole hashes and positions (`hicache.core.keys.features_salt`)."""
    return features_salt(salt, page_tokens, _features(request))


def _features(request: Request) -> list[tuple[int, int, str]]:
    """The request's multimodal features as (offset, length, modality:identifier)."""
    return [
        (f.mm_position.offset, f.mm_position.length, f"{f.modality}:{f.identifier}")
        for f in request.mm_features or ()
    ]
