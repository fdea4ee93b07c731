"""Backends are found by the ``type:`` of their YAML section.

A backend module registers its config model and its tier class once, at import::

    @register_tier("host", HostTierConfig)
    class HostTier(PoolTier): ...

Adding a backend is one module and one registration; nothing else lists backend names.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TypeVar

from hicache.config import ConfigError, TierConfig

T = TypeVar("T")

_CONFIGS: dict[str, type[TierConfig]] = {}
_CLASSES: dict[str, type] = {}
_BUILTIN = ("hicache.backends.host", "hicache.backends.disk", "hicache.backends.mooncake")


def register_tier(type_: str, config_model: type[TierConfig]) -> Callable[[type[T]], type[T]]:
    """Class decorator: make `cls` the tier built for YAML sections with ``type: <type_>``."""

    def wrap(cls: type[T]) -> type[T]:
        if type_ in _CONFIGS and _CLASSES.get(type_) is not cls:
            raise ValueError(f"tier type {type_!r} is registered already by {_CLASSES[type_]}")
        _CONFIGS[type_] = config_model
        _CLASSES[type_] = cls
        cls.type = type_  # type: ignore[attr-defined]
        return cls

    return wrap


def _load_builtins() -> None:
    for module in _BUILTIN:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError:  # a backend's optional dependency is missing: not offered
            continue


def tier_config_model(type_: str, where: str = "type") -> type[TierConfig]:
    """The config model registered for `type_`; ConfigError naming the field if there is none."""
    if type_ not in _CONFIGS:
        _load_builtins()
    if type_ not in _CONFIGS:
        known = ", ".join(sorted(_CONFIGS)) or "none"
        raise ConfigError(f"{where}: unknown tier type {type_!r} (known: {known})")
    return _CONFIGS[type_]


def tier_class(type_: str) -> type:
    """The tier class registered for `type_`."""
    tier_config_model(type_)
    return _CLASSES[type_]
