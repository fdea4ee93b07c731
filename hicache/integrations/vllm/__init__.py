"""hicache as a vLLM KV connector: ``kv_connector_module_path: hicache.integrations.vllm``,
``kv_connector: HiCacheConnector``. Importing this package imports vLLM."""

from hicache.integrations.vllm.connector import HiCacheConnector

__all__ = ["HiCacheConnector"]
