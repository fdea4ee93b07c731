"""What keeps a configuration from starting on this machine, found before a tool starts it.

The tools that start a cache from a user's configuration (`hicache trace` with the real cache,
`hicache replay`) call `start_problem` before any work, so that what can be known up front fails
in one line within seconds: a tier that does not fit here (memory, CPUs, a directory it cannot
create: each tier's ``check_machine``) and a Mooncake master that does not answer (the cache
would keep reconnecting in the background). What only starting shows (a directory another
process holds) is raised by `hicache.HiCache` as a ConfigError naming the field, which the
``hicache`` command prints as one line too.
"""

from __future__ import annotations

from hicache.config import HiCacheConfig
from hicache.tools.mooncake_local import master_problem


def start_problem(config: HiCacheConfig, where: str = "") -> str | None:
    """The first reason `config` (read from the file `where`, if any) cannot start here, as one
    line naming the file and the field; None if none is found."""
    problems = config.machine_problems(where)
    if problems:
        return problems[0]
    for i, tier in enumerate(config.tiers):
        address = getattr(tier, "master_address", None)
        problem = address and master_problem(address)
        if problem:
            field = f"tiers.{i}.master_address: {problem}"
            return f"{where}: {field}" if where else field
    return None
