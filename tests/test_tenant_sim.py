"""The tenants' simulation (`hicache.testing.tenant_sim`, issue 60): its CI seeds run clean and
reach every coverage mark of encryption, quotas, shares (host and disk), attach and detach;
each canary (a plaintext put of an encrypted tenant, a detached tier still read, a quota or a
share not kept on the host or the disk) fails its catching seed for its own reason."""

from __future__ import annotations

import re

import pytest

from hicache.core import marks
from hicache.testing import tenant_sim

pytest.importorskip("cryptography")

CI_SEEDS = (0, 1, 2)


def test_tenant_sim_ci_seeds_run_clean_and_reach_every_encrypt_quota_attach_detach_mark():
    with marks.counting() as counts:
        errors = [tenant_sim.run(seed) for seed in CI_SEEDS]
    assert errors == [None] * len(CI_SEEDS)
    assert {name: counts.get(name, 0) > 0 for name in tenant_sim.MARKS} == dict.fromkeys(
        tenant_sim.MARKS, True
    ), counts


@pytest.mark.parametrize("canary", sorted(tenant_sim.CANARIES))
def test_tenant_sim_catches_each_canary_for_its_own_reason(canary):
    error = tenant_sim.run(tenant_sim.CATCHERS[canary], canary=canary)
    assert error is not None and re.search(tenant_sim.EXPECT[canary], error), error
