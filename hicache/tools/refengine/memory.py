"""KV memory as an engine keeps it: a paged pool for full-attention layers, rings for sliding ones.

- Full-attention layers share ONE page-first pool tensor
  ``[num_blocks, n_full_layers, 2, page_tokens, n_kv_heads, head_dim]``: block ``i`` is one page,
  the K and V of ``page_tokens`` tokens for every full layer. A sequence owns a list of blocks (its
  block table); token ``t`` lives in block ``table[t // page_tokens]`` at offset
  ``t % page_tokens``.
- Sliding-window layers keep only the last keys: each sequence holds a *state slot*, a ring of
  ``ring_tokens = (W - 1) + history_tokens`` positions per sliding layer; position ``t`` lives at
  ring index ``t % ring_tokens``. ``W - 1`` positions are what the next query needs; the
  ``history_tokens`` slack lets the state at an earlier page boundary still be read out.
- The *state* at a page boundary ``b`` is the K/V of positions ``b - W + 1 .. b - 1`` of every
  sliding layer (zeros for negative positions), laid out ``[n_sliding, 2, W - 1, heads, dim]``.
  `RingStates` exposes it to hicache as opaque bytes.
"""

from __future__ import annotations

import torch

from hicache.tools.refengine.config import ModelConfig


class KVMemory:
    """Block pool, ring pool and their free lists, on one device."""

    def __init__(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        page_tokens: int,
        num_slots: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        state_boundaries: int = 2,
    ) -> None:
        if num_blocks <= 0 or page_tokens <= 0 or num_slots <= 0:
            raise ValueError("num_blocks, page_tokens and num_slots must be positive")
        if state_boundaries < 1:
            raise ValueError("state_boundaries must be at least 1")
        self.cfg = cfg
        self.page_tokens = page_tokens
        self.device = torch.device(device)
        self.dtype = dtype
        self.full_index = {layer: i for i, layer in enumerate(cfg.full_layers)}
        self.sliding_index = {layer: i for i, layer in enumerate(cfg.sliding_layers)}
        shape = (num_blocks, len(self.full_index), 2, page_tokens, cfg.num_kv_heads, cfg.head_dim)
        self.pool = torch.zeros(shape, dtype=dtype, device=self.device)
        self.window = cfg.sliding_window or 0
        # The state at boundary b may be read while n - b <= history_tokens tokens came after it.
        self.history_tokens = state_boundaries * page_tokens
        self.ring_tokens = 0
        self.rings: torch.Tensor | None = None
        if self.sliding_index:
            self.ring_tokens = self.window - 1 + self.history_tokens
            rshape = (
                num_slots,
                len(self.sliding_index),
                2,
                self.ring_tokens,
                cfg.num_kv_heads,
                cfg.head_dim,
            )
            self.rings = torch.zeros(rshape, dtype=dtype, device=self.device)
        self.slot_len = [0] * num_slots
        self._free_blocks = list(range(num_blocks - 1, -1, -1))
        self._free_slots = list(range(num_slots - 1, -1, -1))

    # -- allocation ---------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return int(self.pool.shape[0])

    @property
    def free_blocks(self) -> int:
        return len(self._free_blocks)

    def alloc_blocks(self, n: int) -> list[int] | None:
        """`n` free block ids, or None (nothing taken) when fewer are free."""
        if n > len(self._free_blocks):
            return None
        return [self._free_blocks.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free_blocks.extend(reversed(blocks))

    def alloc_slot(self) -> int | None:
        if not self._free_slots:
            return None
        slot = self._free_slots.pop()
        self.slot_len[slot] = 0
        return slot

    def free_slot(self, slot: int) -> None:
        self._free_slots.append(slot)

    # -- full-attention pages -----------------------------------------------------------------

    def write_full(
        self,
        layer: int,
        blocks: torch.Tensor,
        offsets: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Store K/V rows ``[T, heads, dim]`` at (block, offset) pairs of one full layer."""
        fl = self.full_index[layer]
        self.pool[blocks, fl, 0, offsets] = k
        self.pool[blocks, fl, 1, offsets] = v

    def read_full(
        self, layer: int, table: torch.Tensor, length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[length, heads, dim]`` of a sequence's first `length` tokens."""
        fl = self.full_index[layer]
        pages = -(-length // self.page_tokens)
        kv = self.pool[table[:pages], fl]  # [pages, 2, P, H, D]
        h, d = kv.shape[-2:]
        k = kv[:, 0].reshape(-1, h, d)[:length]
        v = kv[:, 1].reshape(-1, h, d)[:length]
        return k, v

    # -- sliding rings ------------------------------------------------------------------------

    def _ring(self, layer: int, slot: int) -> torch.Tensor:
        if self.rings is None:
            raise ValueError("this model has no sliding layers")
        return self.rings[slot, self.sliding_index[layer]]  # [2, R, H, D]

    def read_ring(
        self, layer: int, slot: int, start: int, end: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions ``start .. end - 1`` (all still in the ring)."""
        if end - start > self.ring_tokens or start < 0:
            raise ValueError(f"positions {start}..{end} are not all in the ring")
        idx = torch.arange(start, end, device=self.device) % self.ring_tokens
        ring = self._ring(layer, slot)
        return ring[0, idx], ring[1, idx]

    def write_ring(
        self, layer: int, slot: int, start: int, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store K/V of positions ``start ..`` on; only the last `ring_tokens` of them stay."""
        n = k.shape[0]
        keep = min(n, self.ring_tokens)
        first = start + n - keep
        idx = torch.arange(first, start + n, device=self.device) % self.ring_tokens
        ring = self._ring(layer, slot)
        ring[0, idx] = k[n - keep :]
        ring[1, idx] = v[n - keep :]


class RingStates:
    """hicache's `StateHooks` over a `KVMemory`'s rings: the state at a page boundary as bytes."""

    def __init__(self, memory: KVMemory) -> None:
        if memory.rings is None:
            raise ValueError("RingStates needs a model with sliding layers")
        self.memory = memory
        m = memory
        self._span = m.window - 1
        self._shape = (len(m.sliding_index), 2, self._span, m.cfg.num_kv_heads, m.cfg.head_dim)
        elems = 1
        for s in self._shape:
            elems *= s
        self.state_bytes: int = elems * torch.empty((), dtype=m.dtype).element_size()
        self.history_tokens: int = m.history_tokens

    def _check(self, slot: int, boundary: int, buf: torch.Tensor, name: str) -> None:
        m = self.memory
        if not 0 <= slot < len(m.slot_len):
            raise ValueError(f"slot {slot} is out of range")
        n = m.slot_len[slot]
        if boundary % m.page_tokens:
            raise ValueError(f"boundary {boundary} is not a multiple of {m.page_tokens}")
        if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() != self.state_bytes:
            raise ValueError(f"{name} must be a 1-D uint8 tensor of {self.state_bytes} bytes")
        if name == "out" and not n - self.history_tokens <= boundary <= n:
            raise ValueError(
                f"boundary {boundary} is outside [{n - self.history_tokens}, {n}] "
                f"(slot {slot} has processed {n} tokens)"
            )

    def _positions(self, boundary: int) -> tuple[int, torch.Tensor]:
        start = boundary - self._span
        pos = torch.arange(max(start, 0), boundary, device=self.memory.device)
        return max(0, -start), pos % max(self.memory.ring_tokens, 1)

    def save_state(self, slot: int, boundary: int, out: torch.Tensor) -> None:
        """Write the state at `boundary` into `out` (CPU uint8); async on the current stream."""
        self._check(slot, boundary, out, "out")
        m = self.memory
        assert m.rings is not None
        pad, idx = self._positions(boundary)
        state = torch.zeros(self._shape, dtype=m.dtype, device=m.device)
        if idx.numel():
            state[:, :, pad:] = m.rings[slot][:, :, idx]
        out.copy_(state.view(-1).view(torch.uint8), non_blocking=m.device.type == "cuda")

    def load_state(self, slot: int, boundary: int, src: torch.Tensor) -> None:
        """Set the slot's rings so that the sequence resumes at position `boundary`."""
        self._check(slot, boundary, src, "src")
        m = self.memory
        assert m.rings is not None
        state = src.to(m.device, non_blocking=True).view(m.dtype).view(self._shape)
        pad, idx = self._positions(boundary)
        if idx.numel():
            m.rings[slot][:, :, idx] = state[:, :, pad:]
        m.slot_len[slot] = boundary
