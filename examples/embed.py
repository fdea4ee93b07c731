"""Embed hicache in an engine: one prompt computed and stored, then a second request that
starts with the same tokens skips them and loads their KV from the host tier instead.

Runs on the CPU in a second:  python examples/embed.py

The engine owns its KV pool; hicache only copies pages into and out of the blocks the engine
names. The pool here is page-first: one uint8 tensor of shape [num_blocks, page_bytes], where
block b holds the KV of one page (page_tokens tokens) of all layers. For a model with L layers,
H KV heads of D dims and dtype bytes B, a page is

    page_bytes = page_tokens * L * 2 (K and V) * H * D * B

(an engine that keeps one tensor per layer passes `PagedBuffer.layer_first(tensors)` and gives
the layout `segments`, the bytes of a page in each tensor, instead of `page_bytes`).
"""

from __future__ import annotations

import numpy as np
import torch

from hicache import HiCache, Layout, PagedBuffer, load_config

# A small model: 2 layers, 2 KV heads of 16 dims in float16, 16 tokens per page.
PAGE_TOKENS, LAYERS, KV_HEADS, HEAD_DIM, DTYPE_BYTES = 16, 2, 2, 16, 2
PAGE_BYTES = PAGE_TOKENS * LAYERS * 2 * KV_HEADS * HEAD_DIM * DTYPE_BYTES  # 4 KiB
NUM_BLOCKS = 64

config = load_config(
    {
        "tiers": [{"type": "host", "size": "16MiB"}],  # 4096 host slots of one page each
    }
)
layout = Layout(
    model="example-model@v1",  # names the weights: pages of other weights never match
    kv_dtype="float16",
    page_tokens=PAGE_TOKENS,
    page_bytes=PAGE_BYTES,
)
pool = torch.zeros(NUM_BLOCKS, PAGE_BYTES, dtype=torch.uint8)  # the engine's own KV pool
cache = HiCache(config, PagedBuffer.page_first(pool), layout=layout)
# The host pools are allocated in the background. Until they are, `store` drops its pages
# (counted in stats()["pages_dropped"]); an engine need not wait, a script that wants its
# first store kept does. Raises if the host tier could not be allocated.
if not cache.wait_ready(timeout_s=30):
    raise SystemExit("the host tier was not allocated within 30 s")


def prefill(tokens: np.ndarray, blocks: list[int], from_page: int) -> None:
    """Stand-in for the model: write each full page's KV into its block."""
    for i in range(from_page, len(tokens) // PAGE_TOKENS):
        page = tokens[: (i + 1) * PAGE_TOKENS]
        pool[blocks[i]] = torch.from_numpy(np.resize(page.astype(np.uint8), PAGE_BYTES))


def serve(request_id: str, tokens: np.ndarray) -> int:
    """One request as an engine runs it; returns how many prompt tokens hicache supplied."""
    m = cache.match(request_id, tokens)  # numbers only: nothing is copied yet
    blocks = list(range(-(-len(tokens) // PAGE_TOKENS)))  # the engine allocates its blocks
    cache.load(m, blocks[m.first_page :])  # host -> pool, pages first_page...
    prefill(tokens, blocks, m.hit_tokens // PAGE_TOKENS)  # compute only the rest
    cache.store(request_id, tokens, blocks)  # pool -> host: the pages the host lacks
    cache.release(request_id)
    cache.poll()  # every engine step: applies finished copies
    return m.hit_tokens


system_prompt = np.arange(1, 8 * PAGE_TOKENS + 1, dtype=np.int32)  # 8 pages
first = serve("r1", np.concatenate([system_prompt, [900, 901, 902]]).astype(np.int32))
second = serve("r2", np.concatenate([system_prompt, [700, 701]]).astype(np.int32))
print(f"first request: {first} tokens from the cache; second: {second} tokens from the cache")
print(f"host slots used: {cache.stats()['host_used']}")
cache.close()  # frees the host pools (and closes an L3 store's client)
if (first, second) != (0, 8 * PAGE_TOKENS):
    raise SystemExit("expected a miss, then a hit of the 8 shared pages")
