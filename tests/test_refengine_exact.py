"""The reference engine's exact mode: a token's logits and K/V do not depend on how its sequence
was chunked or what shared its steps, so the runs with and without hicache agree bit for bit in
bfloat16 (without the mode they do not: the suffix after a hit is prefilled in other chunks).

CPU, tiny random-weight models of both families; tests/test_exact_cuda.py runs the same checks
on a GPU with a head shape FlashAttention takes.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("hicache.cache")

from test_refengine_hicache import HOST, SHAPES

from hicache.tools.refengine import exact
from hicache.tools.refengine.build import EngineSpec, build_engine
from hicache.tools.refengine.config import ModelConfig
from hicache.tools.refengine.engine import Engine
from hicache.tools.refengine.memory import KVMemory
from hicache.tools.refengine.model import Item, Transformer
from hicache.tools.refengine.workload import drive, make_workload

PAGE = 16
CHUNKINGS = ([300, 300], [599, 1], [100] * 6, [257, 1, 1, 340, 1], [17] * 35 + [5])
"""Ways to cut a 600-token prompt: a suffix chunk, decode-sized chunks, many small ones."""


def chunked_run(model: Transformer, tokens: list[int], chunks: list[int], page: int = PAGE):
    """The last token's logits and the K/V pages of `tokens` prefilled chunk after chunk."""
    cfg, dev, n = model.cfg, model.device, len(tokens)
    pages = -(-n // page)
    mem = KVMemory(cfg, pages + 1, page, num_slots=1, device=dev, dtype=model.dtype)
    table = torch.arange(pages, device=dev)
    slot = 0 if mem.rings is not None else None
    start = 0
    for c in chunks:
        logits = model.forward([Item(tokens[start : start + c], start, table, slot)], mem)
        start += c
    assert start == n
    return logits, mem.pool[:pages].clone()


def chunking_differences(model: Transformer, n: int = 600) -> list[str]:
    """Each chunking whose logits or K/V differ from the whole prompt's, with the largest
    difference; empty when every chunking gives the same bits."""
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model.cfg.vocab_size, (n,), generator=gen).tolist()
    whole_logits, whole_kv = chunked_run(model, tokens, [n])
    found = []
    for chunks in CHUNKINGS:
        logits, kv = chunked_run(model, tokens, chunks)
        if not (torch.equal(logits, whole_logits) and torch.equal(kv, whole_kv)):
            dl = (logits - whole_logits).abs().max().item()
            dkv = (kv.float() - whole_kv.float()).abs().max().item()
            found.append(f"{chunks[:4]}...: logits {dl:.3g}, K/V {dkv:.3g}")
    return found


def answer_logits(engine: Engine, convs) -> dict[tuple[str, int], torch.Tensor]:
    """Drive `convs` through `engine`; the logits each answer token was taken from, by request
    and position (the engine's own steps, observed as they run)."""
    seen: dict[tuple[str, int], torch.Tensor] = {}
    batch, forward = engine._batch, engine.model.forward
    owners: list = []

    def record_batch():
        items, who = batch()
        owners[:] = [(req, req.computed + n, len(req.prompt)) for req, n in who]
        return items, who

    def record_forward(items, memory):
        logits = forward(items, memory)
        for (req, end, prompt_len), row in zip(owners, logits):
            if end >= prompt_len:  # a prompt's last chunk or a decode token: an answer token
                seen[(req.rid, end)] = row.clone()
        return logits

    engine._batch = record_batch
    engine.model.forward = record_forward
    try:
        drive(engine, convs)
    finally:
        del engine.model.forward  # the class's method again
    return seen


def on_off_differences(cfg: ModelConfig, device: str, exact_mode: bool, **spec_kw) -> list[str]:
    """Answer tokens whose logits differ between the engine alone (with a GPU prefix cache
    where the model allows one) and the engine with hicache (loads by layer on a GPU)."""
    convs = make_workload(
        conversations=3,
        turns=4,
        first_tokens=450,
        message_tokens=40,
        answer_tokens=5,
        vocab_size=cfg.vocab_size,
        seed=9,
    )
    model = Transformer.random(cfg, seed=11, device=device, dtype=torch.bfloat16)
    model.exact = exact_mode
    named = (model, f"{cfg.name}@random-seed11")
    base = dict(
        page_tokens=PAGE,
        num_blocks=256,
        num_slots=8,
        chunk_tokens=64,
        device=device,
        dtype="bfloat16",
        exact=exact_mode,
        **spec_kw,
    )
    off = answer_logits(build_engine(EngineSpec(**base, prefix_share=0.1), model=named), convs)
    on_engine = build_engine(
        EngineSpec(**base, prefix_share=0.0, by_layer=device == "cuda"), HOST, model=named
    )
    try:
        on = answer_logits(on_engine, convs)
        hits = sum(r.hit_tokens for r in on_engine.finished)
    finally:
        on_engine.cache.close()
    assert hits > 0, "hicache served nothing: the comparison would not test a hit"
    assert off.keys() == on.keys()
    return [
        f"{key}: {(off[key] - on[key]).abs().max().item():.3g}"
        for key in off
        if not torch.equal(off[key], on[key])
    ]


@pytest.mark.parametrize("family", sorted(SHAPES))
def test_exact_mode_gives_a_token_the_same_bits_however_its_prompt_is_chunked(family):
    model = Transformer.random(SHAPES[family], seed=3, dtype=torch.bfloat16)
    model.exact = True
    assert chunking_differences(model) == []


@pytest.mark.parametrize("family", sorted(SHAPES))
def test_exact_mode_answers_with_identical_logits_with_the_cache_on_and_off(family):
    assert on_off_differences(SHAPES[family], "cpu", exact_mode=True) == []


def test_replay_runs_in_exact_mode_by_default_in_bf16_and_not_in_float32(tmp_path):
    import json

    from hicache.tools.refengine.replay import main
    from hicache.tools.refengine.replay_args import parser

    out = tmp_path / "r.json"
    args = ["--model", "tiny-llama", "--conversations", "2", "--turns", "2", "--first-tokens",
            "128", "--message-tokens", "16", "--answer-tokens", "2", "--repeats", "1",
            "--quiet", "--json", str(out)]  # fmt: skip
    for extra, expected in ((["--dtype", "bfloat16"], True), ([], False)):
        assert main([*args, *extra]) == 0
        res = json.loads(out.read_text())
        assert res["setup"]["exact"] is expected, extra
        assert res["identical"] or not expected
    assert parser().parse_args(["--no-exact"]).exact is False


def test_tree_sum_adds_a_row_alike_whatever_the_rows_around_it():
    x = torch.randn(300, 200, dtype=torch.float32)
    whole = exact.tree_sum(x)
    assert torch.allclose(whole, x.double().sum(-1).float(), rtol=1e-5, atol=1e-4)
    for rows in (1, 7, 64):
        assert torch.equal(exact.tree_sum(x[:rows]), whole[:rows])


def test_attend_rejects_keys_that_do_not_end_at_the_last_query():
    q = torch.zeros(4, 2, 8)
    kv = torch.zeros(10, 2, 8)
    with pytest.raises(ValueError, match="keys end at 10, queries at 9"):
        exact.attend(q, kv, kv, 5, 0, 1.0)
