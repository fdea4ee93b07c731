"""hicache: a tiered KV cache for LLM inference engines.

The API an engine embeds is `HiCache` (match / load / store / poll / release / stats), configured
with `load_config`. Page layouts are described by `Layout`; the engine's pool by `PagedBuffer`.
"""

from hicache.cache import HiCache, StateHooks
from hicache.config import ConfigError, HiCacheConfig, Layout, load_config
from hicache.core.request import Match
from hicache.errors import HiCacheError, StateHookError
from hicache.kernels import PagedBuffer

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
