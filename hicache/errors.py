"""Exceptions hicache raises to the engine."""


class ConfigError(ValueError):
    """A configuration that cannot be used. The message names the file (if any) and the field."""


class HiCacheError(RuntimeError):
    """Base of hicache's own runtime errors (bad arguments raise ValueError/TypeError)."""


class StateHookError(HiCacheError):
    """The engine's state hook raised. The request is treated as a miss for what it concerned;
    the cache's books are unchanged by the failed call."""
