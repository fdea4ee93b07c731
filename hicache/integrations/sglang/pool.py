"""SGLang's host pool as hicache's store tiers see it: page slots of a `PagedBuffer`, with no
copy. Imports no SGLang: it reads the pool through the methods every SGLang host pool with
zero-copy storage has (`page_size`, `size`, `layout`, `dtype`, `kv_buffer`,
`get_page_buffer_meta`).

SGLang's host page ``i`` holds the tokens ``[i * page_size, (i + 1) * page_size)`` of the pool;
where its bytes lie depends on the pool's layout (``layer_first``, ``page_first``,
``page_first_direct``, ``page_head``; MHA or MLA). `EnginePages` asks SGLang's own address API,
`get_page_buffer_meta` (the addresses and sizes SGLang's zero-copy backends move a page by),
for the first two pages: the runs of a page are the same in every page, a fixed step apart;
each run is a segment of the `PagedBuffer` (K and V of each layer for an MHA ``layer_first``
pool, K and V for MHA's page-first layouts, each layer for MLA's ``layer_first``, one for MLA's
page-first ones). An object holds a page's runs in SGLang's order, so the layout and the runs go
into the namespace.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hicache.kernels import PagedBuffer

GEOMETRY = (
    "layer_num", "start_layer", "end_layer", "head_num", "head_dim", "v_head_dim",
    "kv_lora_rank", "qk_rope_head_dim", "kv_cache_dim",
)  # fmt: skip
"""The pool's attributes that name what its bytes mean (those it has go into the namespace)."""


@dataclass(frozen=True)
class Count:
    capacity: int


class EnginePages:
    """An SGLang host pool's pages as slots (a `hicache.chain.jobs.SlotMemory`): slot ``i`` is
    host page ``i``; no state slots. `memory` is the tensor a store tier registers. Raises
    ValueError naming the layout where the pool's pages are not runs a fixed step apart."""

    state_slots = Count(0)

    def __init__(self, pool: Any) -> None:
        self.page_tokens = P = int(pool.page_size)
        self.memory: torch.Tensor = pool.kv_buffer
        layout = getattr(pool, "layout", "?")
        n = int(pool.size) // P
        try:
            ptrs, sizes = pool.get_page_buffer_meta(torch.arange(2 * P))
            last = pool.get_page_buffer_meta(torch.arange((n - 1) * P, n * P))[0]
        except (ValueError, NotImplementedError, AttributeError, AssertionError) as err:
            why = f"hicache: SGLang's host layout {layout!r} is not supported: {err}"
            raise ValueError(why) from err
        self.pages = PagedBuffer(_runs(self.memory, ptrs, sizes, last, n, layout))
        self.page_slots = Count(n)
        known = {a: getattr(pool, a) for a in GEOMETRY if isinstance(getattr(pool, a, None), int)}
        self.description = f"sglang:{type(pool).__name__}:{layout}:{known}:{RUNS}"
        """What goes into the namespace beside the runs' sizes: the pool's kind, layout and
        geometry, and where the runs' order comes from."""

    @property
    def page_bytes(self) -> int:
        return self.pages.page_bytes

    def state(self, slot: int) -> torch.Tensor:
        raise ValueError("hicache: SGLang's host pool has no state slots")

    def slots(self, host_indices: torch.Tensor, pages: int) -> list[int]:
        """The host pages of `pages` pages' token slots (SGLang hands ``pages * page_size``
        slots, page by page); ValueError where they are not whole pages in order."""
        P = self.page_tokens
        idx = host_indices.reshape(-1).to("cpu", torch.int64)
        if idx.numel() != pages * P:
            raise ValueError(f"hicache: {idx.numel()} host slots for {pages} pages of {P} tokens")
        if not pages:
            return []
        rows = idx.view(pages, P)
        starts = rows[:, 0]
        whole = bool((starts % P == 0).all()) and bool(
            (rows == starts[:, None] + torch.arange(P)).all()
        )
        slots = (starts // P).tolist()
        if not whole or max(slots) >= self.page_slots.capacity or min(slots) < 0:
            raise ValueError("hicache: SGLang's host slots are not whole pages of its pool")
        return slots


RUNS = "runs-of-get_page_buffer_meta"
"""Names the order of a page's runs in an object: SGLang's address API's (objects of the
earlier order, from the pool's page views, are in another namespace)."""


def _runs(
    memory: torch.Tensor,
    ptrs: Sequence[int],
    sizes: Sequence[int],
    last: Sequence[int],
    n: int,
    layout: str,
) -> tuple[torch.Tensor, ...]:
    """The segments of `n` pages whose runs SGLang gives as `ptrs` and `sizes` for the first
    two pages (the first page's runs, then the second's) and as `last` for the last page: run
    ``j`` of page ``i`` is `sizes[j]` bytes at ``ptrs[j] + i * step_j``, inside `memory`.
    ValueError naming the layout where they are not (runs outside the pool's one buffer, pages
    that are not a fixed step apart)."""
    if not memory.is_contiguous():
        raise ValueError(f"hicache: SGLang's host layout {layout!r}: the pool is not contiguous")
    k = len(ptrs) // 2
    first, second = [int(p) for p in ptrs[:k]], [int(p) for p in ptrs[k:]]
    row_bytes = [int(x) for x in sizes[:k]]
    flat = memory.reshape(-1).view(torch.uint8)
    start, end = flat.data_ptr(), flat.data_ptr() + flat.numel()
    steps = [b - a for a, b in zip(first, second)]
    fits = (
        k > 0 and len(ptrs) == 2 * k and list(sizes[k:]) == row_bytes and len(last) == k
        and all(s > 0 for s in steps)
        and all(a + (n - 1) * s == int(z) for a, s, z in zip(first, steps, last))
        and all(a >= start and z + r <= end for a, z, r in zip(first, last, row_bytes))
    )  # fmt: skip
    if not fits:
        raise ValueError(
            f"hicache: SGLang's host layout {layout!r}: its pages are not runs a fixed step "
            "apart in the pool's one buffer"
        )
    return tuple(
        flat.as_strided((n, row), (step, 1), flat.storage_offset() + a - start)
        for a, step, row in zip(first, steps, row_bytes)
    )
