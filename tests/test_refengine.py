"""refengine without hicache: the models match transformers, and resuming from copied KV is exact.

Tiny random-weight checkpoints (float32, CPU) are written with transformers' `save_pretrained` and
loaded by the engine; greedy tokens must equal `generate(do_sample=False)`.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from hicache.tools.refengine.config import FULL, SLIDING, ModelConfig  # noqa: E402
from hicache.tools.refengine.engine import Engine, Request  # noqa: E402
from hicache.tools.refengine.memory import KVMemory, RingStates  # noqa: E402
from hicache.tools.refengine.model import Item, Transformer  # noqa: E402
from hicache.tools.refengine.workload import drive, make_workload  # noqa: E402

PAGE = 16
WINDOW = 48


def _hf_model(family: str, path) -> torch.nn.Module:
    torch.manual_seed(1234)
    common = dict(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        initializer_range=0.1,
    )
    if family == "llama":
        cfg = transformers.LlamaConfig(num_hidden_layers=2, **common)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3Config(
            num_hidden_layers=4,
            use_sliding_window=True,
            sliding_window=WINDOW,
            layer_types=[FULL, SLIDING, SLIDING, FULL],
            **common,
        )
        model = transformers.Qwen3ForCausalLM(cfg)
    model.eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = _hf_model(request.param, path)
    cfg = ModelConfig.from_folder(path)
    return SimpleNamespace(family=request.param, hf=hf, cfg=cfg, model=Transformer.load(cfg, path))


def _engine(ck, cache_factory=None, blocks=256, slots=8, chunk=64) -> Engine:
    mem = KVMemory(ck.cfg, num_blocks=blocks, page_tokens=PAGE, num_slots=slots)
    cache = cache_factory(mem) if cache_factory else None
    return Engine(ck.model, mem, chunk_tokens=chunk, cache=cache)


def _generate(hf, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
            min_new_tokens=n,
        )
    return out[0, len(prompt) :].tolist()


def test_loaded_shape_follows_the_checkpoint(checkpoint):
    cfg = checkpoint.cfg
    if checkpoint.family == "llama":
        assert cfg.layer_types == (FULL, FULL) and cfg.sliding_window is None
    else:
        assert cfg.layer_types == (FULL, SLIDING, SLIDING, FULL)
        assert cfg.sliding_window == WINDOW and cfg.qk_norm


def test_greedy_tokens_equal_transformers_generate(checkpoint):
    """Three prompts longer than the window, prefilled in chunks and decoded in one batch."""
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (203, 150, 97)]
    eng = _engine(checkpoint)
    reqs = [Request(f"r{i}", p, 12) for i, p in enumerate(prompts)]
    eng.run(reqs)
    for req, prompt in zip(reqs, prompts):
        assert req.output == _generate(checkpoint.hf, prompt, 12), req.rid


def test_prefill_logits_match_transformers_for_any_chunking(checkpoint):
    g = torch.Generator().manual_seed(3)
    toks = torch.randint(0, 1000, (170,), generator=g).tolist()
    with torch.no_grad():
        ref = checkpoint.hf(torch.tensor([toks])).logits[0, -1]
    for chunks in ([170], [37, 50, 83], [16] * 10 + [10]):
        mem = KVMemory(checkpoint.cfg, num_blocks=16, page_tokens=PAGE, num_slots=1)
        slot = mem.alloc_slot()
        table = torch.tensor(mem.alloc_blocks(11))
        start = 0
        for n in chunks:
            out = checkpoint.model.forward([Item(toks[start : start + n], start, table, slot)], mem)
            start += n
        torch.testing.assert_close(out[0], ref, rtol=0, atol=1e-5)


# -- resuming from copied KV (a toy prefix cache standing in for hicache) ---------------------


class CopyCache:
    """Copies of pages (and states at the last two boundaries) keyed by the token prefix.

    Follows the engine's cache contract: match / load / store / poll / release.
    """

    def __init__(self, memory: KVMemory):
        self.memory = memory
        self.states = RingStates(memory) if memory.rings is not None else None
        self.pages: dict[tuple, torch.Tensor] = {}
        self.saved: dict[tuple, torch.Tensor] = {}
        self.hits = 0

    def match(self, rid, tokens, salt=None):
        P, n = self.memory.page_tokens, 0
        while n + P < len(tokens) and tuple(tokens[: n + P]) in self.pages:
            n += P
        if self.states is not None:
            while n and tuple(tokens[:n]) not in self.saved:
                n -= P
        return SimpleNamespace(
            hit_tokens=n, pending=False, tokens=tokens, first_page=0, computed_tokens=0
        )

    def load(self, m, blocks, state_slot=None):
        P = self.memory.page_tokens
        for i in range(m.hit_tokens // P):
            self.memory.pool[blocks[i]] = self.pages[tuple(m.tokens[: (i + 1) * P])]
        if self.states is not None:
            self.states.load_state(
                state_slot, m.hit_tokens, self.saved[tuple(m.tokens[: m.hit_tokens])]
            )
        self.hits += m.hit_tokens
        return None

    def store(self, rid, tokens, blocks, state_slot=None):
        P = self.memory.page_tokens
        for i in range(len(tokens) // P):
            self.pages.setdefault(tuple(tokens[: (i + 1) * P]), self.memory.pool[blocks[i]].clone())
        if self.states is not None:
            last = len(tokens) // P * P
            for b in (last, last - P):
                if b > 0:
                    out = torch.empty(self.states.state_bytes, dtype=torch.uint8)
                    self.states.save_state(state_slot, b, out)
                    self.saved[tuple(tokens[:b])] = out

    def poll(self):
        pass

    def release(self, rid):
        pass


def test_multi_turn_outputs_identical_with_copied_prefixes(checkpoint):
    """Every later turn resumes from copied pages/states, and answers exactly as a full prefill."""
    convs = make_workload(
        conversations=3,
        turns=4,
        first_tokens=120,
        message_tokens=30,
        answer_tokens=6,
        vocab_size=1000,
        seed=5,
    )
    off = drive(_engine(checkpoint), convs)
    eng_on = _engine(checkpoint, CopyCache)
    on = drive(eng_on, convs)
    assert [[r.output for r in c] for c in on] == [[r.output for r in c] for c in off]
    later = [r for c in on for r in c[1:]]
    assert all(r.hit_tokens > 0 for r in later)
    # a later turn's hit covers at least the previous prompt up to its last page boundary
    # that has a state (sliding) or up to its last full page (full attention only)
    for c in on:
        for prev, cur in itertools.pairwise(c):
            floor = (len(prev.prompt) // PAGE - (1 if eng_on.needs_slot else 0)) * PAGE
            assert cur.hit_tokens >= floor, (cur.rid, cur.hit_tokens, floor)
    assert eng_on.cache.hits == sum(r.hit_tokens for r in later)


# -- state hooks ----------------------------------------------------------------------------


def test_state_roundtrip_resumes_exactly():
    cfg = ModelConfig(
        family="qwen3",
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        layer_types=(FULL, SLIDING),
        sliding_window=40,
    )
    model = Transformer.random(cfg, seed=3)
    mem = KVMemory(cfg, num_blocks=32, page_tokens=PAGE, num_slots=3)
    hooks = RingStates(mem)
    assert hooks.history_tokens == 2 * PAGE
    assert hooks.state_bytes == 1 * 2 * (40 - 1) * 2 * 16 * 4
    toks = torch.randint(0, 300, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    a, b, c = mem.alloc_slot(), mem.alloc_slot(), mem.alloc_slot()
    ta, tb, tc = (torch.tensor(mem.alloc_blocks(10)) for _ in range(3))
    model.forward([Item(toks[:112], 0, ta, a)], mem)
    model.forward([Item(toks[112:140], 112, ta, a)], mem)
    state = torch.empty(hooks.state_bytes, dtype=torch.uint8)
    hooks.save_state(a, 112, state)  # 140 - 32 <= 112 <= 140: still in the ring's slack
    with pytest.raises(ValueError, match="outside"):
        hooks.save_state(a, 96, torch.empty(hooks.state_bytes, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple"):
        hooks.save_state(a, 120, torch.empty(hooks.state_bytes, dtype=torch.uint8))
    with pytest.raises(ValueError, match="bytes"):
        hooks.save_state(a, 128, torch.empty(8, dtype=torch.uint8))
    # reference: slot c computes 0..112 the same way, then 112..150
    model.forward([Item(toks[:112], 0, tc, c)], mem)
    ref = model.forward([Item(toks[112:], 112, tc, c)], mem)
    # slot b: pages 0..6 copied from a, rings from the state at 112, then 112..150
    mem.pool[tb[:7]] = mem.pool[ta[:7]]
    hooks.load_state(b, 112, state)
    assert mem.slot_len[b] == 112
    resumed = model.forward([Item(toks[112:], 112, tb, b)], mem)
    assert torch.equal(resumed, ref)
    # a wrong state (zeros) changes the result: the test sees the rings
    mem.pool[tb[:7]] = mem.pool[ta[:7]]
    hooks.load_state(b, 112, torch.zeros_like(state))
    assert not torch.equal(model.forward([Item(toks[112:], 112, tb, b)], mem), ref)


def test_qwen3_config_sliding_semantics():
    base = dict(
        model_type="qwen3",
        vocab_size=100,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    off = ModelConfig.from_hf({**base, "sliding_window": 32, "max_window_layers": 2})
    assert off.sliding_window is None and off.layer_types == (FULL,) * 4
    on = ModelConfig.from_hf(
        {**base, "use_sliding_window": True, "sliding_window": 32, "max_window_layers": 2}
    )
    assert on.layer_types == (FULL, FULL, SLIDING, SLIDING) and on.sliding_window == 32
    given = ModelConfig.from_hf(
        {
            **base,
            "use_sliding_window": True,
            "sliding_window": 32,
            "layer_types": [SLIDING, FULL, SLIDING, FULL],
        }
    )
    assert given.layer_types == (SLIDING, FULL, SLIDING, FULL)
    with pytest.raises(ValueError, match="no sliding_window"):
        ModelConfig.from_hf({**base, "sliding_window": 32, "layer_types": [SLIDING, FULL] * 2})
    with pytest.raises(ValueError, match="model_type"):
        ModelConfig.from_hf({**base, "model_type": "gpt2"})


def test_deferred_request_does_not_stall_others(checkpoint):
    """A request whose match is pending waits; the one behind it runs; then it runs too."""

    class Deferring(CopyCache):
        def __init__(self, memory):
            super().__init__(memory)
            self.asks = 0

        def match(self, rid, tokens, salt=None):
            if rid == "slow" and self.asks < 3:
                self.asks += 1
                return SimpleNamespace(hit_tokens=0, pending=True)
            return super().match(rid, tokens, salt)

    eng = _engine(checkpoint, Deferring)
    slow, fast = Request("slow", list(range(40)), 2), Request("fast", list(range(50, 90)), 2)
    eng.add(slow)
    eng.add(fast)
    eng.step()
    assert [r.rid for r in eng.running] == ["fast"] and [r.rid for r in eng.waiting] == ["slow"]
    while eng.busy:
        eng.step()
    assert [r.rid for r in eng.finished] == ["fast", "slow"] and eng.cache.asks == 3
    assert slow.output == _generate(checkpoint.hf, slow.prompt, 2)


def test_weights_resaved_in_place_get_another_name_in_the_keys(tmp_path):
    """The same folder and config.json, other weights (a fine-tune written over its base):
    the identity's name in hicache's fingerprint changes, so no page of the old weights is
    served."""
    from hicache.tools.refengine.build import EngineSpec, engine_identity, load_model

    _hf_model("llama", tmp_path)
    spec = EngineSpec(model=str(tmp_path))

    def name() -> str:
        return engine_identity(spec, *load_model(spec)).name()

    before = name()
    weights = tmp_path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 1
    weights.write_bytes(bytes(data))
    assert name() != before
