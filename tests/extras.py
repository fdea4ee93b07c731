"""Tests that need an optional extra of the package skip where it is not installed, and fail
instead where ``HICACHE_REQUIRE_<EXTRA>=1`` says it must be there: CI sets it for every extra it
installs, so that nothing it should run is skipped."""

from __future__ import annotations

import importlib
import os

import pytest


def require(extra: str, missing: str | None) -> None:
    """Skip the calling test (or module, at import) when `missing` says why `extra` cannot be
    used here; fail it instead under ``HICACHE_REQUIRE_<EXTRA>=1``. Nothing when `missing` is
    None."""
    if missing is None:
        return
    var = f"HICACHE_REQUIRE_{extra.upper()}"
    if os.environ.get(var) == "1":
        pytest.fail(f"{var}=1 but {missing}", pytrace=False)
    pytest.skip(missing, allow_module_level=True)


def import_problem(module: str, extra: str) -> str | None:
    """Why `module` (of the extra `extra`) does not import, or None."""
    try:
        importlib.import_module(module)
    except ImportError as err:
        return f"{module} does not import ({err}): install the '{extra}' extra"
    return None


def require_plot() -> None:
    """matplotlib, of the ``plot`` extra (for ``--plot``)."""
    require("plot", import_problem("matplotlib", "plot"))
