"""hicache: a tiered KV cache for LLM inference engines.

The API an engine embeds is `HiCache` (match / load / store / poll / release / stats), configured
with `load_config`. Page layouts are described by `Layout`; the engine's pool by `PagedBuffer`.

The names below are imported on first use (PEP 562), so that ``import hicache`` and the
``hicache`` command's ``--help`` and ``--version`` do not pay for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hicache.cache import HiCache, StateHooks
    from hicache.config import ConfigError, HiCacheConfig, Layout, load_config
    from hicache.core.request import Match
    from hicache.errors import HiCacheError, StateHookError
    from hicache.kernels import PagedBuffer

_HOMES = {
    "ConfigError": "hicache.config",
    "HiCache": "hicache.cache",
    "HiCacheConfig": "hicache.config",
    "HiCacheError": "hicache.errors",
    "Layout": "hicache.config",
    "Match": "hicache.core.request",
    "PagedBuffer": "hicache.kernels",
    "StateHookError": "hicache.errors",
    "StateHooks": "hicache.cache",
    "load_config": "hicache.config",
}
__all__ = [
    "ConfigError",
    "HiCache",
    "HiCacheConfig",
    "HiCacheError",
    "Layout",
    "Match",
    "PagedBuffer",
    "StateHookError",
    "StateHooks",
    "load_config",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'hicache' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
