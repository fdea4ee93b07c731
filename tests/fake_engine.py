"""A model-less engine that owns a real KV pool and embeds hicache through its public API.

The KV of a page is a deterministic function of all tokens up to the page's end (as a real
model's is), so any byte loaded from the wrong prefix, tenant or layout shows up as a mismatch.
States (for hybrid layouts) are likewise a function of the tokens before their boundary.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable

import numpy as np
import torch

from hicache import HiCache, HiCacheConfig, Layout, Match, PagedBuffer, load_config


def kv_bytes(tokens: np.ndarray, end: int, size: int, tag: bytes = b"") -> np.ndarray:
    """What a model would write for the page (or state) ending at token `end`."""
    seed = hashlib.sha256(tag + tokens[:end].astype(np.int32).tobytes()).digest()
    reps = -(-size // len(seed))
    return np.frombuffer((seed * reps)[:size], dtype=np.uint8)


class FakeStates:
    """State hooks over a pool of per-sequence state slots, with a bounded history."""

    def __init__(self, slots: int, state_bytes: int, history_tokens: int) -> None:
        self.state_bytes = state_bytes
        self.history_tokens = history_tokens
        self.pool = torch.zeros(slots, state_bytes, dtype=torch.uint8)
        self.tokens: dict[int, np.ndarray] = {}  # what each slot has processed
        self.fail: str | None = None  # name of a hook that should raise

    def save_state(self, slot: int, boundary: int, out: torch.Tensor) -> None:
        if self.fail == "save_state":
            raise RuntimeError("ring buffer is gone")
        toks = self.tokens[slot]
        if boundary < len(toks) - self.history_tokens or boundary > len(toks):
            raise ValueError(f"boundary {boundary} is outside the slot's history")
        out.copy_(torch.from_numpy(kv_bytes(toks, boundary, self.state_bytes, b"state").copy()))

    def load_state(self, slot: int, boundary: int, src: torch.Tensor) -> None:
        if self.fail == "load_state":
            raise RuntimeError("slot is busy")
        self.pool[slot].copy_(src)
        self.loaded_at = boundary


class FakeEngine:
    """Owns a page-first (or layer-first) uint8 pool; "computes" KV by writing kv_bytes."""

    def __init__(
        self,
        config: HiCacheConfig | dict,
        *,
        num_blocks: int = 64,
        layout: Layout | None = None,
        layer_first: int = 0,
        states: FakeStates | None = None,
        wake: Callable[[], None] | None = None,
    ) -> None:
        if isinstance(config, dict):
            config = load_config(config, env={})
        self.layout = layout or config.layout
        assert self.layout is not None
        size = self.layout.page_size
        if layer_first:
            seg = size // layer_first
            self.layers = [
                torch.zeros(num_blocks, seg, dtype=torch.uint8) for _ in range(layer_first)
            ]
            buffer = PagedBuffer.layer_first(self.layers)
            self.layout = self.layout.model_copy(update={"segments": (seg,) * layer_first})
        else:
            self.pool = torch.zeros(num_blocks, size, dtype=torch.uint8)
            buffer = PagedBuffer.page_first(self.pool)
        self.buffer = buffer
        self.states = states
        self.cache = HiCache(config, buffer, layout=self.layout, states=states, wake=wake)
        if not self.cache.wait_ready(120):
            raise RuntimeError("the host tier was not allocated in 120 s")
        self.free = list(range(num_blocks - 1, -1, -1))

    @property
    def P(self) -> int:
        return self.layout.page_tokens

    def page(self, block: int) -> np.ndarray:
        rows = [seg[block] for seg in self.buffer.segments]
        return torch.cat(rows).numpy()

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError("out of blocks")
        return [self.free.pop() for _ in range(n)]

    def compute(self, tokens: np.ndarray, blocks: list[int], from_page: int) -> None:
        """Write the KV of full pages from `from_page` on, as a prefill would."""
        for i in range(from_page, len(tokens) // self.P):
            data = kv_bytes(tokens, (i + 1) * self.P, self.layout.page_size)
            offset = 0
            for seg in self.buffer.segments:
                width = seg.shape[1]
                seg[blocks[i]].copy_(torch.from_numpy(data[offset : offset + width].copy()))
                offset += width

    def match(self, rid: str, tokens: np.ndarray, salt: str | None = None) -> Match:
        """Match, asking again (one engine step apart) while an L3 lookup is pending."""
        m = self.cache.match(rid, tokens, salt=salt)
        deadline = time.monotonic() + 300
        while m.pending:
            if time.monotonic() > deadline:
                raise AssertionError(f"request {rid}: still pending after 300 s")
            time.sleep(0.002)
            self.cache.poll()
            m = self.cache.match(rid, tokens, salt=salt)
        return m

    def run(self, rid: str, tokens: np.ndarray, salt: str | None = None, slot: int = 0) -> Match:
        """One request: match, allocate, load, check the loaded bytes, prefill, store, release."""
        m = self.match(rid, tokens, salt=salt)
        blocks = self.allocate(-(-len(tokens) // self.P))
        try:
            self.cache.load(m, blocks, state_slot=slot if m.needs_state else None)
            self.cache.poll()
            for i in range(m.load_pages):
                want = kv_bytes(tokens, (i + 1) * self.P, self.layout.page_size)
                got = self.page(blocks[i])
                if not np.array_equal(got, want):
                    raise AssertionError(f"request {rid}: page {i} loaded wrong bytes")
            if m.needs_state:
                want = kv_bytes(tokens, m.hit_tokens, self.layout.state_bytes, b"state")
                if not np.array_equal(self.states.pool[slot].numpy(), want):
                    raise AssertionError(f"request {rid}: wrong state at {m.hit_tokens}")
            self.compute(tokens, blocks, m.hit_tokens // self.P)
            if self.states is not None:
                self.states.tokens[slot] = tokens
            self.cache.store(rid, tokens, blocks, state_slot=slot if self.states else None)
            self.cache.poll()
        finally:
            self.cache.release(rid)
            self.free.extend(blocks)
        return m


def settle(engine: FakeEngine, timeout: float = 120) -> None:
    """Poll until no store tier has work queued or running."""
    deadline = time.monotonic() + timeout
    while not engine.cache.tiers_idle:
        if time.monotonic() > deadline:
            raise AssertionError("the store tiers did not settle in time")
        engine.cache.poll()
        time.sleep(0.005)
    engine.cache.poll()


PATIENT_WAIT_MS = 600_000.0
"""`Policy.fetch_max_wait_ms` of the tests' configurations: ten minutes, that is no deadline."""


def config(
    page_tokens: int = 4,
    page_bytes: int = 64,
    host_pages: int = 32,
    state_bytes: int = 0,
    state_slots: int = 8,
    **policy: object,
) -> dict:
    """A small configuration as a mapping (tests load it with env={}). A request waits for the
    store tiers as long as they take (`PATIENT_WAIT_MS`) unless `fetch_max_wait_ms` is given:
    a test that is not about that deadline must not depend on how fast the machine is."""
    policy = {"fetch_max_wait_ms": PATIENT_WAIT_MS, **policy}
    return {
        "layout": {
            "model": "test-model",
            "kv_dtype": "bfloat16",
            "page_tokens": page_tokens,
            "page_bytes": page_bytes,
            "state_bytes": state_bytes,
        },
        "tiers": [{"type": "host", "size": host_pages * page_bytes, "state_slots": state_slots}],
        "policy": dict(policy),
    }
