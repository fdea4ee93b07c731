"""The README works as written: its two commands are there verbatim, every ```yaml block is a
configuration that `hicache config check` accepts (as a file: CPUs and memory are the serving
machine's business), and every ```python block runs as it stands."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from hicache.config import load_config

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
COMMANDS = (
    "python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 . && .venv/bin/hicache replay",
    "bash scripts/test.sh",
)


def blocks(language: str) -> list[tuple[int, str]]:
    """(line number, text) of every fenced block of `language` in the README."""
    text = README.read_text()
    found = []
    for m in re.finditer(rf"^```{language}\n(.*?)^```", text, flags=re.M | re.S):
        found.append((text.count("\n", 0, m.start()) + 1, m.group(1)))
    return found


def test_the_two_commands_for_a_fresh_machine_are_there():
    shell = [text.strip() for _, text in blocks("bash")]
    assert [c for c in COMMANDS if c not in shell] == []


@pytest.mark.parametrize(("line", "text"), blocks("yaml"), ids=lambda v: str(v)[:12])
def test_yaml_blocks_are_valid_configurations(tmp_path, line, text):
    path = tmp_path / f"README-line-{line}.yaml"
    path.write_text(text)
    load_config(path, env={})  # ConfigError names the line's file and the field


@pytest.mark.parametrize(("line", "text"), blocks("python"), ids=lambda v: str(v)[:12])
def test_python_blocks_run(tmp_path, line, text):
    done = subprocess.run(
        [sys.executable, "-c", text], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"README.md line {line}:\n{done.stderr[-2000:]}"


def test_the_readme_stays_a_guide():
    """What, why, two commands, embedding, configuration, a performance summary: details go to
    docs/, so the README stays short enough to read through."""
    lines = len(README.read_text().splitlines())
    assert lines <= 350, f"README.md has {lines} lines: move details to docs/"


HEADLINE = ROOT / "bench" / "results" / "replay_h100_repeats.json"
"""The result file of the README's headline: the command that docs/performance.md shows."""


def headline_figures(res: dict) -> list[str]:
    """The figures the README quotes from the headline's result file, as it writes them: each
    the median over the file's repetitions, with the range beside the ratios."""
    rng = res["range"]
    p50, last = res["ttft_p50_speedup"], res["last_turn_speedup"]
    floor = sorted(row["ratio_to_floor"] for row in res["floor"])
    return [
        f"{p50:.1f}x sooner at the median and the last turn {last:.1f}x sooner (medians of "
        f"{_words[res['repeats']]} runs: {rng['ttft_p50_speedup'][0]:.1f}–"
        f"{rng['ttft_p50_speedup'][1]:.1f}x and {rng['last_turn_speedup'][0]:.1f}–"
        f"{rng['last_turn_speedup'][1]:.1f}x)",
        f"{res['ttft_p50_off_s']:.2f} → {res['ttft_p50_on_s']:.2f} s ({p50:.1f}x, "
        f"{rng['ttft_p50_speedup'][0]:.1f}–{rng['ttft_p50_speedup'][1]:.1f}x) / "
        f"{res['last_turn_ttft_off_s']:.2f} → {res['last_turn_ttft_on_s']:.2f} s ({last:.1f}x, "
        f"{rng['last_turn_speedup'][0]:.1f}–{rng['last_turn_speedup'][1]:.1f}x)",
        f"| {floor[0]:.2f}–{floor[-1]:.2f}x |",
        f"identical, {res['identical_requests']} of {res['requests']}",
    ]


_words = {3: "three", 5: "five"}


def test_the_headline_figures_are_those_of_its_result_file():
    import json

    res = json.loads(HEADLINE.read_text())
    assert res["identical"] and res["setup"]["device_name"].startswith("NVIDIA H100")
    assert res["repeats"] >= 3 and res["command"].startswith("hicache replay ")
    text = " ".join(README.read_text().split())
    assert [f for f in headline_figures(res) if f not in text] == []
