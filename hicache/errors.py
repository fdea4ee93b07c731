"""Exceptions hicache raises to the engine."""


class HiCacheError(RuntimeError):
    """Base of hicache's own runtime errors (bad arguments raise ValueError/TypeError)."""


class StateHookError(HiCacheError):
    """The engine's state hook raised. The request is treated as a miss for what it concerned;
    the cache's books are unchanged by the failed call."""
