"""Shared test fixtures. The real Mooncake master fixture lives in `mooncake_master.py`."""

import pytest

from hicache.core import native

pytest_plugins = ["mooncake_master"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `native` check the compiled helpers themselves: skipped (not failed) where
    HICACHE_NO_NATIVE=1 turns them off, and run everywhere else.

    On pytest-xdist's workers (scripts/test.sh: two, a file to a worker, in this order with
    ``--no-loadscope-reorder``) the files that hold a test marked `slow` go first: the longest,
    started last, would leave one worker running them alone at the end."""
    if hasattr(config, "workerinput"):
        slow = {item.path for item in items if item.get_closest_marker("slow")}
        items.sort(key=lambda item: item.path not in slow)  # stable: the rest keep their order
    if native.enabled():
        return
    skip = pytest.mark.skip(reason=f"{native.DISABLE_ENV}=1: the C helpers are off")
    for item in items:
        if "native" in item.keywords:
            item.add_marker(skip)
