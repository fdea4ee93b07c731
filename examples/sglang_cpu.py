"""hicache under SGLang, on a CPU, without a model: SGLang's own cache controller (with its
storage threads) backs a prompt's pages up through hicache's tiers, and a second controller, a
second SGLang instance, prefetches them back, byte for byte. A check of a configuration before
a server is launched with it (docs/sglang.md; run as written by tests/test_sglang_docs.py).

    python examples/sglang_cpu.py configs/sglang/disk.yaml

SGLang's pools here are small and shaped as a model's would be (bf16 KV, 2 KV heads of 64,
4 layers, pages of 16 tokens); the controller is made as SGLang's scheduler makes it, its TP
rank 0 of 1 stated to SGLang's runtime context, which a server publishes itself.
"""

from __future__ import annotations

import argparse
import threading

import torch
from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.utils import get_hash_str
from sglang.srt.runtime_context import get_parallel

PAGE = 16
PAGES = 16
WAIT_S = 60.0


def instance(config: str) -> tuple[HiCacheController, MHATokenToKVPoolHost]:
    """A controller with hicache's backend over a host pool of its own, threads running."""
    device = MHATokenToKVPool(
        size=512, page_size=PAGE, dtype=torch.bfloat16, head_num=2, head_dim=64, layer_num=4,
        device="cpu", enable_memory_saver=False, enable_alt_stream=False,
    )  # fmt: skip
    host = MHATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, "page_first",
        pin_memory=False, device="cpu", device_capacity_tokens=512, start_layer=0, end_layer=4,
    )  # fmt: skip
    allocator = PagedTokenToKVPoolAllocator(512, PAGE, torch.int64, "cpu", device, False)
    extra = {
        "backend_name": "hicache", "module_path": "hicache.integrations.sglang",
        "class_name": "HiCacheBackend", "interface_v1": 1, "config": config,
    }  # fmt: skip
    ranks = dict(attn_dcp_size=1, attn_dcp_rank=0, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
    with get_parallel().override(**ranks):
        controller = HiCacheController(
            allocator, host, PAGE, None, threading.Event(), storage_backend="dynamic",
            model_name="example-model", storage_backend_extra_config=extra,
        )  # fmt: skip
    return controller, host


def page_bytes(host: MHATokenToKVPoolHost, slots: torch.Tensor, i: int) -> torch.Tensor:
    """The bytes of the `i`-th page of `slots` (as bytes: random bf16 holds NaNs)."""
    return host.get_data_page(int(slots[i * PAGE])).view(torch.uint8).clone()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="a hicache YAML of store tiers (configs/sglang/disk.yaml)")
    args = parser.parse_args()
    tokens = list(range(1000, 1000 + PAGES * PAGE))

    first, host = instance(args.config)
    raw = host.kv_buffer.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
    slots = host.alloc(len(tokens))
    first.write_storage(slots, tokens, hash_value=get_hash_str(tokens, page_size=PAGE))
    stored = first.ack_backup_queue.get(timeout=WAIT_S).completed_tokens // PAGE
    pages = [page_bytes(host, slots, i) for i in range(PAGES)]
    tiers = ", ".join(t.name for t in first.storage_backend.tiers.tiers)
    first.detach_storage_backend()
    print(f"stored {stored} pages of {PAGE} tokens through hicache's tiers: {tiers}")

    second, host = instance(args.config)
    second.prefetch("request-1", tokens)
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
