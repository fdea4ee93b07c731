"""The CUDA extension behind the page copies: built from ``page_copy.cu`` at first use, loaded,
or, where it cannot be had, None and one warning (the cache then copies with torch)."""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
from pathlib import Path

import torch

from hicache.core import native

__all__ = ["extension", "load_extension", "toolchain_problem"]

# the name the extension's warnings had before this module was split out of cuda.py (log filters)
log = logging.getLogger("hicache.kernels.cuda")

_SOURCE = Path(__file__).with_name("page_copy.cu")
_EXTENSION = "hicache_page_copy"


def toolchain_problem(cuda_home: str | None, cxx: str | None = None) -> str | None:
    """What keeps the extension from being built, as a message, or None when nothing does."""
    nvcc = os.path.join(cuda_home, "bin", "nvcc") if cuda_home else None
    if nvcc is None or not os.access(nvcc, os.X_OK):
        return (
            "building the hicache page-copy kernel needs CUDA's compiler nvcc, and none was found "
            f"(CUDA_HOME={cuda_home!r}); install the CUDA toolkit that torch was built with "
            f"(CUDA {torch.version.cuda}) and set CUDA_HOME, or put nvcc on PATH"
        )
    cxx = cxx or os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"building the hicache page-copy kernel needs a C++ compiler: {cxx!r} is not on PATH"
    return None


def _cache_dir() -> Path:
    root = os.environ.get("HICACHE_KERNEL_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "hicache", "kernels"
    )
    tag = re.sub(r"[^A-Za-z0-9.]+", "_", f"torch{torch.__version__}-cuda{torch.version.cuda}")
    return Path(root) / tag


@functools.cache
def load_extension():
    """Build (first use only; cached on disk by source hash) and import the CUDA extension.

    Raises RuntimeError naming the missing tool when nvcc, a C++ compiler or ninja is missing.
    The build directory is ``$HICACHE_KERNEL_CACHE`` or ``~/.cache/hicache/kernels``; the target
    architecture is torch's (``TORCH_CUDA_ARCH_LIST`` or the visible GPUs).
    """
    from torch.utils import cpp_extension

    problem = toolchain_problem(cpp_extension.CUDA_HOME)
    if problem is None and not cpp_extension.is_ninja_available():
        problem = "building the hicache page-copy kernel needs ninja (pip install ninja)"
    if problem is not None:
        raise RuntimeError(problem)
    build_dir = _cache_dir()
    build_dir.mkdir(parents=True, exist_ok=True)
    log.info("loading the hicache page-copy kernel (built in %s at first use)", build_dir)
    return cpp_extension.load(
        name=_EXTENSION,
        sources=[str(_SOURCE)],
        build_directory=str(build_dir),
        extra_cuda_cflags=["-O3", "-std=c++17"],
        verbose=os.environ.get("HICACHE_KERNEL_VERBOSE") == "1",
    )


@functools.cache
def extension():
    """The loaded extension, or None (one warning logged) where it cannot be had: the cache
    then copies with torch (`CudaRoute`'s ``"torch"`` path, `TorchEvent`)."""
    if not native.enabled():
        return None
    try:
        return load_extension()
    except Exception as err:  # a missing tool, a failed build or load: all end the same
        log.warning(
            "hicache: the CUDA page-copy extension is unavailable (%s); copying with torch "
            "(slower)",
            " ".join(str(err).split())[:300],
        )
        return None
