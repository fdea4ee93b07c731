"""The `hicache` package's import graph: modules, edges, circles and levels.

    python scripts/imports.py [--package hicache ...] [--without hicache.tools ...] [--edges]

Every ``import`` and ``from ... import`` in a module counts, wherever it stands (at the top, in
a function, under ``if TYPE_CHECKING``): a lazy import hides a dependency from Python, not from a
reader. ``from pkg import name`` is an edge to ``pkg.name`` where that is a module, else to
``pkg``. An import of a package's ``__init__`` counts as an edge to it. A circle is a strongly
connected set of two or more modules; a module's level is 1 + the deepest level it imports
(circles collapsed to one node). Prints a summary line, the circles, every arrow back up (an
import of a module in a higher layer of `LAYERS`, or of a module no layer lists), and with
`--edges` every edge. Exits 1 where there is a circle or an arrow back up.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LAYERS: tuple[tuple[str, ...], ...] = (
    ("hicache.errors", "hicache.threads", "hicache.registry", "hicache.config"),  # the base
    ("hicache.core",),  # keys, slot books, cost model, the Match answer
    ("hicache.observability",),  # stats, metrics, events
    ("hicache.kernels",),  # page copies and their completions
    ("hicache.backends",),  # the tier interface and every tier
    ("hicache.chain",),  # the walk down the store tiers, the links, the store jobs
    ("hicache.match", "hicache.store", "hicache.cache", "hicache"),  # the API
    ("hicache.integrations", "hicache.testing", "hicache.tools", "hicache.cli"),  # on top
)
"""The packages of `hicache`, lowest first: a module imports only its own layer and those below
(`hicache` is the package's ``__init__`` alone; a name covers its subpackages)."""


def layer(module: str) -> int | None:
    """The index in `LAYERS` of the longest name that covers `module`; None where none does."""
    best, found = -1, None
    for i, names in enumerate(LAYERS):
        for name in names:
            covers = module == name or (name != "hicache" and module.startswith(name + "."))
            if covers and len(name) > best:
                best, found = len(name), i
    return found


def arrows_up(graph: dict[str, set[str]]) -> list[str]:
    """Imports of a module in a higher layer than the importer's, or of a module (or by a
    module) no layer lists, as ``a -> b`` lines."""
    out = []
    for name in sorted(graph):
        for target in sorted(graph[name]):
            mine, theirs = layer(name), layer(target)
            if mine is None or theirs is None or theirs > mine:
                out.append(f"{name} -> {target}")
    return out


def modules(package: str) -> dict[str, Path]:
    """Dotted name -> file for every module of `package` under the repository root."""
    out = {}
    for path in sorted((ROOT / package.replace(".", "/")).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of `known` that module `name` imports."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor if is_pkg else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" for alias in node.names]
            targets = [t if t in known else base for t in targets]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` of a name inside a module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected sets of two or more modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                out.append(sorted(scc))

    sys.setrecursionlimit(10_000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def levels(graph: dict[str, set[str]], sccs: list[list[str]]) -> int:
    """The number of levels, circles collapsed."""
    rep = {m: scc[0] for scc in sccs for m in scc}
    memo: dict[str, int] = {}

    def level(v: str) -> int:
        v = rep.get(v, v)
        if v not in memo:
            memo[v] = 0  # guards the walk inside a collapsed circle
            members = [m for m in graph if rep.get(m, m) == v]
            deps = {rep.get(w, w) for m in members for w in graph[m]} - {v}
            memo[v] = 1 + max((level(w) for w in deps), default=0)
        return memo[v]

    return max((level(v) for v in graph), default=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--package", action="append", help="a package to read (default: hicache)")
    ap.add_argument("--without", action="append", default=[], help="leave out this subpackage")
    ap.add_argument("--edges", action="store_true", help="list every edge")
    args = ap.parse_args()
    packages = args.package or ["hicache"]
    known = {k: v for package in packages for k, v in modules(package).items()}
    known = {
        k: v
        for k, v in known.items()
        if not any(k == w or k.startswith(w + ".") for w in args.without)
    }
    graph = {name: imports_of(name, path, known) for name, path in known.items()}
    sccs = circles(graph)
    n_edges = sum(len(v) for v in graph.values())
    print(
        f"{' + '.join(packages)}: {len(known)} modules, {n_edges} import edges, "
        f"{len(sccs)} circles, {levels(graph, sccs)} levels"
    )
    for scc in sccs:
        print("circle:", " ".join(scc))
    up = arrows_up(graph) if packages == ["hicache"] else []
    print(f"{len(up)} arrows back up")
    for line in up:
        print("arrow back up:", line)
    if args.edges:
        for name in sorted(graph):
            for target in sorted(graph[name]):
                print(f"{name} -> {target}")
    if sccs or up:
        sys.exit(1)


if __name__ == "__main__":
    main()
