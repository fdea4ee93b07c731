"""Shared test fixtures. The real Mooncake master fixture lives in `mooncake_master.py`."""

pytest_plugins = ["mooncake_master"]
