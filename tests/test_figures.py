"""Every figure the README prints is read from the committed result file it names.

`FIGURES` lists them: each entry names its result files under bench/results/ and a function that
reads the figures from those files and writes them as the README does; the tests find each in
the README (whitespace aside). An entry for a row of the README's "## Performance" table also
needs the row's "where" cell to name its files, and every number in the row's "measured" cell
to be one that the entry wrote. Every row of that table has an entry (or a test, `TESTED`).

To add a figure: a function `def name(*results) -> list[str]` (the files' JSON, in the order
the entry names them) and a `Figures(...)` line in `FIGURES`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RESULTS = ROOT / "bench" / "results"
KIB = 1024
MIB = 1024 * KIB


@dataclass(frozen=True)
class Figures:
    """Figures of the README read from committed result files."""

    files: tuple[str, ...]
    """Result files under bench/results/, passed to `read` as JSON in this order."""
    read: Callable[..., list[str]]
    """The figures, each formatted exactly as the README prints it."""
    row: str | None = None
    """The start of the Performance table row's first cell; None: the figures are in prose."""

    @property
    def id(self) -> str:
        return self.read.__name__


# --- formatting ---------------------------------------------------------------------------


def span(values: list[float], fmt: str, unit: str = "") -> str:
    """`lo–hi` of `values` (one figure where both ends print alike), then `unit`."""
    lo, hi = format(min(values), fmt), format(max(values), fmt)
    return (lo if lo == hi else f"{lo}–{hi}") + unit


def bold(text: str, missed: bool) -> str:
    """The README prints a figure that misses its target in bold."""
    return f"**{text}**" if missed else text


def listed(values: list[float], limit: float) -> str:
    """`values` in ascending order as ratios, those above `limit` in one bold run."""
    under = [f"{v:.2f}x" for v in sorted(values) if v <= limit]
    over = [f"{v:.2f}x" for v in sorted(values) if v > limit]
    return ", ".join(under + ([bold(", ".join(over), True)] if over else []))


def met(missed: bool) -> str:
    return "**not met**" if missed else "met"


# --- page copies: bench/kernels.py ---------------------------------------------------------


def ratio(res: dict, case: str, page_bytes: int, direction: str) -> float:
    """The ratio to the contiguous ceiling of the one row of `case` at that size and direction."""
    (row,) = (
        r
        for r in res["rows"]
        if (r["case"], r["page_bytes"], r["direction"]) == (case, page_bytes, direction)
    )
    return row["ratio"]


def page_copies(k: dict) -> list[str]:
    ratios = [
        r["ratio"]
        for r in k["rows"]
        if r["case"] == "pages_auto" and r["page_bytes"] >= 512 * KIB and r["direction"] != "both"
    ]
    return [f"{100 * min(ratios):.1f}–{100 * max(ratios):.2f} %"]


def small_pages(h200: dict, h100: dict) -> list[str]:
    def auto(res: dict, direction: str) -> str:
        return f"{100 * ratio(res, 'pages_auto', 64 * KIB, direction):.1f} %"

    kernel = 100 * ratio(h100, "pages_kernel", 64 * KIB, "d2h")
    return [
        f"{auto(h200, 'h2d')} host → GPU, {auto(h200, 'd2h')} GPU → host; "
        f"H100: {auto(h100, 'h2d')}, {auto(h100, 'd2h')} (the kernel alone {kernel:.1f} %"
    ]


def both_directions(k: dict) -> list[str]:
    both = [r for r in k["rows"] if r["direction"] == "both"]
    pages = [r["gbps"] for r in both if r["case"] == "pages_auto"]
    (vllm,) = (r["gbps"] for r in both if r["case"] == "vllm_auto")
    return [f"{span(pages, '.1f')} GB/s ({vllm:.1f} on vLLM's layout)"]


def layer_first(k: dict) -> list[str]:
    return [
        span(
            [100 * r["vs_page_first"] for r in k["rows"] if r["case"] == "segmented_auto"],
            ".1f",
            " %",
        )
    ]


def vllm_layout(k: dict) -> list[str]:
    h2d, d2h = (100 * ratio(k, "vllm_auto", 2 * MIB, d) for d in ("h2d", "d2h"))
    return [f"{h2d:.1f} % host → GPU, {d2h:.1f} % GPU → host"]


def gemm(k: dict) -> list[str]:
    """A GEMM loop's time with the copies beside it over its time alone, `copy_pages`'s paths."""
    slow = [
        100 * (r["gemm_ms_with_copies"] / r["gemm_ms_alone"] - 1)
        for r in k["rows"]
        if r["case"] == "gemm_concurrent" and r["path"] == "auto"
    ]
    return [f"+{min(slow):.1f} to +{max(slow):.1f} %"]


# --- match and the trace: bench/trace.py, bench/trace_agentic.py ---------------------------


def match_latency(m: dict) -> list[str]:
    got = m["results"]["match_int32_array"]
    return [f"{got['median_us'] / 1000:.2f} ms (p50; p90 {got['p90_us'] / 1000:.1f} ms"]


def match_per_page(t: dict) -> list[str]:
    per_page = t["match_us_per_page"]
    trace, head = ([p["match"] for p in per_page[w].values()] for w in ("trace", "shared_head"))
    return [
        f"trace {span(trace, '.2f', ' µs')} (every policy); "
        f"one head {span(head, '.2f', ' µs')}: {met(max(head) > 0.5)}"
    ]


def real_cache_against_simulation(t: dict) -> list[str]:
    r = t["replay"]
    same = r["hit_share"] == r["policy_sim_share"]
    return [f"{'equal' if same else 'not equal'}, {r['wrong_bytes']} wrong bytes"]


def hit_share(t: dict) -> list[str]:
    def shares(policy: str, key: str = "hit_share") -> str:
        at = {r["host_fraction"]: r[key] for r in t["sweep"] if r["policy"] == policy}
        return " / ".join(f"{100 * at[f]:.1f}" for f in (0.02, 0.05, 0.1))

    return [f"{shares('arc')} % against {shares('lru')} % and {shares('lru', 'belady_share')} %"]


def simulation_speed(a: dict) -> list[str]:
    def speed(prefix: str, fmt: str = ".0f") -> str:
        runs = [s["compiled"]["m_visits_per_s"] for s in a["speed"] if s["run"].startswith(prefix)]
        return span(runs, fmt, " M")

    return [
        f"LRU {speed('lru ')}, ARC {speed('arc ')}, S3-FIFO {speed('s3fifo ')}, "
        f"planner {speed('planner ')}, offline reference {speed('offline ', '.1f')}; "
        f"the whole sweep {a['sweep_seconds']:.1f} s"
    ]


# --- tiers: bench/tiers.py, bench/codec.py -------------------------------------------------


def disk_against_raw(d: dict) -> list[str]:
    rows = [
        r
        for r in d["rows"]
        if r["tier"] in ("disk", "disk(sync=false)") and r["object_bytes"] >= MIB
    ]
    ratios = [r["ratio"] for r in rows]
    rounds = [x for r in rows for x in r["ratio_range"]]
    return [
        f"{span(ratios, '.2f')} (VM; one round's ratio {span(rounds, '.2f')}): "
        f"{met(min(ratios) < 0.9)}"
    ]


def codec(c: dict) -> list[str]:
    (bf16,) = {r["ratio"] for r in c["rows"] if r["dtype"] == "bfloat16"}
    (disk,) = (r for r in c["disk"] if r["mode"] == "lossless")
    return [
        f"{bf16:.2f} / {disk['vs_raw']:.2f}x ({span(disk['vs_raw_rounds'], '.2f', 'x')} a round)"
    ]


def codec_prose(c: dict) -> list[str]:
    (bf16,) = {r["ratio"] for r in c["rows"] if r["dtype"] == "bfloat16"}
    return [f"({bf16:.2f}x on bf16"]


def engine_thread(h200: dict, h100: dict) -> list[str]:
    def p99(res: dict) -> str:
        row = {r["call"]: r for r in res["rows"]}
        ratios = [row[c]["host_mooncake_wall_p99_over_host_only"] for c in ("match_first", "store")]
        walls = [row[c]["host_mooncake"]["wall_p99_us"] for c in ("match_first", "store")]
        return (
            " / ".join(bold(f"{x:.2f}x", x > 1.5) for x in ratios)
            + f" ({' / '.join(f'{w:.0f}' for w in walls)} µs)"
        )

    return [f"{p99(h200)}; H100 host, {h100['workload']['rounds']} rounds: {p99(h100)}"]


# --- the reference engine: bench/replay.py -------------------------------------------------


def by_layer(h100: dict, h200: dict) -> list[str]:
    def ratios(res: dict, new_tokens: int) -> list[float]:
        hits = res["host_hits"]
        return [h["ratio_to_overlap_floor"] for h in hits if h["new_tokens"] == new_tokens]

    h200_512 = ratios(h200, 512)
    return [
        f"H100: {listed(ratios(h100, 512), 1.10)} with 512 new tokens, "
        f"{span(ratios(h100, 2048), '.2f', 'x')} with 2,048; "
        f"H200, earlier: {bold(span(h200_512, '.2f', 'x'), max(h200_512) > 1.10)}"
    ]


def partial_fetch(t: dict) -> list[str]:
    rows = [r for r in t["slow_tier"] if 0.5 <= r["tier_over_recompute"] <= 2]
    good = [r["partial_over_best"] for r in rows if r["partial_over_best"] <= 0.8]
    bad = [r for r in rows if r["partial_over_best"] > 0.8]
    return [
        f"{span(good, '.2f', 'x')}, "
        + ", ".join(
            f"**{r['partial_over_best']:.2f}x** at {r['tier_over_recompute']:g}x" for r in bad
        )
    ]


# --- vLLM: bench/vllm.py -------------------------------------------------------------------


def target(v: dict, name: str) -> dict:
    return v["targets"][name]


def within(t: dict) -> str:
    """The range of a target's ratio over the repetitions."""
    return f"{t['per_rep']['min']:.2f}–{t['per_rep']['max']:.2f}x"


def vllm_reuse(v: dict) -> list[str]:
    alone, floor = target(v, "reuse_p50_vs_vllm"), target(v, "reuse_p50_vs_floor")
    identical = all(w["answers_identical_to_vllm"] for w in v["summary"].values())
    missed = not (alone["met"] and floor["met"])
    return [
        f"{alone['value']:.2f}x / {floor['value']:.2f}x: {met(missed)}",
        "answers identical" if identical else "answers differ",
    ]


def vllm_lmcache(v: dict) -> list[str]:
    p50, p90 = target(v, "reuse_p50_vs_lmcache"), target(v, "reuse_p90_vs_lmcache")
    chunk = v["targets"]["lmcache_best"].removeprefix("lmcache")
    return [
        f"its best chunk size, {chunk}",
        f"{p50['value']:.2f}x / {p90['value']:.2f}x ({within(p50)} / {within(p90)} within a "
        f"repetition): {met(not (p50['met'] and p90['met']))}",
    ]


def vllm_no_reuse(v: dict) -> list[str]:
    t = target(v, "no_reuse_p50_vs_vllm")
    return [f"{t['value']:.2f}x: {met(not t['met'])}"]


def vllm_second_instance(v: dict, tails: dict) -> list[str]:
    store, disk = (
        target(v, "second_mooncake_p50_vs_lmcache"),
        target(tails, "second_instance_p50_vs_lmcache"),
    )
    return [
        f"{store['value']:.2f}x: {met(not store['met'])} (through the disk tier "
        f"{disk['value']:.2f}x, {tails['workload']['reps']} repetitions)"
    ]


def vllm_prose(v: dict) -> list[str]:
    alone = target(v, "reuse_p50_vs_vllm")["value"]
    p50, p90 = (target(v, f"reuse_{p}_vs_lmcache")["value"] for p in ("p50", "p90"))
    return [
        f"cut vLLM alone's median TTFT to {alone:.2f}x, and LMCache's best to {p50:.2f}x at the "
        f"median and {p90:.2f}x at the p90 (`bench/results/vllm_cpu.json`"
    ]


# --- the reference engine's replay: hicache replay --------------------------------------------


def replay_headline(r: dict) -> list[str]:
    rng = r["range"]
    p50 = f"{r['ttft_p50_speedup']:.1f}x, {span(rng['ttft_p50_speedup'], '.1f', 'x')}"
    last = f"{r['last_turn_speedup']:.1f}x, {span(rng['last_turn_speedup'], '.1f', 'x')}"
    return [
        f"{r['ttft_p50_off_s']:.2f} → {r['ttft_p50_on_s']:.2f} s ({p50}) / "
        f"{r['last_turn_ttft_off_s']:.2f} → {r['last_turn_ttft_on_s']:.2f} s ({last})",
        f"medians of {r['repeats']} runs",
    ]


def replay_answers(r: dict, noexact: dict) -> list[str]:
    return [
        f"identical, {r['identical_requests']} of {r['requests']}",
        f"{noexact['identical_requests']} of {noexact['requests']} without it",
    ]


def replay_demo(r: dict) -> list[str]:
    rng = r["range"]["ttft_p50_speedup"]
    return [
        f"{r['ttft_p50_off_s']:.2f} → {r['ttft_p50_on_s']:.2f} s ({r['ttft_p50_speedup']:.1f}x, "
        f"{span(rng, '.1f', 'x')}), {100 * r['cached_token_share']:.1f} % of prompt tokens "
        f"cached ({100 * r['gpu_cached_share_off']:.1f} % by the engine alone), outputs "
        + ("identical" if r["identical"] else "NOT identical"),
        f"medians of {r['repeats']} runs",
    ]


def replay_demo_output(r: dict) -> list[str]:
    """The quick start's output block: its TTFT rows and its answers."""

    def ms(key: str) -> str:
        lo, hi = r["range"][key]
        return f"{r[key] * 1e3:.1f} ms [{lo * 1e3:.0f}–{hi * 1e3:.0f}]"

    return [
        f"TTFT p50 {ms('ttft_p50_off_s')} {ms('ttft_p50_on_s')}",
        f"TTFT p90 {ms('ttft_p90_off_s')} {ms('ttft_p90_on_s')}",
        f"outputs identical yes ({r['identical_requests']} of {r['requests']})",
        f"median of {r['repeats']} repetitions",
    ]


def replay_floor(r: dict) -> list[str]:
    return [span([row["ratio_to_floor"] for row in r["floor"]], ".2f", "x")]


FIGURES = [
    Figures(("vllm_cpu.json",), vllm_prose),
    Figures(("replay_cpu.json",), replay_demo_output),
    Figures(("codec_h100.json",), codec_prose),
    Figures(("kernels_h200.json",), page_copies, "page copies against a contiguous"),
    Figures(("kernels_h200.json", "kernels_h100_64k.json"), small_pages, "the same, 64 KiB pages"),
    Figures(("kernels_h200.json",), both_directions, "both directions at once"),
    Figures(("kernels_h200.json",), layer_first, "layer-first pool"),
    Figures(("kernels_h200.json",), vllm_layout, "vLLM's layout"),
    Figures(("kernels_h200.json",), gemm, "a bf16 GEMM slowed"),
    Figures(("trace_match_latency_vm.json",), match_latency, "`match` of a 128K-token prompt"),
    Figures(("trace_cpu.json",), match_per_page, "`match` per page"),
    Figures(("trace_cpu.json",), real_cache_against_simulation, "hit share of the real cache"),
    Figures(("trace_cpu.json",), hit_share, "hit share at 2 / 5 / 10 %"),
    Figures(("trace_agentic_cpu.json",), simulation_speed, "one simulated configuration"),
    Figures(("tiers_disk_cpu.json",), disk_against_raw, "disk tier against raw parallel I/O"),
    Figures(("codec_h100.json",), codec, "lossless codec"),
    Figures(("tiers_h200.json", "tiers_h100.json"), engine_thread, "engine-thread wall-clock p99"),
    Figures(("ttft_h100.json", "ttft_h200.json"), by_layer, "host-hit TTFT loaded layer by layer"),
    Figures(("ttft_h100.json",), partial_fetch, "partial fetch from a throttled store tier"),
    Figures(("vllm_cpu.json",), vllm_reuse, "vLLM + hicache reuse TTFT p50"),
    Figures(("vllm_cpu.json",), vllm_lmcache, "the same against vLLM + LMCache"),
    Figures(
        ("vllm_cpu.json",), vllm_no_reuse, "vLLM + hicache TTFT p50 against vLLM alone, prompts"
    ),
    Figures(
        ("vllm_cpu.json", "vllm_cpu_tails.json"), vllm_second_instance, "a second vLLM instance"
    ),
    Figures(("replay_h100_repeats.json",), replay_headline, "engine + hicache against the same"),
    Figures(
        ("replay_h100_repeats.json", "replay_h100_msg512_noexact.json"),
        replay_answers,
        "the same runs, bf16",
    ),
    Figures(("replay_h100_repeats.json",), replay_floor, "the same in `hicache replay`"),
    Figures(("replay_cpu.json",), replay_demo, "default `hicache replay`"),
]

TESTED = {
    "the planner's hits per tier": (
        "tests/test_trace_planner.py",
        "test_the_real_cache_hits_each_tier_as_the_planner_predicts",
        "equal, 0 wrong bytes",
    ),
}
"""Rows whose figure is what a test asserts (CI runs it): the row's start, the test's file and
function (the row's "where" cell names the file), and the figure."""

PENDING: tuple[str, ...] = ()
"""Rows whose figures are being re-measured (test_readme.py checks the headline's): give each
an entry in `FIGURES` and take it out of here."""


# --- the README ----------------------------------------------------------------------------


def normalised(text: str) -> str:
    return " ".join(text.split())


def performance_rows() -> dict[str, list[str]]:
    """The Performance table's rows by their first cell: what, target, measured, where."""
    section = README.read_text().split("\n## Performance\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("| ")][2:]
    rows = [[normalised(c) for c in line.strip().strip("|").split(" | ")] for line in lines]
    return {r[0]: r for r in rows}


def the_row(start: str) -> list[str]:
    (row,) = (r for what, r in performance_rows().items() if what.startswith(start))
    return row


NUMBER = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?")
"""A figure: not a digit inside a name (H100, p50, S3-FIFO)."""


def load(entry: Figures) -> list[str]:
    return entry.read(*(json.loads((RESULTS / f).read_text()) for f in entry.files))


@pytest.mark.parametrize("entry", FIGURES, ids=lambda e: e.id)
def test_the_readme_prints_the_figures_of_its_result_files(entry: Figures) -> None:
    text = " ".join(the_row(entry.row)) if entry.row else normalised(README.read_text())
    assert [f for f in load(entry) if normalised(f) not in text] == []


@pytest.mark.parametrize("entry", [e for e in FIGURES if e.row], ids=lambda e: e.id)
def test_a_rows_where_cell_names_its_result_files(entry: Figures) -> None:
    where = the_row(entry.row)[-1]
    assert [f for f in entry.files if f"`{f}`" not in where] == []


@pytest.mark.parametrize("entry", [e for e in FIGURES if e.row], ids=lambda e: e.id)
def test_every_number_a_row_measured_comes_from_its_files(entry: Figures) -> None:
    measured = the_row(entry.row)[2]
    for figure in load(entry):
        measured = measured.replace(normalised(figure), " ")
    assert NUMBER.findall(measured) == []


@pytest.mark.parametrize("start", TESTED)
def test_a_tested_row_names_its_test(start: str) -> None:
    path, function, figure = TESTED[start]
    row = the_row(start)
    assert f"def {function}(" in (ROOT / path).read_text()
    assert (row[2], f"`{path}`" in row[-1]) == (figure, True)


def test_every_performance_row_has_its_figures_checked() -> None:
    claimed = [e.row for e in FIGURES if e.row] + list(TESTED) + list(PENDING)
    rows = performance_rows()
    assert [w for w in rows if not any(w.startswith(c) for c in claimed)] == []
    assert [c for c in claimed if sum(w.startswith(c) for w in rows) != 1] == []
