"""SGLang's host pool as hicache's store tiers see it: page slots of a `PagedBuffer`, with no
copy. Imports no SGLang: it reads the pool through the methods every SGLang host pool has
(`page_size`, `size`, `layout`, `dtype`, `kv_buffer`, `get_data_page`).

SGLang's host page ``i`` holds the tokens ``[i * page_size, (i + 1) * page_size)`` of the pool;
where its bytes lie depends on the pool's layout (``layer_first``, ``page_first``,
``page_first_direct``, ``page_head``; MHA or MLA). `EnginePages` finds out from two pages'
views (`get_data_page`): the bytes of a page are the same runs of memory in every page, a fixed
step apart; each run is a segment of the `PagedBuffer` (``2 * layers`` runs for an MHA
``layer_first`` pool, K and V for MHA's page-first layouts, one for MLA's page-first ones). An
object holds a page's runs in that order, so the layout and the runs go into the namespace.
"""

from __future__ import annotations

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
        try:
            first, second = pool.get_data_page(0, flat=False), pool.get_data_page(P, flat=False)
        except (ValueError, NotImplementedError, AttributeError) as err:
            why = f"hicache: SGLang's host layout {layout!r} is not supported: {err}"
            raise ValueError(why) from err
        n = int(pool.size) // P
        self.pages = PagedBuffer(_runs(self.memory, first, second, n, layout))
        self.page_slots = Count(n)
        known = {a: getattr(pool, a) for a in GEOMETRY if isinstance(getattr(pool, a, None), int)}
        self.description = f"sglang:{type(pool).__name__}:{layout}:{known}"
        """What goes into the namespace beside the runs' sizes: the pool's kind, layout and
        geometry."""

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


def _runs(
    memory: torch.Tensor, first: torch.Tensor, second: torch.Tensor, n: int, layout: str
) -> tuple[torch.Tensor, ...]:
    """The segments of `n` pages whose first two pages are the views `first` and `second` of
    `memory`: the runs of bytes of one page (its view's dims merged from the innermost while
    contiguous; each index of the dims left is a run), page ``i``'s run ``i`` steps on."""
    if not memory.is_contiguous():
        raise ValueError(f"hicache: SGLang's host layout {layout!r}: the pool is not contiguous")
    item = first.element_size()
    step = second.data_ptr() - first.data_ptr()
    dims = [(int(k), int(s)) for k, s in zip(first.shape, first.stride()) if k != 1]
    run = 1
    while dims and dims[-1][1] == run:
        run *= dims.pop()[0]
    offsets = [0]
    for k, s in dims:
        offsets = [o + i * s for o in offsets for i in range(k)]
    flat = memory.reshape(-1).view(torch.uint8)
    base = first.data_ptr() - flat.data_ptr()
    row = run * item
    end = flat.numel()
    if step <= 0 or base < 0 or any(base + o * item + (n - 1) * step + row > end for o in offsets):
        raise ValueError(f"hicache: SGLang's host layout {layout!r}: pages are not a step apart")
    return tuple(
        flat.as_strided((n, row), (step, 1), flat.storage_offset() + base + o * item)
        for o in offsets
    )
