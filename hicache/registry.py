"""Backends are found by the ``type:`` of their YAML section.

A backend module registers its config model and its tier class once, at import::

    @register_tier("host", HostTierConfig)
    class HostTier(PoolTier): ...

Adding a backend is one module and one registration; nothing else lists backend names.

Tiers from other packages are found in three ways, tried in this order for a type not known yet:

- the built-in backends (`_BUILTIN`), imported on first use;
- the entry-point group ``hicache.tiers``: an entry point named like the type, whose value is
  the module that registers it (or an object in it), is loaded; a package declares it with
  ``[project.entry-points."hicache.tiers"] mytier = "mypackage.mytier"``;
- a module path as the type, ``type: mypackage.mytier:MyTier``: the module is imported and the
  class's own registered type is used.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import TypeVar

from pydantic import BaseModel

from hicache.errors import ConfigError

T = TypeVar("T")

_CONFIGS: dict[str, type[BaseModel]] = {}
_CLASSES: dict[str, type] = {}
_BUILTIN = ("hicache.backends.host", "hicache.backends.disk.tier", "hicache.backends.mooncake.tier")


def register_tier(type_: str, config_model: type[BaseModel]) -> Callable[[type[T]], type[T]]:
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


ENTRY_POINTS = "hicache.tiers"
"""The entry-point group of tiers from other packages."""


def _load_entry_point(type_: str, where: str) -> None:
    """Load the ``hicache.tiers`` entry point named `type_`, if a package declares one."""
    for ep in entry_points(group=ENTRY_POINTS, name=type_):
        try:
            ep.load()
        except Exception as err:
            raise ConfigError(
                f"{where}: tier type {type_!r}: loading entry point {ep.value!r} failed: "
                f"{type(err).__name__}: {err}"
            ) from None
        return


def _load_path(path: str, where: str) -> str:
    """Import ``module:Class`` and return the type the class registered."""
    module, _, name = path.partition(":")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"{where}: cannot load tier class {path!r}: {err}") from None
    registered = getattr(cls, "type", None)
    if _CLASSES.get(registered) is not cls:
        raise ConfigError(f"{where}: {path!r} is not a registered tier (use @register_tier)")
    return registered


def _resolve(type_: str, where: str) -> str:
    """The registered type that `type_` names, loading its module if needed."""
    if ":" in type_:
        return _load_path(type_, where)
    if type_ not in _CONFIGS:
        _load_builtins()
    if type_ not in _CONFIGS:
        _load_entry_point(type_, where)
    if type_ not in _CONFIGS:
        known = ", ".join(sorted(_CONFIGS)) or "none"
        raise ConfigError(f"{where}: unknown tier type {type_!r} (known: {known})")
    return type_


def tier_config_model(type_: str, where: str = "type") -> type[BaseModel]:
    """The config model registered for `type_` (a type name, or ``module:Class``);
    ConfigError naming the field if there is none."""
    return _CONFIGS[_resolve(type_, where)]


def tier_class(type_: str) -> type:
    """The tier class registered for `type_`."""
    return _CLASSES[_resolve(type_, "type")]


def tier_types() -> dict[str, type[BaseModel]]:
    """The built-in tier types and their config models (what this package documents)."""
    _load_builtins()
    return {t: m for t, m in _CONFIGS.items() if _CLASSES[t].__module__ in _BUILTIN}
