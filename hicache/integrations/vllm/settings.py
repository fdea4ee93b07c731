"""The connector's settings: vLLM's `--kv-transfer-config` and its `kv_connector_extra_config`,
read and checked without importing vLLM, so that `hicache config check --kv-transfer-config`
checks them in a second, exactly as the connector will when vLLM starts it.

Every error is a `ConfigError` of one line starting ``hicache:`` and naming the key.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hicache.config import ConfigError, HiCacheConfig, load_config
from hicache.integrations.common import config_source, unknown_key

CONNECTOR, MODULE = "HiCacheConnector", "hicache.integrations.vllm"

KEYS = {
    "config": "a hicache YAML file",
    "hicache": "the hicache config inline",
    "model_id": "the weights' name in the page keys",
    "weights_version": "the weights' version in the page keys (a string)",
    "pin_share": "a number in (0, 1]",
    "answer_in_step": "true or false",
    "probe_wait_ms": "a number in [0, 1000]",
}
"""The keys of `kv_connector_extra_config` (docs/vllm.md, "Configuration")."""


@dataclass(frozen=True)
class Settings:
    """The extra config, checked: the hicache config it names and the connector's options."""

    config: HiCacheConfig
    model_id: str | None = None
    weights_version: str = ""
    pin_share: float = 0.5
    answer_in_step: bool = True
    probe_wait_s: float = 0.005

    @classmethod
    def read(cls, extra: Mapping[str, Any]) -> Settings:
        """Check `extra` (a key of `KEYS` misspelt is named, with the key meant) and load the
        hicache config it names."""
        unknown = [key for key in extra if key not in KEYS]
        if unknown:
            raise ConfigError(
                f"hicache: kv_connector_extra_config: {unknown_key(unknown[0], KEYS)}"
            )
        model_id = extra.get("model_id")
        if model_id is not None and not (isinstance(model_id, str) and model_id):
            raise ConfigError(f"hicache: model_id must be a non-empty string, got {model_id!r}")
        version = extra.get("weights_version", "")
        if not isinstance(version, str):
            raise ConfigError(f"hicache: weights_version must be a string, got {version!r}")
        return cls(
            hicache_config(extra), model_id, version, pin_share(extra), answer_in_step(extra),
            probe_wait_s(extra),
        )  # fmt: skip


def from_transfer_config(text: str) -> Settings:
    """The settings of vLLM's `--kv-transfer-config` JSON, which must name this connector."""
    try:
        transfer = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"hicache: --kv-transfer-config is not JSON: {err}") from None
    if not isinstance(transfer, dict):
        raise ConfigError("hicache: --kv-transfer-config must be a JSON object")
    for key, want in (("kv_connector", CONNECTOR), ("kv_connector_module_path", MODULE)):
        if transfer.get(key) != want:
            raise ConfigError(
                f"hicache: --kv-transfer-config: {key} must be {want!r}, got {transfer.get(key)!r}"
            )
    extra = transfer.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise ConfigError("hicache: kv_connector_extra_config must be a JSON object")
    return Settings.read(extra)


def hicache_config(extra: Mapping[str, Any]) -> HiCacheConfig:
    """The hicache config named by the extra config (`config` or `hicache`)."""
    config = load_config(config_source(dict(extra), "kv_connector_extra_config"))
    if config.layout is not None:
        raise ConfigError(
            "hicache: under vLLM the config has no 'layout' section: the layout comes from "
            "vLLM's model, block size, KV dtype and TP rank"
        )
    return config


def pin_share(extra: Mapping[str, Any]) -> float:
    """The extra config's `pin_share`: a number in (0, 1]."""
    share = extra.get("pin_share", 0.5)
    if isinstance(share, bool) or not isinstance(share, int | float) or not 0 < share <= 1:
        raise ConfigError(f"hicache: pin_share must be a number in (0, 1], got {share!r}")
    return float(share)


def answer_in_step(extra: Mapping[str, Any]) -> bool:
    """The extra config's `answer_in_step` (default true): answer from the scheduler's view of
    the workers' tiers where it can tell, instead of asking the workers every time."""
    value = extra.get("answer_in_step", True)
    if not isinstance(value, bool):
        raise ConfigError(f"hicache: answer_in_step must be true or false, got {value!r}")
    return value


def probe_wait_s(extra: Mapping[str, Any]) -> float:
    """The extra config's `probe_wait_ms` (default 5), in seconds: a number in [0, 1000]."""
    wait = extra.get("probe_wait_ms", 5)
    if isinstance(wait, bool) or not isinstance(wait, int | float) or not 0 <= wait <= 1000:
        raise ConfigError(f"hicache: probe_wait_ms must be a number in [0, 1000], got {wait!r}")
    return wait / 1e3
