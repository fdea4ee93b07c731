"""hicache as SGLang's HiCache storage backend (its L3): ``--hicache-storage-backend dynamic``
with ``"module_path": "hicache.integrations.sglang", "class_name": "HiCacheBackend"`` in the
extra config (docs/sglang.md). `HiCacheBackend` imports SGLang when it is first read; the
parts below it (`settings`, `pool`, `tiers`) import no SGLang."""

from typing import Any

__all__ = ["HiCacheBackend"]


def __getattr__(name: str) -> Any:
    if name == "HiCacheBackend":
        from hicache.integrations.sglang.backend import HiCacheBackend

        return HiCacheBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
