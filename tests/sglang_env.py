"""SGLang's own code on the CPU, for the tests of `hicache.integrations.sglang`: its host pools,
its cache controller with its threads, its hashing and its failure injector, real; what a
scheduler does around them (allocate host pages, hand a prefetch its pages, read the acks)
done here as SGLang's scheduler does it.

SGLang is installed beside vLLM without its pins (scripts/test.sh); the one module of its
import path that cannot load here (torchvision) has a stand-in while SGLang is imported
(`hicache.integrations.sglang.cpu_imports`).

Skipped without SGLang; failed instead under ``HICACHE_REQUIRE_SGLANG=1`` (CI).
"""

from __future__ import annotations

import importlib
import os
import threading
import time
import types
from typing import Any

import pytest

from hicache.integrations.sglang.cpu_imports import stand_ins

REQUIRE_ENV = "HICACHE_REQUIRE_SGLANG"
MODULES = (
    "sglang.srt.managers.cache_controller",
    "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller",
    "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler",
    "sglang.srt.mem_cache.pool_host",
    "sglang.srt.mem_cache.base_prefix_cache",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.mem_cache.allocator.paged",
    "sglang.srt.mem_cache.pool_host.mha",
    "sglang.srt.mem_cache.pool_host.mla",
    "sglang.srt.mem_cache.hicache_storage",
    "sglang.srt.mem_cache.storage",
    "sglang.srt.mem_cache.utils",
    "sglang.srt.observability.metrics_collector",
    "sglang.srt.runtime_context",
    "hicache.integrations.sglang.backend",
)
"""What the tests use, SGLang's lazy imports on the storage path included."""
WAIT_S = 60.0
"""How long a test waits for an ack of SGLang's threads (generous: a busy machine)."""


def load() -> types.SimpleNamespace:
    """SGLang's modules the tests use (skipping the module without SGLang)."""
    try:
        importlib.import_module("sglang")
    except ImportError as err:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1 but SGLang does not import: {err}", pytrace=False)
        pytest.skip(f"SGLang is not installed: {err}", allow_module_level=True)
    with stand_ins():
        mods = {name.rsplit(".", 1)[-1]: importlib.import_module(name) for name in MODULES}
    return types.SimpleNamespace(**mods)


sg = load()
P = 4  # tokens a page


def device_pools() -> dict[str, Any]:
    """SGLang's device pools on the CPU: an MHA one (2 KV heads of 8, 3 layers) and an MLA one."""
    import torch

    mp = sg.memory_pool
    return {
        "mha": mp.MHATokenToKVPool(
            size=256, page_size=P, dtype=torch.bfloat16, head_num=2, head_dim=8, layer_num=3,
            device="cpu", enable_memory_saver=False, enable_alt_stream=False,
        ),
        "mla": mp.MLATokenToKVPool(
            size=256, page_size=P, dtype=torch.bfloat16, kv_lora_rank=16, qk_rope_head_dim=8,
            layer_num=3, device="cpu", enable_memory_saver=False,
        ),
    }  # fmt: skip


MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")


POOL_BASE = "sglang.srt.mem_cache.pool_host.base"
HOST_BUDGET = 1 << 30
"""Bytes the host pools a test builds may take (each takes a few MiB)."""


def host_pool(device: Any, layout: str, ratio: float = 2.0) -> Any:
    """SGLang's host pool for `device` in `layout`, as SGLang builds it (unpinned: no CUDA),
    booked against `HOST_BUDGET` rather than the machine's free memory less SGLang's 10 GiB
    reserve (which refused a pool of a few MiB beside other tests on a 24 GiB machine)."""
    info = device.get_device_pool_infos()[0].buffer_info
    with importlib.import_module(POOL_BASE).host_memory_budget_scope(HOST_BUDGET):
        return _host_pool(device, info, layout, ratio)


def _host_pool(device: Any, info: Any, layout: str, ratio: float) -> Any:
    common = dict(
        pin_memory=False, device="cpu", device_capacity_tokens=device.size, start_layer=0,
        end_layer=device.layer_num,
    )  # fmt: skip
    if isinstance(device, sg.memory_pool.MLATokenToKVPool):
        return sg.mla.MLATokenToKVPoolHost(
            info, ratio, 0, P, layout, target_layer_num=device.layer_num,
            override_kv_cache_dim=device.kv_cache_dim, **common,
        )  # fmt: skip
    return sg.mha.MHATokenToKVPoolHost(info, ratio, 0, P, layout, **common)


def extra(hicache: dict[str, Any], **more: Any) -> dict[str, Any]:
    """SGLang's extra config for hicache's backend with the config `hicache` inline."""
    return {
        "backend_name": "hicache", "module_path": "hicache.integrations.sglang",
        "class_name": "HiCacheBackend", "interface_v1": 1, "hicache": hicache, **more,
    }  # fmt: skip


def storage_config(extra_config: dict[str, Any]) -> Any:
    """SGLang's storage config of TP rank 0 of 1, for a backend made without a controller."""
    return sg.hicache_storage.HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
        model_name="test-model", extra_config=dict(extra_config),
    )  # fmt: skip


def ranks(tp_rank: int = 0, tp_size: int = 1) -> Any:
    """SGLang's parallel context of TP rank `tp_rank` of `tp_size` (what a server publishes)."""
    return sg.runtime_context.get_parallel().override(
        attn_dcp_size=1, attn_dcp_rank=0, tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1
    )


def controller(
    device: Any,
    host: Any,
    extra_config: dict[str, Any],
    tp_rank: int = 0,
    tp_size: int = 1,
    storage_metrics: bool = False,
) -> Any:
    """SGLang's `HiCacheController` over `host` with the dynamic backend of `extra_config`,
    its storage threads running (as TP rank `tp_rank` of `tp_size`, without process groups:
    each rank's hit counts are its own)."""
    import torch

    allocator = sg.paged.PagedTokenToKVPoolAllocator(
        device.size, P, torch.int64, "cpu", device, need_sort=False
    )
    with ranks(tp_rank, tp_size):
        return sg.cache_controller.HiCacheController(
            allocator, host, P, None, threading.Event(), storage_backend="dynamic",
            model_name="test-model", storage_backend_extra_config=dict(extra_config),
            enable_storage_metrics=storage_metrics,
        )  # fmt: skip


def server_controller(
    device: Any, host: Any, extra_config: dict[str, Any] | None = None, tp_rank: int = 0,
    tp_size: int = 1,
) -> Any:  # fmt: skip
    """SGLang's controller as its server builds it for a plain (full-attention) model:
    `HybridCacheController` over a `HostPoolGroup` whose one entry, the anchor, is `host`
    (`hybrid_pool_assembler.build_kv_only_group`'s, without the server's published settings);
    with the dynamic backend of `extra_config` attached at start, or none (`attach` later)."""
    import torch

    assembler = sg.hybrid_pool_assembler
    entry = assembler.build_pool_entry(
        name=sg.hicache_storage.PoolName.KV, host_pool=host, device_pool=device,
        layer_mapping={i: i for i in range(device.layer_num)},
        transfer_layer_id_max=device.layer_num, is_anchor=True,
    )  # fmt: skip
    allocator = sg.paged.PagedTokenToKVPoolAllocator(
        device.size, P, torch.int64, "cpu", device, need_sort=False
    )
    with ranks(tp_rank, tp_size):
        return sg.hybrid_cache_controller.HybridCacheController(
            allocator, sg.pool_host.HostPoolGroup([entry]), P, None, threading.Event(),
            storage_backend="dynamic" if extra_config is not None else None,
            model_name="test-model", storage_backend_extra_config=dict(extra_config or {}),
            transfer_layer_id_max=device.layer_num,
        )  # fmt: skip


def attach(ctl: Any, extra_config: dict[str, Any]) -> None:
    """SGLang's runtime attach of the dynamic backend (its admin call's path,
    `StorageAttachment.attach`, from the parsed extra config on)."""
    with ranks():
        ctl.attach_storage_backend(
            storage_backend="dynamic", model_name="test-model",
            storage_backend_extra_config=dict(extra_config),
            host_pools=ctl.mem_pool_host.entries,
        )  # fmt: skip


def stop(ctl: Any) -> None:
    """Stop the controller's threads and close its backend (SGLang's detach)."""
    ctl.detach_storage_backend()


def backend(ctl: Any) -> Any:
    """hicache's backend under the controller (inside SGLang's failure injector, if any)."""
    b = ctl.storage_backend
    return getattr(b, "_backend", b)


def backup(ctl: Any, host: Any, tokens: list[int]) -> tuple[Any, int]:
    """Write `tokens`' pages from fresh host pages through the controller's backup thread, as
    SGLang's write-through does: the host pages and the tokens stored."""
    pages = len(tokens) // P
    indices = host.alloc(pages * P)
    keys = sg.utils.get_hash_str(tokens[: pages * P], page_size=P)
    ctl.write_storage(indices, tokens[: pages * P], hash_value=keys)
    op = ctl.ack_backup_queue.get(timeout=WAIT_S)
    return indices, op.completed_tokens


def prefetch(ctl: Any, host: Any, tokens: list[int], rid: str = "r") -> tuple[Any, int, float]:
    """Prefetch `tokens` through the controller's prefetch threads, as SGLang's scheduler
    drives them: the hit query, host pages for the hit, the transfer, the acks to the last.
    The host indices (None where nothing hit), the tokens that arrived, and the seconds it took.
    Raises queue.Empty where an ack does not come within `WAIT_S` (a stuck request)."""
    start = time.monotonic()
    hybrid = isinstance(ctl, sg.hybrid_cache_controller.HybridCacheController)
    ctl.prefetch(sg.base_prefix_cache.CacheRequestHandle(rid, 0) if hybrid else rid, tokens)
    op = ctl.prefetch_hit_queue.get(timeout=WAIT_S)
    if op.storage_hit_count == 0:
        return None, 0, time.monotonic() - start
    op.host_indices = host.alloc(op.storage_hit_count)
    ctl.prefetch_buffer.put(op)
    done = 0
    while True:
        ack = ctl.ack_prefetch_queue.get(timeout=WAIT_S)
        if ack.completed_tokens is not None:
            done = ack.completed_tokens
        if ack.completed_req:
            return op.host_indices, done, time.monotonic() - start


def page_bytes(host: Any, indices: Any, page: int) -> Any:
    """The bytes of the `page`-th page of `indices`, read through SGLang's own page view."""
    import torch

    return host.get_data_page(int(indices[page * P]), flat=True).view(torch.uint8).clone()


def fill(host: Any, seed: int) -> None:
    """Give every byte of the host pool a value of the seed's."""
    import torch

    raw = host.kv_buffer.view(torch.uint8)
    g = torch.Generator().manual_seed(seed)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
