"""`HiCacheBackend`: hicache's store tiers as SGLang's HiCache storage backend (its L3).

    python -m sglang.launch_server --model-path MODEL --page-size 64 \\
        --enable-hierarchical-cache --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "hicache",
          "module_path": "hicache.integrations.sglang", "class_name": "HiCacheBackend",
          "interface_v1": 1, "config": "configs/sglang/disk.yaml"}'

SGLang builds it as ``HiCacheBackend(storage_config, kwargs)``, hands it the host pool
(`register_mem_pool_host`) and calls it from its cache controller's threads: `batch_exists`
(the prefetch thread), `batch_get_v1` (the prefetch I/O thread), `batch_set_v1` (the backup
thread). The work is `hicache.integrations.sglang.tiers.StoreTiers`'s; this class adds what
SGLang's contract asks: the settings (`hicache.integrations.sglang.settings`), the namespace
of the pages (`layout`), the refusals at start, SGLang's storage metrics and hicache's own.

Hybrid models (SWA, Mamba: SGLang's v2 calls with `PoolTransfer`s) are refused at start: SGLang
keeps their states in pools of their own, with hit rules (trailing pages, block groups) that
hicache's tiers do not hold yet.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
)

from hicache.config import ConfigError, Layout
from hicache.core.identity import Identity
from hicache.integrations.common import for_rank, in_one_line
from hicache.integrations.sglang.identity import sglang_identity, weight_version
from hicache.integrations.sglang.pool import EnginePages
from hicache.integrations.sglang.settings import Settings, settings
from hicache.integrations.sglang.tiers import StoreTiers
from hicache.registry import tier_class

log = logging.getLogger("hicache.sglang")


class HiCacheBackend(HiCacheStorage):
    """hicache under SGLang's host pool. A best-effort cache: a page that failed to store is a
    future miss; a page that failed to arrive is recomputed by SGLang (only the leading pages
    that arrived whole and verified count)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        self.storage_config = storage_config
        self.settings: Settings = in_one_line(
            "configuration", lambda: settings(storage_config.extra_config), log
        )
        self.tiers: StoreTiers | None = None
        self._metrics: Any = None
        self.identity: Identity | None = None
        """What the pages' keys are rooted in (`hicache.core.identity`), once started."""
        self._pool: tuple[EnginePages, Any] | None = None
        self._rekeying = threading.Lock()

    # -- start ------------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        if self.tiers is None:
            rank = f"TP rank {self.storage_config.tp_rank}"
            self.tiers = in_one_line(rank, lambda: self._start(mem_pool_host), log)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        if host_pool_name != PoolName.KV:
            line = (
                f"hicache: SGLang's {host_pool_name} pool (a hybrid model's states) is not "
                "supported: hicache stores full-attention KV pages only"
            )
            log.error("%s", line)
            raise ConfigError(line)
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    def _start(self, pool: Any) -> StoreTiers:
        cfg = self.storage_config
        if cfg.dcp_size > 1 or cfg.should_split_heads:
            raise ValueError("decode context parallelism and tp_lcm_size are not supported")
        pages = EnginePages(pool)
        layout = Layout(
            model=self._identity(pages, pool).name(),
            kv_dtype=str(pool.dtype).removeprefix("torch."),
            page_tokens=pages.page_tokens,
            segments=pages.pages.seg_bytes,
            tp_rank=cfg.tp_rank,
            tp_size=cfg.tp_size,
            kv_head_sharded=not cfg.is_mla_model,
        )
        self.settings.config.check_machine()  # a directory that cannot serve, named
        config = for_rank(self.settings.config, process_index(cfg))
        if cfg.is_mla_model and cfg.tp_size > 1:
            for i, tier in enumerate(config.tiers):
                if not tier_class(tier.type).shared:
                    raise ValueError(
                        f"tiers.{i}: an MLA model on {cfg.tp_size} TP ranks stores its pages "
                        f"from one rank and reads them on every rank: a {tier.type} tier is "
                        "one process's; use a shared tier (mooncake)"
                    )
        tiers = StoreTiers(
            config.tiers, pages, layout, cfg.is_storage_writer, cfg.enable_storage_metrics
        )
        try:  # all or nothing: a start that fails closes the tiers it started
            if not tiers.wait_ready():
                log.warning("hicache: a store tier does not answer yet; SGLang's calls skip it")
            if config.metrics.port is not None:
                from hicache.observability.metrics import register, serve

                registry, _ = register(tiers)
                self._metrics = serve(registry, config.metrics.port, config.metrics.addr)
        except BaseException:
            tiers.close()
            raise
        log.info("hicache: %d store tiers under SGLang's %s", len(config.tiers), pages.description)
        return tiers

    def _identity(self, pages: EnginePages, pool: Any) -> Identity:
        """The identity of this rank's pages (`sglang_identity`): `model_id` names the weights
        only; SGLang's published settings, the pool and the shard decide the rest."""
        cfg = self.storage_config
        dtype = str(pool.dtype).removeprefix("torch.")
        mla = "mla" if cfg.is_mla_model else "mha"
        shard = _shard(cfg) if cfg.is_mla_model else f"tp{cfg.tp_rank}/{cfg.tp_size}|{_shard(cfg)}"
        identity = sglang_identity(
            cfg.model_name, self.settings, dtype, f"{mla}|{pages.description}", shard
        )
        self.identity, self._pool = identity, (pages, pool)
        return identity

    def _follow_weights(self, tiers: StoreTiers) -> None:
        """SGLang's update-weights calls set its weight version (``weight_version``): where the
        extra config gives no `weights_version`, the pages of every call after a change are
        named under the new version, so the old weights' pages are never served."""
        now = weight_version()
        if self.settings.weights_version or self.identity is None or self._pool is None:
            return
        if now is None or now == self.identity.weights_version:
            return
        with self._rekeying:
            if weight_version() not in (None, self.identity.weights_version):
                identity = self._identity(*self._pool)
                tiers.rekey(tiers.layout.model_copy(update={"model": identity.name()}))
                log.info("hicache: SGLang's weights are version %s", identity.weights_version)

    # -- SGLang's calls ---------------------------------------------------------------------------

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        return self._started().exists(keys)

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        return self._started().get(keys, host_indices)

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        return self._started().put(keys, host_indices)

    def exists(self, key: str) -> bool:
        return self._started().exists([key]) == 1

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        raise NotImplementedError(_V1)

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None):
        raise NotImplementedError(_V1)

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        raise NotImplementedError(_V1)

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:  # fmt: skip
        raise NotImplementedError(_V1)

    def clear(self) -> dict[str, int]:
        """SGLang's clear of the storage (its admin endpoint; `clear_storage_backend`): every
        object of this instance's namespace (the fingerprint of its model, layout and rank) is
        dropped from each store tier its pages are written to, so that no instance reads them
        again, now or after a restart (a disk tier reads each record's 4 KiB header to find
        them; Mooncake's master drops them by name). Returns, and logs, the objects dropped per
        tier. A tier that could not drop them is fenced (this instance reads and writes it no
        more, until a clear succeeds there) and the clear raises naming it: SGLang then reports
        that the clear failed."""
        done = self._started().clear()
        dropped = {name: n for name, n in done.items() if isinstance(n, int)}
        failed = {name: why for name, why in done.items() if not isinstance(why, int)}
        said = ", ".join(f"{n} from {name}" for name, n in dropped.items()) or "no tier written"
        log.info("hicache: clear dropped %s", said)
        if failed:
            why = "; ".join(f"{name}: {reason}" for name, reason in failed.items())
            line = f"hicache: clear dropped nothing from {why} (fenced: not read again)"
            log.error("%s", line)
            raise RuntimeError(line)
        return dropped

    # -- stats and the end ------------------------------------------------------------------------

    def get_stats(self) -> Any:
        """SGLang's storage metrics since its last read (pages and GB/s of each get and put),
        where SGLang asks for them (``--enable-hicache-storage-metrics``); hicache's own
        counters are `stats` (and its metrics endpoint, ``metrics.port``)."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        out = StorageMetrics()
        calls = self.tiers.calls if self.tiers is not None else None
        while calls:
            call = calls.popleft()
            pages = out.prefetch_pgs if call.kind == "get" else out.backup_pgs
            rates = out.prefetch_bandwidth if call.kind == "get" else out.backup_bandwidth
            pages.append(call.pages)
            rates.append(call.nbytes / max(call.seconds, 1e-9) / 1e9)
        return out

    def stats(self) -> dict[str, int]:
        """hicache's counters of each store tier (see `StoreTiers.stats`)."""
        return self._started().stats()

    def close(self) -> None:
        """Close the tiers and the metrics endpoint (SGLang calls it when it detaches)."""
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        if self.tiers is not None:
            self.tiers.close()
            self.tiers = None

    def _started(self) -> StoreTiers:
        tiers = self.tiers
        if tiers is None:
            raise RuntimeError("hicache: SGLang has not registered its host pool yet")
        self._follow_weights(tiers)
        return tiers


_V1 = 'hicache: only the zero-copy calls: give "interface_v1": 1 in the extra config'


def process_index(cfg: HiCacheStorageConfig) -> int:
    """This process's index among SGLang's processes of one node with a store backend (its
    attention DP, PP, TP and context-parallel ranks): each gets a directory of its own."""
    index = cfg.dp_rank * cfg.pp_size + cfg.pp_rank
    index = index * cfg.tp_size + cfg.tp_rank
    return index * cfg.attn_cp_size + cfg.attn_cp_rank


def _shard(cfg: HiCacheStorageConfig) -> str:
    """What part of the model's KV this rank holds beyond its TP rank: its pipeline stage and
    its context-parallel slice."""
    return f"pp{cfg.pp_rank}/{cfg.pp_size}|cp{cfg.attn_cp_rank}/{cfg.attn_cp_size}"
