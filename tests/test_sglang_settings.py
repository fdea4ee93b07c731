"""SGLang's extra config and hicache configurations under SGLang, checked before a launch
(`hicache config check`) exactly as the backend loads them at start, without SGLang: one line
on error, the key meant for a misspelt one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hicache.config import ConfigError
from hicache.integrations.sglang.settings import from_extra_config, settings

ROOT = Path(__file__).resolve().parent.parent


def extra(**keys) -> dict:
    return {
        "backend_name": "hicache", "module_path": "hicache.integrations.sglang",
        "class_name": "HiCacheBackend", "interface_v1": 1, **keys,
    }  # fmt: skip


def check(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``hicache config check ARGS`` in a fresh interpreter, which must not import SGLang."""
    code = (
        "import sys\nfrom hicache.cli import main\nrc = main(sys.argv[1:])\n"
        "assert 'sglang' not in sys.modules, 'SGLang was imported'\nsys.exit(rc)"
    )
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-c", code, "config", "check", *args], cwd=cwd,
        env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_a_misspelt_key_is_named_with_the_key_meant():
    with pytest.raises(ConfigError) as err:
        settings(extra(confg="configs/sglang/disk.yaml"))
    line = str(err.value)
    assert line.startswith(
        "hicache: --hicache-storage-backend-extra-config: unknown key 'confg' (did you mean "
        "'config'?); the keys are config, hicache, model_id, weights_version, backend_name, "
    )
    with pytest.raises(ConfigError, match=r"unknown key 'modelid' \(did you mean 'model_id'"):
        settings(extra(modelid="m", config="configs/sglang/disk.yaml"))


@pytest.mark.parametrize(
    "text, line",
    [
        ("{not json", "hicache: --hicache-storage-backend-extra-config: not valid JSON: "),
        ("[1]", "hicache: --hicache-storage-backend-extra-config: must be an object of keys"),
        (json.dumps({**extra(), "class_name": "X"}), '"class_name" must be "HiCacheBackend"'),
        (json.dumps(extra()), "needs exactly one of 'config' (a YAML file) and 'hicache'"),
        ("@missing.yaml", "hicache: missing.yaml: cannot read: No such file or directory"),
    ],
)
def test_a_bad_extra_config_is_one_line(text, line):
    with pytest.raises(ConfigError) as err:
        from_extra_config(text)
    assert line in str(err.value) and "\n" not in str(err.value)


def test_config_check_takes_sglangs_configs_and_its_extra_config(tmp_path):
    """The launch line's configuration, the docs' extra config (as JSON and as SGLang's
    ``@file``) and a misspelt one, each checked as the backend will load it."""
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    plain = check("--strict", "configs/sglang/disk.yaml", cwd=tmp_path)
    assert plain.returncode == 0, plain.stderr
    assert plain.stderr.startswith("note: no host tier: checked as a configuration under SGLang")
    assert "path: hicache-sglang" in plain.stdout and "group_pages" not in plain.stdout
    assert not (tmp_path / "hicache-sglang").exists()  # checking makes no directory

    launch = json.dumps(extra(config="configs/sglang/disk.yaml"))
    good = check("--strict", "--sglang-extra-config", launch, cwd=tmp_path)
    assert (good.returncode, good.stderr) == (0, ""), good.stderr
    assert good.stdout == plain.stdout
    (tmp_path / "extra.yaml").write_text(json.dumps(extra(hicache={"tiers": [{"type": "disk",
                                         "path": "d", "size": "1GiB", "sise": 1}]})))  # fmt: skip
    bad = check("--sglang-extra-config", "@extra.yaml", cwd=tmp_path)
    assert bad.returncode == 2
    assert bad.stderr == "error: tiers.0: unknown key 'sise' (did you mean 'size'?)\n"

    typo = check("--sglang-extra-config", json.dumps(extra(confg="x")), cwd=tmp_path)
    assert typo.returncode == 2 and len(typo.stderr.splitlines()) == 1
    assert typo.stderr.startswith(
        "error: hicache: --hicache-storage-backend-extra-config: unknown key 'confg' "
        "(did you mean 'config'?)"
    )
    host = check("--sglang-extra-config", json.dumps(extra(hicache={"tiers": [
        {"type": "host", "size": "1GiB"}]})), cwd=tmp_path)  # fmt: skip
    assert host.returncode == 2 and "the host tier is SGLang's own" in host.stderr
