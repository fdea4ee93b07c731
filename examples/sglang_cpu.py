"""hicache under SGLang, on a CPU, without a model: SGLang's own cache controller (with its
storage threads) backs a prompt's pages up through hicache's tiers, and a second controller, a
second SGLang instance, prefetches them back, byte for byte. A check of a configuration before
a server is launched with it (docs/sglang.md; run as written by tests/test_sglang_docs.py).

    python examples/sglang_cpu.py configs/sglang/disk.yaml

The controller is the one SGLang's server builds for a plain (full-attention) model: its
`HybridCacheController` over a `HostPoolGroup` whose one pool is the KV host pool. The pools are
small and shaped as a model's would be (bf16 KV, 2 KV heads of 64, 4 layers, pages of 16
tokens); TP rank 0 of 1 is stated to SGLang's runtime context, which a server publishes itself.
Each page's bytes are a function of its tokens, as a model's KV is: the example can be run again
and again on the same directory (a later run finds the pages stored already, and reads back the
same bytes).
"""

from __future__ import annotations

import argparse
import threading

import torch

from hicache.integrations.sglang.cpu_imports import without_torchvision

without_torchvision()  # SGLang's model configs import torchvision, which a CPU torch lacks

from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import PoolName  # noqa: E402
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (  # noqa: E402
    HybridCacheController,
)
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_pool_entry  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host import HostPoolGroup  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.utils import get_hash_str  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402

PAGE = 16
PAGES = 16
WAIT_S = 60.0


def instance(config: str) -> tuple[HybridCacheController, MHATokenToKVPoolHost]:
    """A controller with hicache's backend over a host pool of its own, threads running."""
    device = MHATokenToKVPool(
        size=512, page_size=PAGE, dtype=torch.bfloat16, head_num=2, head_dim=64, layer_num=4,
        device="cpu", enable_memory_saver=False, enable_alt_stream=False,
    )  # fmt: skip
    host = MHATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, "page_first",
        pin_memory=False, device="cpu", device_capacity_tokens=512, start_layer=0, end_layer=4,
    )  # fmt: skip
    group = HostPoolGroup([
        build_pool_entry(
            name=PoolName.KV, host_pool=host, device_pool=device,
            layer_mapping={i: i for i in range(4)}, transfer_layer_id_max=4, is_anchor=True,
        )
    ])  # fmt: skip
    allocator = PagedTokenToKVPoolAllocator(512, PAGE, torch.int64, "cpu", device, False)
    extra = {
        "backend_name": "hicache", "module_path": "hicache.integrations.sglang",
        "class_name": "HiCacheBackend", "interface_v1": 1, "config": config,
    }  # fmt: skip
    ranks = dict(attn_dcp_size=1, attn_dcp_rank=0, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
    with get_parallel().override(**ranks):
        controller = HybridCacheController(
            allocator, group, PAGE, None, threading.Event(), storage_backend="dynamic",
            model_name="example-model", storage_backend_extra_config=extra,
            transfer_layer_id_max=4,
        )  # fmt: skip
    return controller, host


def fill(host: MHATokenToKVPoolHost, slots: torch.Tensor, keys: list[str]) -> None:
    """Give each page of `slots` bytes drawn from its key (a hash of its tokens and all before)."""
    for i, key in enumerate(keys):
        draw = torch.Generator().manual_seed(int(key[:15], 16))
        page = host.get_data_page(int(slots[i * PAGE])).view(torch.uint8)
        page.copy_(torch.randint(0, 256, page.shape, dtype=torch.uint8, generator=draw))


def page_bytes(host: MHATokenToKVPoolHost, slots: torch.Tensor, i: int) -> torch.Tensor:
    """The bytes of the `i`-th page of `slots` (as bytes: random bf16 holds NaNs)."""
    return host.get_data_page(int(slots[i * PAGE])).view(torch.uint8).clone()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="a hicache YAML of store tiers (configs/sglang/disk.yaml)")
    args = parser.parse_args()
    tokens = list(range(1000, 1000 + PAGES * PAGE))

    keys = get_hash_str(tokens, page_size=PAGE)
    first, host = instance(args.config)
    slots = host.alloc(len(tokens))
    fill(host, slots, keys)
    first.write_storage(slots, tokens, hash_value=keys)
    stored = first.ack_backup_queue.get(timeout=WAIT_S).completed_tokens // PAGE
    pages = [page_bytes(host, slots, i) for i in range(PAGES)]
    tiers = ", ".join(t.name for t in first.storage_backend.tiers.tiers)
    first.detach_storage_backend()
    print(f"stored {stored} pages of {PAGE} tokens through hicache's tiers: {tiers}")

    second, host = instance(args.config)
    second.prefetch(CacheRequestHandle("request-1", 0), tokens)
    hit = second.prefetch_hit_queue.get(timeout=WAIT_S)
    hit.host_indices = host.alloc(hit.storage_hit_count)
    second.prefetch_buffer.put(hit)
    arrived = 0
    while True:
        ack = second.ack_prefetch_queue.get(timeout=WAIT_S)
        arrived = ack.completed_tokens if ack.completed_tokens is not None else arrived
        if ack.completed_req:
            break
    exact = sum(
        torch.equal(page_bytes(host, hit.host_indices, i), pages[i]) for i in range(arrived // PAGE)
    )
    second.detach_storage_backend()
    print(f"a second instance prefetched {exact} of {PAGES} pages, byte for byte")


if __name__ == "__main__":
    main()
