"""Configuration: example files load, bad files give one line naming the file and the field."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hicache.config import ConfigError, load_config

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_example_configs_load(path: Path):
    cfg = load_config(path, env={})
    assert cfg.tiers[0].type == "host"


def test_host_example_values():
    cfg = load_config(CONFIGS / "host.yaml", env={})
    assert cfg.tier("host").size == 64 * 2**30
    assert cfg.layout.page_size == 16 * 2**20
    assert cfg.policy.min_recompute_tokens == 1


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


LAYOUT = "layout: {model: m, kv_dtype: bf16, page_bytes: 64}\n"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tiers: [{type: host, size: 12XB}]", "tiers.0.size: could not interpret byte unit: XB"),
        ("tiers: [{type: host, size: 1GiB, colour: red}]", "tiers.0: unknown key 'colour'"),
        ("tierz: [{type: host, size: 1GiB}]", "(top level): unknown key 'tierz' (did you mean"),
        ("tiers: [{type: host, sise: 1GiB}]", "tiers.0: unknown key 'sise' (did you mean 'size'?)"),
        (
            "tiers: [{type: host, size: 1GiB}, {type: mooncake, master: 'h:1'}]",
            "tiers.1: unknown key 'master' (did you mean 'master_address'?)",
        ),
        (
            LAYOUT.replace("page_bytes", "pagebytes") + "tiers: [{type: host, size: 1GiB}]",
            "layout: unknown key 'pagebytes' (did you mean 'page_bytes'?)",
        ),
        ("tiers: [{type: host, size: -1GiB}]", "tiers.0.size: a size cannot be negative, got -1"),
        ("tiers: [{type: host, size: -4096}]", "tiers.0.size: a size cannot be negative, got -4"),
        (
            LAYOUT.replace("64", "16777216") + "tiers: [{type: host, size: 1MiB}]",
            "tiers.0.size: 1 MiB is smaller than one page (16 MiB, the layout's page_bytes)",
        ),
        ("tiers: [{type: tape, size: 1GiB}]", "tiers.0.type: unknown tier type 'tape'"),
        ("tiers: [{type: host, size: 0}]", "tiers.0.size: Input should be greater than 0"),
        ("tiers: []", "tiers: Tuple should have at least 1 item"),
        (
            "tiers: [{type: host, size: 1GiB}]\npolicy: {min_recompute_tokens: 0}",
            "policy.min_recompute_tokens: Input should be greater than or equal to 1",
        ),
        ("tiers: [{type: host, size: 1GiB}]\nmystery: 1", "(top level): unknown key 'mystery'"),
        (
            "tiers: [{type: host, size: 1GiB}, {type: mooncake, fetch_reserve: 1XB}]",
            "tiers.1.fetch_reserve: could not interpret byte unit: XB",
        ),
        (
            LAYOUT.replace("page_bytes: 64", "page_bytes: 64, segments: [16, 16]")
            + "tiers: [{type: host, size: 1GiB}]",
            "layout: segments add up to 32 bytes but page_bytes is 64",
        ),
        ("tiers: [{type: host, size: 1GiB}\n", "not valid YAML"),
        ("- 1\n- 2\n", "the top level must be a mapping"),
    ],
)
def test_bad_files_name_the_file_and_the_field(tmp_path: Path, text: str, message: str):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(path, env={})
    assert str(err.value).startswith(f"{path}: ")
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_environment_overrides(tmp_path: Path):
    path = write(tmp_path, LAYOUT + "tiers: [{type: host, size: 1GiB}]\n")
    env = {
        "HICACHE__TIERS__0__SIZE": "2GiB",
        "HICACHE__POLICY__MIN_RECOMPUTE_TOKENS": "64",
        "HICACHE__LAYOUT__KV_DTYPE": "float8_e4m3fn",
        "OTHER": "ignored",
    }
    cfg = load_config(path, env=env)
    assert cfg.tier("host").size == 2 * 2**30
    assert cfg.policy.min_recompute_tokens == 64
    assert cfg.layout.kv_dtype == "float8_e4m3fn"
    with pytest.raises(ConfigError, match="HICACHE__TIERS__3__SIZE: no list item '3'"):
        load_config(path, env={"HICACHE__TIERS__3__SIZE": "1"})
    with pytest.raises(ConfigError, match=r"policy\.min_recompute_tokens"):
        load_config(path, env={"HICACHE__POLICY__MIN_RECOMPUTE_TOKENS": "zero"})


def test_cli_config_check(tmp_path: Path):
    fits = tmp_path / "fits.yaml"
    fits.write_text((CONFIGS / "host.yaml").read_text().replace("size: 64GiB", "size: 64MiB"))
    good = subprocess.run(
        [sys.executable, "-m", "hicache.cli", "config", "check", str(fits)],
        capture_output=True,
        text=True,
    )
    assert good.returncode == 0, good.stderr
    assert "size: 67108864" in good.stdout
    bad = write(tmp_path, "tiers: [{type: host, size: 0}]")
    done = subprocess.run(
        [sys.executable, "-m", "hicache.cli", "config", "check", str(bad)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"error: {bad}: tiers.0.size: Input should be greater than 0"
    ]


def check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hicache.cli", "config", "check", *args],
        capture_output=True,
        text=True,
    )


def test_config_check_warns_of_cpus_this_machine_lacks_and_strict_refuses_them(tmp_path: Path):
    cpus = sorted(os.sched_getaffinity(0))
    outside = max(cpus) + 1
    text = f"tiers: [{{type: host, size: 1GiB}}, {{type: mooncake, worker_cpus: [{outside}]}}]"
    bad = write(tmp_path, text)
    load_config(bad, env={})  # valid as a file: another machine may have that CPU
    allowed = f"{cpus[0]}-{cpus[-1]}" if len(cpus) > 1 else str(cpus[0])  # contiguous here
    problem = (
        f"{bad}: tiers.1.worker_cpus: CPU {outside} is not one this process may run on "
        f"(allowed: {allowed})"
    )
    valid = check(str(bad))
    assert (valid.returncode, valid.stderr.splitlines()) == (0, [f"warning: {problem}"])
    assert "worker_cpus:" in valid.stdout
    strict = check("--strict", str(bad))
    assert (strict.returncode, strict.stderr.splitlines()) == (2, [f"error: {problem}"])


def test_config_check_warns_of_a_host_tier_larger_than_this_machine(tmp_path: Path):
    bad = write(tmp_path, "tiers: [{type: host, size: 1PiB}]")
    for args, code, word in (([], 0, "warning"), (["--strict"], 2, "error")):
        done = check(*args, str(bad))
        assert done.returncode == code
        (line,) = done.stderr.splitlines()
        assert line.startswith(f"{word}: {bad}: tiers.0.size: 1.05e+06 GiB is more than this")


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_every_shipped_configuration_is_valid_anywhere(name: str):
    done = check(str(CONFIGS / name))
    assert done.returncode == 0, done.stderr
    assert all(line.startswith("warning: ") for line in done.stderr.splitlines())


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("/proc/x", "/proc/x: cannot create files there: No such file or directory"),
        (
            "/no/such/mount/hicache",
            "/no/such/mount/hicache: its parent /no/such/mount is not a directory",
        ),
        ("FILE", "FILE is not a directory"),
    ],
)
def test_a_disk_directory_that_cannot_be_used_is_named_in_one_line(tmp_path: Path, path, why):
    afile = tmp_path / "a-file"
    afile.write_text("")
    path, why = path.replace("FILE", str(afile)), why.replace("FILE", str(afile))
    bad = write(
        tmp_path, f"tiers: [{{type: host, size: 64MiB}}, {{type: disk, path: {path}, size: 1GiB}}]"
    )
    strict = check("--strict", str(bad))
    assert (strict.returncode, strict.stderr) == (2, f"error: {bad}: tiers.1.path: {why}\n")
    assert check(str(bad)).returncode == 0  # valid: the directory may exist where it runs


def test_a_disk_directory_that_can_be_made_passes_and_is_not_left_behind(tmp_path: Path):
    good = write(
        tmp_path,
        f"tiers: [{{type: host, size: 64MiB}}, {{type: disk, path: {tmp_path}/new, size: 1GiB}}]",
    )
    done = check("--strict", str(good))
    assert (done.returncode, done.stderr) == (0, "")
    assert not (tmp_path / "new").exists()


def test_the_fetch_reserve_takes_a_byte_size(tmp_path: Path):
    text = "tiers: [{type: host, size: 1GiB}, {type: mooncake, fetch_reserve: 32MiB}]"
    cfg = load_config(write(tmp_path, text), env={})
    assert cfg.tiers[1].fetch_reserve == 32 << 20
    default = load_config(write(tmp_path, text.replace(", fetch_reserve: 32MiB", "")), env={})
    assert default.tiers[1].fetch_reserve == 64 << 20


def test_two_fetch_workers_by_default_only_with_four_cpus_or_more() -> None:
    from hicache.threads import fetch_workers

    assert [fetch_workers(frozenset(range(n))) for n in (1, 2, 3, 4, 16)] == [1, 1, 1, 2, 2]
    mine = len(os.sched_getaffinity(0))
    assert fetch_workers(frozenset()) == (2 if mine >= 4 else 1)  # this process's CPUs


def test_the_page_size_follows_a_copied_layout() -> None:
    """`page_size` is worked out once per layout; a copy with other sizes works it out again."""
    from hicache.config import Layout

    page_first = Layout(model="m", kv_dtype="bfloat16", page_bytes=4096)
    assert page_first.page_size == 4096
    layer_first = page_first.model_copy(update={"page_bytes": 0, "segments": (1024, 2048)})
    assert layer_first.page_size == 3072
    assert page_first.page_size == 4096 and page_first.model_copy().page_size == 4096
    assert layer_first == Layout(model="m", kv_dtype="bfloat16", segments=(1024, 2048))
