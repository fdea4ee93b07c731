"""`PagedBuffer`: how the pages of one pool lie in memory.

A page is the KV of `page_tokens` tokens. Engines lay it out in one of two ways:

- *page-first*: one tensor whose dim 0 is the block id; a page is one contiguous row;
- *segmented* (layer-first): one tensor per layer (or per layer and K/V); a page is one row in
  each of them.

Both are described the same way here: a page is the concatenation of row `i` of each *segment*,
where a segment is a 2-D ``uint8`` view ``[num_pages, seg_bytes]`` whose rows may be strided but
whose bytes within a row are contiguous. Copies between two buffers (`copy_pages`) work segment by
segment, so both sides must agree on the segment sizes; `PagedBuffer.resegment` re-views a
page-first buffer (such as a host pool) with another buffer's segment sizes at no cost.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch

#: Every segment's address, row stride and row size must be a multiple of this many bytes.
ALIGNMENT = 16


@dataclass(frozen=True, eq=False)
class PagedBuffer:
    """Pages addressed by integer id; page `i` is row `i` of every segment, in order.

    Guarantees: every segment is a 2-D uint8 tensor with the same number of rows, on the same
    device, with contiguous bytes inside a row. The buffer keeps its tensors alive. Buffers
    compare and hash by identity; what is derived from the tensors is computed once.
    """

    segments: tuple[torch.Tensor, ...]
    parent: PagedBuffer | None = field(default=None, repr=False)
    """The single-segment buffer that `resegment` cut this one from, if any."""

    def __post_init__(self) -> None:
        if not self.segments:
            raise ValueError("PagedBuffer needs at least one segment")
        first = self.segments[0]
        for i, seg in enumerate(self.segments):
            if seg.dtype != torch.uint8 or seg.dim() != 2:
                raise ValueError(
                    f"segment {i} must be a 2-D uint8 view [num_pages, seg_bytes], "
                    f"got dtype {seg.dtype} with shape {tuple(seg.shape)}"
                )
            if seg.shape[1] > 1 and seg.stride(1) != 1:
                raise ValueError(f"segment {i}: bytes within a page row must be contiguous")
            if seg.shape[0] != first.shape[0]:
                raise ValueError(
                    f"segment {i} has {seg.shape[0]} pages, segment 0 has {first.shape[0]}"
                )
            if seg.device != first.device:
                raise ValueError(f"segment {i} is on {seg.device}, segment 0 on {first.device}")

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def page_first(cls, pool: torch.Tensor) -> PagedBuffer:
        """A pool whose dim 0 indexes pages and whose pages are contiguous rows."""
        if pool.dim() < 1 or pool.shape[0] == 0:
            raise ValueError(f"a page-first pool needs a non-empty dim 0, got {tuple(pool.shape)}")
        if not _rows_contiguous(pool):
            raise ValueError("a page-first pool must hold each page contiguously (dim 0 outermost)")
        rows = pool.shape[0]
        flat = pool.view(rows, -1) if pool.dim() > 1 else pool.view(rows, 1)
        return cls((flat.view(torch.uint8),))

    @classmethod
    def layer_first(cls, tensors: Sequence[torch.Tensor]) -> PagedBuffer:
        """One tensor per layer (or per layer and K/V), each with dim 0 indexing pages."""
        if not tensors:
            raise ValueError("layer_first needs at least one tensor")
        return cls(tuple(cls.page_first(t).segments[0] for t in tensors))

    @classmethod
    def from_kv_tensors(cls, tensors: Sequence[torch.Tensor], *, kv_dim: int = 0) -> PagedBuffer:
        """vLLM's per-layer KV caches: one tensor per layer, in layer order, each holding the K
        and the V of every block, with K at index 0 and V at index 1 of dim `kv_dim`.

        - ``kv_dim=0``: ``(2, num_blocks, ...)``, as vLLM's FlashAttention backend
          (``(2, num_blocks, block_size, num_kv_heads, head_size)``) and its CPU backend;
        - ``kv_dim=1``: ``(num_blocks, 2, ...)``, K and V of a block side by side (FlashInfer).

        Page ``i`` is block ``i``: for each layer in order, its K bytes, then its V bytes. Two
        segments per layer whatever `kv_dim`, so the segment sizes (``Layout.segments``: pass
        `seg_bytes`) do not depend on it. The tensors stay where they are (separate allocations,
        any dtype, GPU or CPU); no bytes move. The dims after the block (and K/V) dim may be
        permuted views, as vLLM's stride orders make them, if one block's K (and V) still fills
        one dense run of memory: a page holds those bytes as they lie in memory. Raises
        ValueError naming the tensor otherwise, or when the layers' block counts differ.
        """
        if kv_dim not in (0, 1):
            raise ValueError(f"kv_dim must be 0 or 1, got {kv_dim}")
        if not tensors:
            raise ValueError("from_kv_tensors needs at least one tensor")
        segments = []
        for layer, t in enumerate(tensors):
            if t.dim() < 3 or t.shape[kv_dim] != 2:
                raise ValueError(
                    f"layer {layer}: expected K and V at dim {kv_dim} (size 2) and a block dim, "
                    f"got shape {tuple(t.shape)}"
                )
            for kv in (0, 1):
                half = t.select(kv_dim, kv)  # dim 0 is the block now
                if not _rows_contiguous(_in_memory_order(half)):
                    raise ValueError(
                        f"layer {layer}, {'KV'[kv]}: a block is not one dense run of memory "
                        f"(shape {tuple(half.shape)}, strides {half.stride()})"
                    )
                segments.append(cls.page_first(_in_memory_order(half)).segments[0])
        return cls(tuple(segments))

    # -- properties ---------------------------------------------------------------------------

    @property
    def num_pages(self) -> int:
        return int(self.segments[0].shape[0])

    @cached_property
    def seg_bytes(self) -> tuple[int, ...]:
        return tuple(int(s.shape[1]) for s in self.segments)

    @cached_property
    def page_bytes(self) -> int:
        return sum(self.seg_bytes)

    @property
    def device(self) -> torch.device:
        return self.segments[0].device

    @cached_property
    def rows(self) -> torch.Tensor:
        """int64 ``[num_segments, 3]``: per segment, the address of page 0's row, the bytes from
        one page's row to the next, and the bytes in a row. Computed once per buffer."""
        return torch.tensor(
            [[s.data_ptr(), s.stride(0), s.shape[1]] for s in self.segments], dtype=torch.int64
        )

    @cached_property
    def pinned(self) -> bool:
        """True when every segment lies in page-locked host memory. Computed once per buffer."""
        return self.device.type == "cpu" and all(s.is_pinned() for s in self.segments)

    @cached_property
    def misalignment(self) -> str | None:
        """What is not a multiple of `ALIGNMENT` bytes (a segment's address, row stride or row
        size), or None. Computed once per buffer."""
        for seg, (address, stride, size) in enumerate(self.rows.tolist()):
            for what, value in (("row size", size), ("row stride", stride), ("address", address)):
                if value % ALIGNMENT:
                    return f"segment {seg}: {what} {value} is not a multiple of {ALIGNMENT} bytes"
        return None

    def resegment(self, seg_bytes: Sequence[int]) -> PagedBuffer:
        """Re-view a single-segment (page-first) buffer as `seg_bytes` consecutive segments.

        No bytes move: segment `k` is the column range of the page row that starts at the sum of
        the sizes before it. Used to copy between a page-first host pool and a segmented engine
        pool with one call.
        """
        seg_bytes = tuple(int(b) for b in seg_bytes)
        if seg_bytes == self.seg_bytes:
            return self
        if len(self.segments) != 1:
            raise ValueError("only a single-segment buffer can be re-segmented")
        if sum(seg_bytes) != self.page_bytes:
            raise ValueError(
                f"segments of {sum(seg_bytes)} bytes in all do not fit pages of "
                f"{self.page_bytes} bytes"
            )
        rows, parts, offset = self.segments[0], [], 0
        for size in seg_bytes:
            parts.append(rows[:, offset : offset + size])
            offset += size
        return PagedBuffer(tuple(parts), parent=self)

    def by_layer(self, layers: int) -> list[PagedBuffer]:
        """The buffer cut into `layers` buffers, one per layer, in order: a segmented buffer's
        segments in equal runs (a layer's K and V side by side), a single-segment buffer's rows
        in equal column ranges (its pages must hold the layers one after another). No bytes
        move. ValueError when the layers do not divide the buffer evenly."""
        if layers < 1:
            raise ValueError(f"layers must be at least 1, got {layers}")
        if len(self.segments) == 1:
            if self.page_bytes % layers:
                raise ValueError(
                    f"pages of {self.page_bytes} bytes do not split into {layers} equal layers"
                )
            whole = self.resegment([self.page_bytes // layers] * layers)
        elif len(self.segments) % layers:
            raise ValueError(
                f"{len(self.segments)} segments do not split into {layers} equal layers"
            )
        else:
            whole = self
        per = len(whole.segments) // layers
        return [PagedBuffer(whole.segments[i * per : (i + 1) * per]) for i in range(layers)]

    @property
    def whole_pages(self) -> PagedBuffer | None:
        """The same pages as one segment of whole, contiguous pages, where they are (a page-first
        buffer, or one re-segmented from it); None for a layer-first buffer."""
        return self if len(self.segments) == 1 else self.parent


def _in_memory_order(t: torch.Tensor) -> torch.Tensor:
    """`t` with the dims after dim 0 permuted into memory order (largest stride first)."""
    rest = sorted(range(1, t.dim()), key=lambda d: t.stride(d), reverse=True)
    return t.permute(0, *rest)


def _rows_contiguous(t: torch.Tensor) -> bool:
    """True when every dim-0 row of `t` is one contiguous run of memory."""
    expected = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:]), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True
