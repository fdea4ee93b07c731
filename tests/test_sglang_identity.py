"""The identity of the pages under SGLang (`hicache.core.identity`, filled by the backend): what
SGLang publishes of its settings decides the page keys, a `model_id` names the weights only,
and what hicache cannot key is refused at start. SGLang's own controller and pools on the CPU
(tests/sglang_env.py), its own published settings (`override_server_args`)."""

from __future__ import annotations

import contextlib
import functools
import logging
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import sglang_env as env
import torch
from memory_tier import MemoryTier
from sglang_env import P, sg
from test_identity_table import free_port

from hicache.core.identity import FIELDS, NAMING, NEUTRAL
from hicache.integrations.sglang.cpu_imports import stand_ins

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

    def instance(dtype: torch.dtype):
        host = env.host_pool(fp8_pool(dtype), "page_first")
        env.fill(host, seed=1)
        return host, env.controller(fp8_pool(dtype), host, extra)

    with published(model_path="/models/m", kv_cache_dtype="fp8_e4m3"):
        host, a = instance(torch.float8_e4m3fn)
        assert env.backup(a, host, TOKENS)[1] == len(TOKENS)
        env.stop(a)
    got = []
    for fmt, dtype in (("fp8_e5m2", torch.float8_e5m2), ("fp8_e4m3", torch.float8_e4m3fn)):
        with published(model_path="/models/m", kv_cache_dtype=fmt):
            host, b = instance(dtype)
            try:
                got.append(env.prefetch(b, host, TOKENS)[1])
            finally:
                env.stop(b)
    assert got == [0, len(TOKENS)]
    assert len(MemoryTier.spaces["fp8"]) == PAGES


def test_an_fp8_pool_whose_format_sglang_did_not_publish_is_refused_in_one_line(caplog):
    """A controller made outside a server publishes no settings: its uint8 pool could hold
    either fp8 format, so the backend refuses to start (one line), never keys it by uint8."""
    host = env.host_pool(fp8_pool(torch.float8_e5m2), "page_first")
    line = "SGLang's kv_cache_dtype='unpublished' may change the KV bytes"
    with caplog.at_level(logging.ERROR), pytest.raises(ValueError, match=line):
        env.controller(fp8_pool(torch.float8_e5m2), host, env.extra(memory("none")))
    errors = [r.getMessage() for r in caplog.records if r.name.startswith("hicache")]
    assert len(errors) == 1 and line in errors[0] and "\n" not in errors[0]


def weight_updater(load: Any) -> Any:
    """SGLang's scheduler part of an update-weights call (`SchedulerWeightUpdaterManager`), over
    a model runner that cannot run here: SGLang builds none on a CPU (its kernels need CUDA), so
    `load(path)` stands in for the runner's loading. The scheduler's own
    `record_weight_version_change` runs on the state it reads (no request in flight)."""
    with stand_ins():
        from sglang.srt.managers.scheduler import Scheduler
        from sglang.srt.managers.scheduler_components import weight_updater as updater

    state = types.SimpleNamespace(
        collect_inflight_reqs=list, waiting_queue=[], chunked_req=None, hisparse_coordinator=None
    )
    state.record_weight_version_change = functools.partial(
        Scheduler.record_weight_version_change, state
    )

    class Loader:
        @staticmethod
        def update_weights_from_disk(path, load_format, recapture_cuda_graph=False):
            load(path)
            return True, "loaded"

    runner = types.SimpleNamespace(weight_updater=Loader)
    worker = types.SimpleNamespace(weight_update_runners=lambda: [("target", runner)])
    group = types.SimpleNamespace(cpu_group=None)
    with sg.runtime_context.get_parallel().override(tp_group=group):
        return updater.SchedulerWeightUpdaterManager(
            tp_worker=worker, draft_worker=None, memory_saver_adapter=None,
            flush_cache=lambda **_: True, is_fully_idle=lambda **_: True, scheduler=state,
        )  # fmt: skip


def test_weights_updated_in_place_are_never_served_the_old_pages(tmp_path):
    """SGLang's update_weights_from_disk writes new weights over the model's folder and sets
    the weight version: the backend's next prefetch finds none of the pages backed up before
    (8 of 8 were there), and the pages backed up after are found again."""
    from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    extra = env.extra(memory("update"), model_id="m")
    device = env.device_pools()["mha"]
    with published(model_path=str(folder), weight_version="v1"):
        host = env.host_pool(device, "page_first")
        env.fill(host, seed=1)
        ctl = env.controller(device, host, extra)
        try:
            env.backup(ctl, host, TOKENS)
            assert env.prefetch(ctl, host, TOKENS, rid="before")[1] == len(TOKENS)

            def load(path: str) -> None:
                (Path(path) / "model.safetensors").write_bytes(bytes(range(255, -1, -1)) * 64)

            with sg.runtime_context.get_parallel().override(tp_group=types.SimpleNamespace()):
                done = weight_updater(load).update_weights_from_disk(
                    UpdateWeightFromDiskReqInput(
                        model_path=str(folder), weight_version="v2", flush_cache=False
                    )
                )
            assert done.success, done.message
            assert env.prefetch(ctl, host, TOKENS, rid="after")[1] == 0
            env.backup(ctl, host, TOKENS)
            assert env.prefetch(ctl, host, TOKENS, rid="again")[1] == len(TOKENS)
        finally:
            env.stop(ctl)
    assert len(MemoryTier.spaces["update"]) == 2 * PAGES


# -- the perturbation table (tests/test_identity_table.py has the reference engine's) ----------


@dataclass(frozen=True)
class Side:
    """One SGLang instance: its published settings, hicache's extra config (and the shared disk
    tier's settings), its pool and its TP rank."""

    published: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    disk: dict[str, Any] = field(default_factory=dict)
    first: tuple[dict[str, Any], ...] = ()
    more: dict[str, Any] = field(default_factory=dict)
    layout: str = "page_first"
    rank: tuple[int, int] = (0, 1)


def flipped_model(root: Path, flip: bool = False) -> str:
    folder = root / ("flipped" if flip else "model")
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    data = bytearray(bytes(range(256)) * 64)
    data[100] ^= int(flip)
    (folder / "model.safetensors").write_bytes(bytes(data))
    return str(folder)


def run(side: Side, root: Path, backup: bool) -> tuple[Any, int]:
    """Start `side` over the disk tier at `root`; back the prompt up, or prefetch it (the
    tokens found). Its identity and the count."""
    disk = {"type": "disk", "path": str(root), "size": "64MiB", "sync": False, **side.disk}
    hicache = {"tiers": [*side.first, disk], **side.more}
    device = env.device_pools()["mha"]
    with published(**{"model_path": "/models/m", **side.published}):
        host = env.host_pool(device, side.layout)
        env.fill(host, seed=1)
        ctl = env.controller(device, host, env.extra(hicache, **side.extra), *side.rank)
        try:
            got = env.backup(ctl, host, TOKENS)[1] if backup else env.prefetch(ctl, host, TOKENS)[1]
            return env.backend(ctl).identity, got
        finally:
            env.stop(ctl)


PER_REQUEST = "per request under SGLang: its storage keys are seeded by the request's {}"
ROWS: dict[str, Callable[[Path], tuple[Side, Side, set[str]]] | str] = {
    "weights": lambda _: (
        Side(extra={"model_id": "a"}),
        Side(extra={"model_id": "b"}),
        {"weights"},
    ),
    "weights_digest": lambda tmp: (
        Side({"model_path": flipped_model(tmp)}, {"model_id": "m"}),
        Side({"model_path": flipped_model(tmp, flip=True)}, {"model_id": "m"}),
        {"weights_digest"},
    ),
    "weights_version": lambda _: (
        Side(),
        Side(extra={"weights_version": "2"}),
        {"weights_version"},
    ),
    "config": lambda _: (
        Side(),
        Side({"json_model_override_args": '{"rms_norm_eps": 0.001}'}),
        {"config"},
    ),
    "compute_dtype": lambda _: (
        Side({"dtype": "bfloat16"}),
        Side({"dtype": "float16"}),
        {"compute_dtype"},
    ),
    "kv_format": "tests/test_sglang_identity.py::test_fp8_formats_under_one_model_id_share_no_page",
    "quantization": lambda _: (Side(), Side({"quantization": "fp8"}), {"quantization"}),
    "attention": lambda _: (Side(), Side(layout="layer_first"), {"attention"}),
    "position": "SGLang's RoPE settings are its config's (json_model_override_args: row config)",
    "shard": lambda _: (
        Side({"tp_size": 2}, rank=(0, 2)),
        Side({"tp_size": 2}, rank=(1, 2)),
        {"shard"},
    ),
    "arithmetic": lambda _: (
        Side(),
        Side({"enable_deterministic_inference": True}),
        {"arithmetic"},
    ),
    "adapters": PER_REQUEST.format("extra key (its LoRA adapter)"),
    "multimodal": "per request under SGLang: its multimodal tokens carry the inputs' hashes",
    "salt": PER_REQUEST.format("cache salt"),
    "engine": "SGLang keeps a drafter's KV in a pool of its own, which hicache does not store",
    "codec": lambda _: (Side(), Side(disk={"codec": "lossless"}), set()),
    "tier order": lambda tmp: (
        Side(),
        Side(first=({"type": "disk", "path": str(tmp / "x"), "size": "8MiB", "name": "x"},)),
        set(),
    ),
    "metrics port": lambda _: (Side(), Side(more={"metrics": {"port": free_port()}}), set()),
    "threads": lambda _: (Side(), Side(disk={"fetch_workers": 2}), set()),
    "worker CPUs": lambda _: (Side(), Side(disk={"worker_cpus": [0]}), set()),
    "page group size": "SGLang's objects are one page each (group_pages is refused under SGLang)",
}


def test_the_table_has_a_row_for_every_field_and_setting():
    assert list(ROWS) == [*FIELDS, *NEUTRAL, *NAMING]


@pytest.mark.parametrize("name", [n for n, row in ROWS.items() if not isinstance(row, str)])
def test_a_row_of_the_table(name, tmp_path):
    """Identity fields: 0 of the 8 pages; `NEUTRAL` settings: all 8."""
    a, b, differ = ROWS[name](tmp_path)  # type: ignore[operator]
    first, stored = run(a, tmp_path / "disk", backup=True)
    second, found = run(b, tmp_path / "disk", backup=False)
    assert stored == len(TOKENS)
    assert set(first.differences(second)) == differ
    if name in FIELDS:
        assert name in differ
    assert found == (len(TOKENS) if name in NEUTRAL else 0)
