"""hicache inside a real vLLM (CPU build): greedy answers identical with the connector and
without it, hits exactly where the workload has them, shared across vLLM instances through
the disk tier and Mooncake, and still serving with the Mooncake master killed.

Each run builds its own vLLM `LLM` (`hicache.tools.vllm_run`) on a tiny random model,
multi-turn: 8 conversations of 3 turns (a 120-token first message, 40-token user turns,
48-token greedy answers), 32-token blocks. The runs on one rank take turns in one process, and
the tensor-parallel ones in another (`vllm_runner.Runner`: torch and vLLM imported once, not a
run), vLLM's engine core in it (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: half the start-up; the
connector's scheduler and worker sides are in one process with the uniprocess executor either
way); a scenario about vLLM's own engine process (a start that fails) runs in a process of its
own. Scenarios whose runs are alike share them (module-scoped fixtures). Skipped without vLLM;
failed instead under HICACHE_REQUIRE_VLLM=1 (CI).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from extras import import_problem, require
from mooncake_master import MooncakeMaster, require_mooncake
from vllm_runner import RUNNER, RunFailed, Runner

from hicache.tools.mooncake_local import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SHIPPED = Path(__file__).resolve().parent.parent / "configs" / "vllm.yaml"
BLOCK = 32
WORKLOAD = {"conversations": 8, "turns": 3, "first": 120, "user": 40, "output": 48}
SMALL_KV = 24 * BLOCK * 2 * 2 * 2 * 64 * 4  # 24 blocks of this model: 8 answers cannot all fit


def require_vllm() -> None:
    """Skip without vLLM; fail instead under HICACHE_REQUIRE_VLLM=1."""
    require("vllm", import_problem("vllm", "vllm"))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    require_vllm()
    root = Path(os.environ.get("HICACHE_CACHE_DIR") or tmp_path_factory.mktemp("c")) / "vllm-models"
    out = {arch: root / arch for arch in ("llama", "qwen3")}
    make = (  # both in one process: one import of torch and transformers
        "import sys\nfrom pathlib import Path\nfrom hicache.tools.vllm_run import make\n"
        "for arch, path in zip(sys.argv[1::2], sys.argv[2::2]):\n    make(Path(path), arch)"
    )
    args = [str(x) for arch, path in out.items() for x in (arch, path)]
    subprocess.run([sys.executable, "-c", make, *args], check=True, capture_output=True)
    return out


def workload_args(model: Path, out: Path, hicache: dict | None, **options: Any) -> list[str]:
    """`hicache.tools.vllm_run`'s arguments for a run of the workload (its result in `out`),
    with hicache's metrics on a free port where it runs."""
    args = ["--model", str(model), "--out", str(out), "--block", str(BLOCK)]
    if hicache is not None:
        port = free_port()
        config = {**hicache, "metrics": {"port": port}}
        args += ["--hicache", json.dumps(config), "--metrics-port", str(port)]
    for key, value in {**WORKLOAD, **options}.items():
        flag = "--" + key.replace("_", "-")
        args += [flag] if value is True else [flag, str(value)]
    return args


def vllm_process(model: Path, out: Path, hicache: dict) -> subprocess.CompletedProcess:
    """The workload in a vLLM process of its own, with vLLM's engine core in a process of its
    own too (vLLM's default)."""
    args = [sys.executable, *RUNNER, *workload_args(model, out, hicache)]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    return subprocess.run(args, capture_output=True, text=True, timeout=900, env=env)


RunVllm = Callable[..., dict]


@pytest.fixture(scope="module")
def run_vllm(models) -> Iterator[RunVllm]:
    """`run_vllm(model, out, hicache=None, **options)`: the workload through a vLLM; its result
    (answers, metrics, hicache's). The runs on one rank share a process, the tensor-parallel
    ones (``tp``) another (vLLM's CPU workers bind their threads for the process)."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    runners = {False: Runner(env), True: Runner(env)}

    def run(model: Path, out: Path, hicache: dict | None = None, **options: Any) -> dict:
        try:
            runners[options.get("tp", 1) > 1].run(workload_args(model, out, hicache, **options))
        except RunFailed as err:
            pytest.fail(str(err), pytrace=False)
        return json.loads(out.read_text())

    yield run
    for runner in runners.values():
        runner.close()


def cacheable_tokens(every_turn: bool = False) -> int:
    """Prompt tokens whose pages an earlier turn of the same conversation stored: its prompt
    and answer but the answer's last token (which has no KV), in whole blocks, up to the block
    before the new prompt's last token. `every_turn`: also the first turns (stored by another
    instance that ran the same workload)."""
    w, total = WORKLOAD, 0
    prompt = w["first"]
    for turn in range(w["turns"]):
        if turn:
            stored = (prompt + w["output"] - 1) // BLOCK
            prompt += w["output"] + w["user"]
        cap = (prompt - 1) // BLOCK
        if turn or every_turn:
            total += min(cap, cap if every_turn else stored) * BLOCK
    return total * w["conversations"]


def hits(result: dict) -> dict[str, float]:
    """hicache's hit tokens by tier."""
    out = {}
    for name, value in result["hicache"].items():
        if name.startswith("hicache_hit_tokens_total{"):
            out[name.split('tier="')[1].split('"')[0]] = value
    return out


def assert_books_clean(result: dict) -> None:
    """Once the store tiers have settled (see `hicache.tools.vllm_run.settle`): nothing pinned
    but their fetch reserve, no request, no copy in flight."""
    m = result["hicache"]
    reserve = sum(v for k, v in m.items() if k.startswith("hicache_tier_fetch_reserve_slots"))
    assert m['hicache_pool_pinned_slots{pool="page",tier="host"}'] == reserve
    assert m["hicache_requests"] == 0
    assert m["hicache_copies_in_flight"] == 0


@pytest.fixture(scope="module")
def baseline(models, run_vllm, tmp_path_factory) -> dict:
    return run_vllm(models["llama"], tmp_path_factory.mktemp("base") / "r.json")


HOST_TIER = {"type": "host", "size": "64MiB"}
PATIENT = {"fetch_max_wait_ms": 30_000}
"""A fetch deadline no busy machine misses: the later instances' tests count exact hits from
the store tiers, and a fetch past the default 200 ms would be a miss (recomputed, the answers
the same), as on a loaded machine with vLLM's engine core in the test's process."""
HOST = {"tiers": [HOST_TIER]}


@pytest.fixture(scope="module")
def first_instance(models, run_vllm, tmp_path_factory) -> Iterator[dict]:
    """The workload through a vLLM whose hicache writes through to a disk directory and to a
    Mooncake store node (one page an object: a first turn's prompt, 3 whole blocks, holds no
    group of 4); what later instances find there. Keys: ``result``, ``disk``, ``master``."""
    require_mooncake()
    root = tmp_path_factory.mktemp("first")
    master = MooncakeMaster(log_dir=str(root / "mooncake")).start()
    try:
        disk = {"type": "disk", "path": str(root / "disk"), "size": "256MiB", "group_pages": 1}
        moon = {"type": "mooncake", **master.tier_config, "group_pages": 1}
        result = run_vllm(models["llama"], root / "r.json", {"tiers": [HOST_TIER, disk, moon]})
        yield {"result": result, "disk": disk, "moon": moon, "master": master}
    finally:
        master.stop()


@pytest.mark.mooncake
def test_identical_answers_and_exact_host_hits(first_instance, baseline):
    """Prefix caching off, the uniprocess executor: every hit is hicache's, all from its host
    tier (the store tiers below it are written, never needed), and vLLM counts them as the
    host's."""
    r = first_instance["result"]
    assert r["answers"] == baseline["answers"]
    assert hits(r) == {"host": cacheable_tokens(), "disk": 0, "mooncake": 0}
    assert r["vllm_metrics"]["vllm:external_prefix_cache_hits"] == cacheable_tokens()
    assert r["vllm_metrics"]["vllm:prompt_tokens_cached_by_source{source=host}"] == (
        cacheable_tokens()
    )
    assert_books_clean(r)


@pytest.mark.mooncake
def test_qwen3_with_tensor_parallel_ranks_each_hitting_their_own_shard_with_the_shipped_config(
    models, run_vllm, start_mooncake_master, tmp_path
):
    """A Qwen3 (the second architecture), TP=2, vLLM's multiprocess executor (each rank's
    worker in a process of its own), with the shipped configs/vllm.yaml (a host tier, a disk)
    and Mooncake: each rank keeps its own host tier (its KV heads: the rank is in the keys) and
    its own disk directory, and serves exactly the cacheable tokens; answers as TP=2 without
    the cache. The host tier is made small for the test machine; the disk path and the master
    are the test's."""
    shipped = yaml.safe_load(SHIPPED.read_text())
    host, disk = shipped["tiers"]
    master = start_mooncake_master()
    moon = {"type": "mooncake", **master.tier_config, "group_pages": 1}
    config = {"tiers": [
        {**host, "size": "64MiB"}, {**disk, "path": str(tmp_path / "disk")}, moon,
    ]}  # fmt: skip
    base = run_vllm(models["qwen3"], tmp_path / "base.json", tp=2, executor="mp")
    r = run_vllm(models["qwen3"], tmp_path / "r.json", config, tp=2, executor="mp")
    assert r["answers"] == base["answers"]
    for rank in r["hicache_by_rank"]:
        assert hits({"hicache": rank}) == {"host": cacheable_tokens(), "disk": 0, "mooncake": 0}
        assert_books_clean({"hicache": rank})
        # the cost model follows vLLM's measured prefill, not its starting guess
        assert rank["hicache_prefill_tokens_per_second"] not in (0, 20_000)
    assert sorted(p.name for p in (tmp_path / "disk").iterdir()) == ["rank0", "rank1"]


def test_a_configuration_error_reaches_the_operator_as_one_line_first(models, tmp_path):
    """A host tier larger than the machine: vLLM stops at start, and the cause is one line
    logged at error level before vLLM's traceback, whose final error repeats it (vLLM's
    engine reports a worker's failure with the message of its exception)."""
    huge = {"tiers": [{"type": "host", "size": "900GiB"}]}
    proc = vllm_process(models["llama"], tmp_path / "r.json", huge)
    assert proc.returncode != 0
    line = next(x for x in proc.stderr.splitlines() if "is more than this machine" in x)
    assert line.startswith("hicache: TP rank 0: tiers.0.size: 900 GiB is more than this")
    first = proc.stderr.index(line)
    assert "Traceback" not in proc.stderr[:first]
    assert f"error '{line}'" in proc.stderr[first + len(line) :]


def test_two_lora_adapters_on_one_model_never_hit_each_others_pages(models, run_vllm, tmp_path):
    """Every conversation runs under two LoRA adapters, so their first prompts are the same
    tokens: each adapter's turns hit only its own earlier turns (none of the other adapter's
    pages), and the answers are as without the connector."""
    base = run_vllm(models["llama"], tmp_path / "base.json", lora_adapters=2)
    r = run_vllm(models["llama"], tmp_path / "r.json", HOST, lora_adapters=2)
    n = WORKLOAD["conversations"]
    assert [a[0] for a in base["answers"][:n]] != [a[0] for a in base["answers"][n:]]
    assert r["answers"] == base["answers"]
    assert hits(r) == {"host": 2 * cacheable_tokens()}
    assert_books_clean(r)


def test_small_gpu_budget_with_prefix_caching_preempts_and_stays_identical(
    models, run_vllm, baseline, tmp_path
):
    """vLLM's own prefix cache on, too few blocks for the batch: vLLM evicts its cached blocks
    and preempts requests; hicache serves what vLLM dropped, and the answers do not change."""
    r = run_vllm(models["llama"], tmp_path / "r.json", HOST, prefix_caching=True, kv_bytes=SMALL_KV)
    assert r["answers"] == baseline["answers"]
    assert r["preemptions"] > 0
    assert hits(r)["host"] > 0
    assert_books_clean(r)


@pytest.mark.mooncake
def test_later_instances_hit_through_disk_and_mooncake_and_survive_its_master(
    models, run_vllm, baseline, first_instance, tmp_path
):
    """After the first instance (`first_instance`) wrote through to a disk directory and to
    Mooncake: a second vLLM process with only the disk tier serves every turn (first turns too)
    from what the first stored. A third, with only Mooncake, serves the first turns from it;
    then the master is killed: vLLM goes on, its host tier serves the later turns, and the
    answers do not change."""
    disk, moon, master = (first_instance[k] for k in ("disk", "moon", "master"))
    config = {"tiers": [HOST_TIER, disk], "policy": PATIENT}
    second = run_vllm(models["llama"], tmp_path / "disk.json", config)
    assert second["answers"] == baseline["answers"]
    got = hits(second)
    assert got["disk"] > 0
    assert got["host"] + got["disk"] == cacheable_tokens(every_turn=True)
    assert_books_clean(second)
    third = run_vllm(
        models["llama"], tmp_path / "moon.json", {"tiers": [HOST_TIER, moon], "policy": PATIENT},
        kill_pid=master.proc.pid, kill_after_turn=1,
    )  # fmt: skip
    assert third["answers"] == baseline["answers"]
    first_turns = WORKLOAD["conversations"] * ((WORKLOAD["first"] - 1) // BLOCK * BLOCK)
    assert hits(third) == {"host": cacheable_tokens(), "mooncake": first_turns}
    assert_books_clean(third)
