"""What every engine integration does the same way: a start-up error as one line, and the
configuration of one engine process (its own directory per store tier, its own metrics port).
Imports no engine."""

from __future__ import annotations

import difflib
import logging
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, TypeVar

from hicache.config import ConfigError, HiCacheConfig

_LOG = logging.getLogger("hicache")
T = TypeVar("T")
C = TypeVar("C", bound=HiCacheConfig)

RANK = "{rank}"
"""In a store tier's `path`: replaced by the process's index on its node (else each process
gets a subdirectory)."""


def in_one_line(what: str, start: Callable[[], T], log: logging.Logger = _LOG) -> T:
    """Run a step of an integration's start; a configuration or machine error in it reaches
    the operator as one line: logged at error level on `log` (before the engine's traceback),
    and raised as a ConfigError with that line as its message (the cause chained)."""
    try:
        return start()
    except (ValueError, RuntimeError, OSError) as err:
        text = str(err).strip()
        cause = text.splitlines()[0] if text else type(err).__name__
        line = cause if cause.startswith("hicache") else f"hicache: {what}: {cause}"
        log.error("%s", line)
        raise ConfigError(line) from err


def rank_path(path: str, rank: int) -> str:
    """A store tier's directory for the process of index `rank`: `{rank}` in `path` replaced,
    or else the subdirectory ``rank<r>`` of `path` (`path` made here if absent: its parent must
    exist)."""
    if RANK in path:
        return path.replace(RANK, str(rank))
    Path(path).mkdir(exist_ok=True)
    return str(Path(path) / f"rank{rank}")


def for_rank(config: C, rank: int) -> C:
    """The config of the process of index `rank` on its node: each store tier with a directory
    gets one of its own (one process a directory), and the metrics are on the configured port
    plus the index."""
    tiers = [
        tier.model_copy(update={"path": rank_path(tier.path, rank)})
        if isinstance(getattr(tier, "path", None), str)
        else tier
        for tier in config.tiers
    ]
    update: dict[str, Any] = {"tiers": tiers}
    if config.metrics.port and rank:
        update["metrics"] = config.metrics.model_copy(update={"port": config.metrics.port + rank})
    return config.model_copy(update=update)


def config_source(extra: dict[str, Any], where: str) -> Any:
    """The hicache config an engine's extra config names: the YAML file under `config` or the
    config inline under `hicache`, exactly one of them (`where` names the engine's flag)."""
    if ("config" in extra) == ("hicache" in extra):
        raise ConfigError(
            f"hicache: {where} needs exactly one of 'config' (a YAML file) and 'hicache' "
            "(the config inline)"
        )
    return extra["config"] if "config" in extra else extra["hicache"]


def unknown_key(key: str, known: Collection[str]) -> str:
    """What an engine's extra config says of a key it does not know: the key, the known key it
    is closest to (a misspelling), and the keys it knows (in their order)."""
    close = difflib.get_close_matches(key, list(known), n=1)
    meant = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown key {key!r}{meant}; the keys are {', '.join(known)}"
