"""The identity of the pages under SGLang (`hicache.core.identity`, filled by the backend): what
SGLang publishes of its settings decides the page keys, a `model_id` names the weights only,
and what hicache cannot key is refused at start. SGLang's own controller and pools on the CPU
(tests/sglang_env.py), its own published settings (`override_server_args`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import sglang_env as env
import torch
from memory_tier import MemoryTier
from sglang_env import P, sg
from sglang_standins import stand_ins

pytestmark = pytest.mark.sglang

PAGES = 8
TOKENS = list(range(7000, 7000 + PAGES * P))


@contextlib.contextmanager
def published(**server_args) -> Iterator[None]:
    """SGLang's settings as a server publishes them (its runtime context), for the block."""
    with stand_ins():
        scope = sg.runtime_context.get_context().override_server_args(**server_args)
        scope.install()
    try:
        yield
    finally:
        scope.restore()


def fp8_pool(dtype: torch.dtype):
    """SGLang's MHA device pool in an fp8 format: it stores uint8, as every fp8 pool does."""
    return sg.memory_pool.MHATokenToKVPool(
        size=256, page_size=P, dtype=dtype, head_num=2, head_dim=8, layer_num=3, device="cpu",
        enable_memory_saver=False, enable_alt_stream=False,
    )  # fmt: skip


def memory(space: str) -> dict:
    return {"tiers": [{"type": "memory", "space": space}]}


def test_fp8_formats_under_one_model_id_share_no_page():
    """An fp8_e4m3 instance backs a prompt up; an fp8_e5m2 one under the same `model_id` (the
    same uint8 pools) finds none of it, and another fp8_e4m3 one finds all of it. Before, the
    model_id replaced the whole identity and e5m2 took e4m3's 8 pages."""
    extra = env.extra(memory("fp8"), model_id="my-model")

    def instance(fmt: str, dtype: torch.dtype):
        with published(model_path="/models/m", kv_cache_dtype=fmt):
            host = env.host_pool(fp8_pool(dtype), "page_first")
            env.fill(host, seed=1)
            return host, env.controller(fp8_pool(dtype), host, extra)

    host, a = instance("fp8_e4m3", torch.float8_e4m3fn)
    assert env.backup(a, host, TOKENS)[1] == len(TOKENS)
    env.stop(a)
    got = []
    for fmt, dtype in (("fp8_e5m2", torch.float8_e5m2), ("fp8_e4m3", torch.float8_e4m3fn)):
        host, b = instance(fmt, dtype)
        try:
            got.append(env.prefetch(b, host, TOKENS)[1])
        finally:
            env.stop(b)
    assert got == [0, len(TOKENS)]
    assert len(MemoryTier.spaces["fp8"]) == PAGES
