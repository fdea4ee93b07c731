"""`HiCacheConnector`: hicache as a vLLM KV connector (vLLM's `KVConnectorBase_V1`).

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "HiCacheConnector",
        "kv_connector_module_path": "hicache.integrations.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"config": "configs/vllm.yaml"}}'

vLLM makes one connector per role: in the scheduler (`SchedulerBooks`: questions, grants,
stores to ask for) and in each worker (`WorkerCache`: the HiCache, its pools and tiers). The
two talk only through vLLM's per-step metadata (`hicache.integrations.vllm.meta`), so the same
code runs with the multiprocess executor and the uniprocess one. Why the books live with the
worker: docs/vllm.md.

Extra config keys: `config` (a hicache YAML file) or `hicache` (the same, inline); `model_id`
(optional: names the weights in the page keys instead of vLLM's model name; the rest of the
identity, `worker.vllm_identity`, is kept); `weights_version` (optional: the weights' version
in the page keys, bumped where weights change in place); `pin_share`
(optional, default 0.5: the share of a rank's host tier that answered hits waiting for their
load may keep pinned); `answer_in_step` (optional, default true: answer from the scheduler's
view where it can tell); `probe_wait_ms` (optional, default 5: how long the scheduler waits
for a shared store tier's answer to which groups it holds). The config has no `layout`
section: the layout comes from vLLM.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)

from hicache.config import tier_name
from hicache.integrations.common import for_rank, in_one_line
from hicache.integrations.vllm.inputs import refuse_unsupported
from hicache.integrations.vllm.meta import HiCacheStats, StepMeta
from hicache.integrations.vllm.probe import StoreProbe
from hicache.integrations.vllm.ranks import tp_agreement
from hicache.integrations.vllm.scheduler import SchedulerBooks
from hicache.integrations.vllm.settings import Settings
from hicache.integrations.vllm.worker import WorkerCache, layout_fields

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("hicache.vllm")


def node_index(vllm_config: VllmConfig, tp_rank: int, tp_size: int) -> int:
    """The worker's index among the workers of its node: its DP rank on the node (vLLM's local
    DP rank, or its DP index where vLLM set none, as vLLM's own workers take it) times the TP
    size, plus its TP rank. Two DP engines on one node differ in it; without DP it is the TP
    rank."""
    pc = vllm_config.parallel_config
    dp = pc.data_parallel_rank_local
    if dp is None:
        dp = getattr(pc, "data_parallel_index", pc.data_parallel_rank)
    return dp * tp_size + tp_rank


class HiCacheConnector(KVConnectorBase_V1):
    """hicache under vLLM. Loads are enqueued before the forward, layer by layer on a copy
    stream (each attention layer waits, on the device, for its own layer); stores are enqueued
    after it. A best-effort cache: a lost save is a future miss
    (`requires_kv_delivery` is false), a failed load is recomputed by vLLM."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._books: SchedulerBooks | None = None
        self._worker: WorkerCache | None = None
        start = lambda: self._start(vllm_config, role, kv_cache_config)  # noqa: E731
        in_one_line("configuration", start, log)

    def _start(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        settings = Settings.read(extra)  # in both roles: a bad config stops vLLM at start
        config = settings.config
        refuse_unsupported(vllm_config)
        if role == KVConnectorRole.SCHEDULER:
            block = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
            ranks = vllm_config.parallel_config.tensor_parallel_size
            reprefillable = max(0, vllm_config.num_prefill_lookahead_tokens - 1)
            floor = config.policy.min_recompute_tokens
            in_step, wait = settings.answer_in_step, settings.probe_wait_s
            probe = StoreProbe.for_config(config, wait) if in_step and wait else None
            self._books = SchedulerBooks(block, ranks, reprefillable, floor, in_step, probe)
        else:
            rank, size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
            fields = layout_fields(
                vllm_config, kv_cache_config, settings.model_id, rank, size,
                settings.weights_version,
            )  # fmt: skip
            index = node_index(vllm_config, rank, size)
            share = settings.pin_share
            self._worker = WorkerCache(for_rank(config, index), fields, share, tp_agreement())

    @property
    def requires_kv_delivery(self) -> bool:
        return False

    # -- worker role ----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        worker = self._worker_side()
        blocks = self._kv_cache_config.num_blocks
        in_one_line(f"TP rank {worker.rank}", lambda: worker.register(kv_caches, blocks), log)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, StepMeta):
            self._worker.bind_step(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker_side().start_load(self._step())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker_side().wait_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # stores are enqueued after the forward, in wait_for_save

    def wait_for_save(self) -> None:
        self._worker_side().save(self._step())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker_side().load_errors()

    def build_connector_worker_meta(self):
        return self._worker_side().answers()

    def get_kv_connector_stats(self) -> HiCacheStats | None:
        # vLLM asks both roles; the scheduler's has nothing of its own to add
        return self._worker.stats() if self._worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> HiCacheStats | None:
        return HiCacheStats(dict(data)) if data is not None else None

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:  # fmt: skip
        """hicache's counters on vLLM's /metrics (`hicache.integrations.vllm.prom`)."""
        from hicache.integrations.vllm.prom import HiCacheProm

        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        tiers = [tier_name(t) for t in Settings.read(extra).config.tiers[1:]]
        return HiCacheProm(
            vllm_config, metric_types, labelnames, per_engine_labelvalues, store_tiers=tiers
        )

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        probe = self._books.probe if self._books is not None else None
        if probe is not None:  # raise probe_wait_ms where many were late
            log.info("hicache: store probes in time %d, late %d", probe.answered, probe.late)
            probe.close()

    def _worker_side(self) -> WorkerCache:
        if self._worker is None:
            raise RuntimeError("hicache: a worker-side call on the scheduler's connector")
        return self._worker

    def _step(self) -> StepMeta:
        meta = self._get_connector_metadata()
        if not isinstance(meta, StepMeta):
            raise TypeError(f"hicache: expected StepMeta from the scheduler, got {type(meta)}")
        return meta

    # -- scheduler role -------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._scheduler_side().matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._scheduler_side().allocated(request, num_external_tokens)

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        return self._scheduler_side().hit_sources(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler_side().build(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler_side().answered(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._scheduler_side().finished(request)
        return False, None  # stores are enqueued on the stream before the blocks can be reused

    def _scheduler_side(self) -> SchedulerBooks:
        if self._books is None:
            raise RuntimeError("hicache: a scheduler-side call on a worker's connector")
        return self._books
