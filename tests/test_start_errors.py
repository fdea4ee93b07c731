"""Every ``hicache`` subcommand given a configuration that cannot start here (a directory it
cannot create or that another process holds, more memory than the machine has, a store that
refuses) answers with one line naming the file, the field and the reason, and exit status 2,
before any work (or, for what only starting shows, as the cache starts). The modes that start no
cache (the planner, ``--simulate-only``) plan a configuration meant for another machine; the
cluster sweep takes no configuration at all.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from hicache.cli import main
from hicache.tools.mooncake_local import free_port

TRACE = str(Path(__file__).resolve().parents[1] / "examples/traces/mooncake_synthetic_500.jsonl")
TINY = [
    "--model", "tiny-llama", "--conversations", "1", "--turns", "2", "--first-tokens", "256",
    "--message-tokens", "8", "--answer-tokens", "2", "--quiet",
]  # fmt: skip
HOLD = """
import fcntl, os, sys
fd = os.open(sys.argv[1] + "/lock", os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.pwrite(fd, f"{os.getpid()}\\n".encode(), 0)
print("held", flush=True)
sys.stdin.read()
"""


@pytest.fixture(scope="module")
def held(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, int]]:
    """A disk tier's directory whose lock another process holds, and that process's pid."""
    path = tmp_path_factory.mktemp("held")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
    yield path, holder.pid
    holder.kill()
    holder.wait()


@pytest.fixture(scope="module")
def configs(
    tmp_path_factory: pytest.TempPathFactory, held: tuple[Path, int]
) -> dict[str, tuple[str, str]]:
    """Configuration files that cannot start here, by kind: (path, the line's field and reason)."""
    folder = tmp_path_factory.mktemp("configs")
    port = free_port()  # nobody listens there
    path, pid = held
    kinds = {
        "unmakeable": (
            "{type: disk, path: /proc/hicache-x, size: 1GiB}",
            "tiers.1.path: /proc/hicache-x: cannot create files there: No such file or directory",
        ),
        "held": (
            f"{{type: disk, path: {path}, size: 1GiB}}",
            f"tiers.1.path: {path}: in use by another process (pid {pid}); give each process "
            "its own path",
        ),
        "refusing": (
            f"{{type: mooncake, master_address: '127.0.0.1:{port}'}}",
            f"tiers.1.master_address: the Mooncake master at 127.0.0.1:{port} does not answer "
            "(Connection refused)",
        ),
    }
    out = {}
    for kind, (tier, line) in kinds.items():
        file = folder / f"{kind}.yaml"
        file.write_text(f"tiers:\n  - {{type: host, size: 64MiB}}\n  - {tier}\n")
        out[kind] = (str(file), f"{file}: {line}")
    file = folder / "huge.yaml"
    file.write_text("tiers: [{type: host, size: 1PiB}]\n")
    out["huge"] = (str(file), f"{file}: tiers.0.size: 1.05e+06 GiB is more than")
    return out


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``hicache ARGV`` in this process: its exit status and its stderr."""
    try:
        status = main(argv)
    except SystemExit as done:  # argparse's own refusals
        status = int(done.code or 0)
    return status, capsys.readouterr().err


@pytest.mark.parametrize(
    ("command", "kind"),
    [
        (["config", "check", "--strict", "{config}"], "unmakeable"),
        (["trace", TRACE, "--config", "{config}", "--limit", "20"], "unmakeable"),
        (["trace", TRACE, "--config", "{config}", "--limit", "20"], "held"),
        (["trace", TRACE, "--config", "{config}", "--limit", "20"], "refusing"),
        (["replay", *TINY, "--config", "{config}"], "unmakeable"),
        (["replay", *TINY, "--config", "{config}"], "held"),
        (["replay", *TINY, "--config", "{config}"], "refusing"),
        (["replay", *TINY, "--config", "{config}"], "huge"),
        (["replay", *TINY, "--dp", "2", "--config", "{config}"], "huge"),
    ],
)
def test_a_configuration_that_cannot_start_is_one_line_and_exit_2(
    configs: dict[str, tuple[str, str]],
    capsys: pytest.CaptureFixture[str],
    command: list[str],
    kind: str,
) -> None:
    path, line = configs[kind]
    status, err = run([a.replace("{config}", path) for a in command], capsys)
    prefix = "error: " if command[0] == "config" else f"hicache {command[0]}: "
    assert status == 2
    (got,) = err.splitlines()
    assert got.startswith(prefix + line) if kind == "huge" else got == prefix + line


def test_replay_with_a_local_store_over_a_host_tier_that_cannot_start(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--store local`` adds its store to the default tiers, which the environment may change."""
    monkeypatch.setenv("HICACHE__TIERS__0__SIZE", "1PiB")
    status, err = run(["replay", *TINY, "--store", "local"], capsys)
    assert status == 2
    (line,) = err.splitlines()
    assert line.startswith("hicache replay: tiers.0.size: 1.05e+06 GiB is more than")


def test_local_store_and_config_together_are_refused(
    configs: dict[str, tuple[str, str]], capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = configs["held"]
    status, err = run(["replay", *TINY, "--store", "local", "--config", path], capsys)
    assert (status, err) == (
        2,
        "hicache replay: --store local adds a store to the default tiers: with --config, name "
        "it there\n",
    )


def test_the_cluster_sweep_refuses_a_configuration(
    configs: dict[str, tuple[str, str]], capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = configs["refusing"]
    status, err = run(["trace", TRACE, "--instances", "1,2", "--config", path], capsys)
    assert (status, err) == (
        2,
        "hicache trace: --instances sizes the tiers by --host-size, --disk-size and "
        "--store-size, not --config\n",
    )


@pytest.mark.parametrize("mode", [["--simulate-only"], ["--model", "llama-8b"]])
def test_modes_that_start_no_cache_plan_a_configuration_meant_for_another_machine(
    configs: dict[str, tuple[str, str]], capsys: pytest.CaptureFixture[str], mode: list[str]
) -> None:
    for kind in ("unmakeable", "held", "refusing"):
        path, _ = configs[kind]
        status, err = run(["trace", TRACE, "--config", path, "--limit", "20", *mode], capsys)
        assert (status, err) == (0, "")


def test_an_embedding_engine_gets_the_same_line_as_a_config_error(
    held: tuple[Path, int], tmp_path: Path
) -> None:
    """What only starting shows, raised by `HiCache` itself: a directory another process holds,
    a metrics port another socket has (the tiers started before are closed again)."""
    import socket

    import torch

    from hicache import HiCache, Layout, PagedBuffer, load_config
    from hicache.errors import ConfigError

    path, pid = held
    layout = Layout(model="m", kv_dtype="uint8", page_tokens=4, page_bytes=64)

    def start(config: str | Path | dict) -> None:
        pool = PagedBuffer.page_first(torch.zeros(8, 64, dtype=torch.uint8))
        HiCache(load_config(config, env={}), pool, layout=layout)

    file = tmp_path / "c.yaml"
    file.write_text(
        f"tiers: [{{type: host, size: 1MiB}}, {{type: disk, path: {path}, size: 1GiB}}]"
    )
    with pytest.raises(ConfigError) as err:
        start(file)
    assert str(err.value) == (
        f"{file}: tiers.1.path: {path}: in use by another process (pid {pid}); give each "
        "process its own path"
    )
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError) as err:
            start({"tiers": [{"type": "host", "size": "1MiB"}], "metrics": {"port": port}})
    assert (
        str(err.value) == f"metrics.port: metrics port {port} on 127.0.0.1 is in use by another "
        "process: give metrics.port another port, or 0 for any free one"
    )
