"""hicache as a vLLM KV connector: ``kv_connector_module_path: hicache.integrations.vllm``,
``kv_connector: HiCacheConnector``. vLLM is imported with the connector (the first access to
`HiCacheConnector`), not with this package, so that `settings` checks a configuration without it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hicache.integrations.vllm.connector import HiCacheConnector

__all__ = ["HiCacheConnector"]


def __getattr__(name: str) -> Any:
    if name == "HiCacheConnector":
        from hicache.integrations.vllm.connector import HiCacheConnector

        return HiCacheConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
