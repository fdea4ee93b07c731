"""What names a vLLM request's pages beyond its token ids: the tenant salt, the LoRA adapter
and the multimodal inputs (vLLM's own block hash covers the same). Prompt embeddings are
refused at start (`refuse_unsupported`).

- `request_salt`: the request's `cache_salt` and its LoRA adapter (name and path, as vLLM's
  block hash has them; never vLLM's per-process adapter id) become hicache's tenant salt, so
  two adapters never share a page, nor two tenants.
- `keyed_tokens`: the token ids with each multimodal placeholder range replaced by words drawn
  from the feature's content hash (vLLM's `identifier`): two images behind the same
  placeholder ids give different pages from the first page that holds either, and the pages
  before the first image stay shared. The words are negative int32 (no token id is), 31 bits
  of a SHA-256 of the identifier each, cycling through 8 words: a feature of n placeholder
  tokens weighs min(n, 8) x 31 bits in the keys.

Both are pure functions of the request's content, the same in every process and instance
(unlike vLLM's `block_hashes`, whose seed is per process unless PYTHONHASHSEED is set or the
hash is cryptographic).
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

from hicache.config import ConfigError

if TYPE_CHECKING:
    from vllm.v1.request import Request

_WORDS = 8


def refuse_unsupported(vllm_config: Any) -> None:
    """ConfigError (one line) for what the page keys cannot cover: prompt embeddings."""
    if getattr(vllm_config.model_config, "enable_prompt_embeds", False):
        raise ConfigError(
            "hicache: prompt embeddings (enable_prompt_embeds) are not supported: the page keys "
            "cover token ids, LoRA adapters and multimodal inputs only"
        )


def request_salt(request: Request) -> str | None:
    """hicache's tenant salt for `request`: its cache_salt, with its LoRA adapter where it has
    one (then a JSON text of both)."""
    lora = request.lora_request
    if lora is None:
        return request.cache_salt
    return json.dumps(
        {"salt": request.cache_salt, "lora": [lora.lora_name, lora.lora_path]},
        separators=(",", ":"),
    )


def _words(identifier: str) -> list[int]:
    digest = hashlib.sha256(b"hicache-mm\x00" + identifier.encode()).digest()
    return [
        -1 - (int.from_bytes(digest[4 * i : 4 * i + 4], "little") & 0x7FFFFFFF)
        for i in range(_WORDS)
    ]


def keyed_tokens(request: Request, start: int, end: int) -> list[int]:
    """The request's tokens [start, end) as the page keys see them: the placeholder ranges of
    its multimodal features replaced (see the module docstring)."""
    out = list(request.all_token_ids[start:end])
    for feature in request.mm_features or ():
        pos = feature.mm_position
        lo, hi = max(pos.offset, start), min(pos.offset + pos.length, end)
        if lo < hi:
            words = _words(feature.identifier)
            for i in range(lo, hi):
                out[i - start] = words[(i - pos.offset) % _WORDS]
    return out
