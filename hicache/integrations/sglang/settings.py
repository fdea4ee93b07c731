"""What SGLang's ``--hicache-storage-backend-extra-config`` tells the backend, checked at start
with one-line errors. Imports no SGLang.

The extra config is SGLang's own JSON (or ``@file``): SGLang reads ``backend_name``,
``module_path``, ``class_name``, ``interface_v1`` and its prefetch keys; hicache reads
``config`` (a hicache YAML file) or ``hicache`` (the same, inline), ``model_id`` (names the
weights in the page keys instead of SGLang's model name) and ``weights_version`` (the weights'
version in the page keys). The hicache config lists the store
tiers only: SGLang's host pool is the host tier, sized by SGLang's flags.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import model_validator

from hicache.config import ConfigError, HiCacheConfig, load_config, tier_name
from hicache.integrations.common import config_source, unknown_key

SGLANG_KEYS = frozenset({
    "backend_name", "module_path", "class_name", "interface_v1", "prefetch_threshold",
    "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
    "hicache_storage_pass_prefix_keys", "tp_lcm_size",
})  # fmt: skip
"""Keys of the extra config that SGLang reads itself."""
HICACHE_KEYS = frozenset({"config", "hicache", "model_id", "weights_version"})
FLAG = "--hicache-storage-backend-extra-config"


class SGLangConfig(HiCacheConfig):
    """hicache's configuration under SGLang: the store tiers below SGLang's host pool, in walk
    order, and hicache's metrics. No host tier (SGLang's ``--hicache-ratio`` or
    ``--hicache-size`` size SGLang's), no ``layout`` (it comes from SGLang's host pool) and no
    ``policy`` (SGLang's ``--hicache-write-policy`` and prefetch policy decide when pages move).
    A tier's ``write`` is ``behind`` (every page SGLang stores) or ``off`` (read only); an
    object is one SGLang page (``group_pages: 1``)."""

    @model_validator(mode="after")
    def _tier_order(self) -> SGLangConfig:  # replaces HiCacheConfig's rule of the same name
        if "policy" in self.model_fields_set:
            raise ValueError(
                "policy: under SGLang, SGLang's flags decide when pages are stored and fetched "
                "(--hicache-write-policy, --hicache-storage-prefetch-policy)"
            )
        if self.layout is not None:
            raise ValueError("layout: under SGLang the layout comes from SGLang's host pool")
        for i, tier in enumerate(self.tiers):
            where = f"tiers.{i}"
            if tier.type == "host":
                raise ValueError(
                    f"{where}: under SGLang the host tier is SGLang's own (--hicache-ratio or "
                    "--hicache-size): list the store tiers only"
                )
            if getattr(tier, "write", "behind") == "on_evict":
                raise ValueError(
                    f"{where}.write: on_evict is not for SGLang, whose --hicache-write-policy "
                    "decides when pages are stored: use behind or off"
                )
            if getattr(tier, "group_pages", 1) > 1 and "group_pages" in tier.model_fields_set:
                raise ValueError(
                    f"{where}.group_pages: under SGLang an object is one SGLang page (its "
                    "--page-size tokens; SGLang's batches do not say where a page lies in its "
                    "prompt): set --page-size instead"
                )
        names = [tier_name(t) for t in self.tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"each tier needs its own name (give 'name:'), got {names}")
        return self

    def as_used(self) -> dict[str, Any]:
        """The configuration as the backend uses it (JSON types): the store tiers without the
        fields of hicache's own tier chain (its queues, fetch workers, groups, cost model),
        which SGLang's threads replace, and the metrics."""
        tiers = [t.model_dump(mode="json", exclude=set(CHAIN_FIELDS)) for t in self.tiers]
        return {"tiers": tiers, "metrics": self.metrics.model_dump(mode="json")}


CHAIN_FIELDS = (
    "read_gbps", "close_timeout_s", "group_pages", "write_queue_depth", "fetch_queue_depth",
    "fetch_workers", "fetch_reserve", "worker_cpus",
)  # fmt: skip
"""Store-tier fields of hicache's own tier chain, unused under SGLang."""


@dataclass(frozen=True)
class Settings:
    """The backend's settings from SGLang's extra config."""

    config: SGLangConfig
    model_id: str | None
    """Names the weights in the page keys; None: SGLang's model name."""
    weights_version: str = ""
    """The weights' version in the page keys (bump it where weights change in place); '':
    SGLang's own ``weight_version``, as its update-weights calls set it."""


def settings(extra: dict[str, Any] | None) -> Settings:
    """The settings in SGLang's extra config; ConfigError (one line) for a missing or bad one."""
    extra = dict(extra or {})
    unknown = sorted(set(extra) - SGLANG_KEYS - HICACHE_KEYS)
    if unknown:
        known = sorted(HICACHE_KEYS) + sorted(SGLANG_KEYS)
        raise ConfigError(f"hicache: {FLAG}: {unknown_key(unknown[0], known)}")
    if not extra.get("interface_v1"):
        raise ConfigError(
            f'hicache: give "interface_v1": 1 in {FLAG} (hicache moves pages straight between '
            "SGLang's host pool and its tiers)"
        )
    model_id = extra.get("model_id")
    if model_id is not None and (not isinstance(model_id, str) or not model_id):
        raise ConfigError(f"hicache: model_id must be a non-empty string, got {model_id!r}")
    version = extra.get("weights_version", "")
    if not isinstance(version, str):
        raise ConfigError(f"hicache: weights_version must be a string, got {version!r}")
    source = config_source(extra, FLAG)
    return Settings(load_config(source, model=SGLangConfig), model_id, version)


def from_extra_config(text: str) -> Settings:
    """The settings of SGLang's ``--hicache-storage-backend-extra-config`` argument as SGLang
    reads it (a JSON object, or ``@file`` of JSON, YAML or TOML), which must name this backend;
    ConfigError (one line) otherwise."""
    where = FLAG
    try:
        if text.startswith("@"):
            where, path = text[1:], Path(text[1:])
            kind = path.suffix.lower()
            if kind == ".toml":
                import tomllib  # Python 3.11 on, as SGLang's own reading of the file

                extra = tomllib.loads(path.read_text())
            elif kind in (".yaml", ".yml"):
                extra = yaml.safe_load(path.read_text())
            elif kind == ".json":
                extra = json.loads(path.read_text())
            else:
                raise ConfigError(f"hicache: {where}: SGLang reads .json, .yaml or .toml files")
        else:
            extra = json.loads(text)
    except OSError as err:
        raise ConfigError(f"hicache: {where}: cannot read: {err.strerror}") from None
    except (ValueError, yaml.YAMLError) as err:  # JSONDecodeError, TOMLDecodeError
        line = str(err).strip().splitlines()[0]
        raise ConfigError(f"hicache: {where}: not valid {kind_of(where)}: {line}") from None
    if not isinstance(extra, dict):
        raise ConfigError(f"hicache: {where}: must be an object of keys")
    for key, want in (("module_path", "hicache.integrations.sglang"), ("class_name", BACKEND)):
        if extra.get(key) != want:
            raise ConfigError(
                f'hicache: {where}: "{key}" must be "{want}" (with SGLang\'s '
                f"--hicache-storage-backend dynamic), got {extra.get(key)!r}"
            )
    return settings(extra)


BACKEND = "HiCacheBackend"


def kind_of(where: str) -> str:
    """The format SGLang reads `where` (a file, or the JSON argument) in."""
    suffix = Path(where).suffix.lower()
    return {".toml": "TOML", ".yaml": "YAML", ".yml": "YAML"}.get(suffix, "JSON")
