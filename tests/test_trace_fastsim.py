"""The compiled one-tier simulation equals PolicySim and the offline reference exactly."""

from __future__ import annotations

import numpy as np
import pytest
from test_trace import make_trace

from hicache.core.eviction import policy_names
from hicache.tools.trace import fastsim
from hicache.tools.trace.chainsim import StoreSim
from hicache.tools.trace.simulate import PolicySim
from hicache.tools.trace.workload import Workload, page_ids, read_trace


@pytest.fixture(scope="module")
def requests(tmp_path_factory: pytest.TempPathFactory) -> list:
    return read_trace(make_trace(tmp_path_factory.mktemp("fast") / "t.jsonl", n=400, seed=11))


def test_flat_page_ids_are_page_ids(requests: list) -> None:
    for P in (100, 128, 512, 1024):
        w = Workload(requests, P)
        assert w.pages == [page_ids(r, P) for r in requests]
        assert w.visits == sum(len(p) for p in w.pages)
        assert w.unique_pages == len({p for ids in w.pages for p in ids})


@pytest.mark.parametrize("page_tokens", [128, 512])
@pytest.mark.parametrize("policy", [*policy_names(), fastsim.OFFLINE])
def test_compiled_and_python_agree_exactly(requests: list, page_tokens: int, policy: str) -> None:
    w = Workload(requests, page_tokens)
    results = set()
    for frac in (0.03, 0.1, 0.3, 1.0):
        cap = max(1, round(frac * w.unique_pages))
        for floor in (1, 700):
            fast = fastsim.simulate(w, policy, cap, floor)
            slow = fastsim.simulate(w, policy, cap, floor, python=True)
            assert fast == slow
            results.add(fast.hit_tokens)
    assert len(results) > 3  # the capacities and caps matter: not a trivial agreement


def test_python_path_is_policysim_and_offline_is_the_ceiling(requests: list) -> None:
    w = Workload(requests, 128)
    cap = w.unique_pages // 10
    assert fastsim.simulate(w, "arc", cap, python=True) == w.simulate(PolicySim(cap, 128, 1, "arc"))
    offline = fastsim.simulate(w, fastsim.OFFLINE, cap)
    assert offline == w.offline(cap)
    for name in policy_names():
        assert fastsim.simulate(w, name, cap).hit_tokens <= offline.hit_tokens


@pytest.mark.parametrize("page_tokens", [128, 512])
def test_compiled_chain_equals_the_python_chain(requests: list, page_tokens: int) -> None:
    """Every per-request figure, for chains of zero, one and two store tiers (group sizes,
    write: off, a tier the cost model passes over), caps, and host sizes."""
    w = Workload(requests, page_tokens)
    U = w.unique_pages
    chains = [
        [],
        [StoreSim("disk", U // 16, 4)],
        [StoreSim("disk", U // 30, 4), StoreSim("mooncake", U // 8, 2)],
        [StoreSim("disk", U // 16, 4, worth=False)],
        [StoreSim("disk", U // 16, 1, write="off"), StoreSim("mooncake", U, 4)],
    ]
    served = set()
    for host in (U // 20, U // 5, U):
        for stores in chains:
            for floor in (1, 700):
                a = fastsim.run_chain(w, host, stores, min_recompute_tokens=floor)
                b = fastsim.run_chain(w, host, stores, min_recompute_tokens=floor, python=True)
                for x, y in ((a.hit, b.hit), (a.tier_pages, b.tier_pages), (a.reads, b.reads)):
                    assert np.array_equal(x, y)
                assert np.array_equal(a.written, b.written)
                assert (a.host_evicted, a.dropped, a.fetches) == (
                    b.host_evicted,
                    b.dropped,
                    b.fetches,
                )
                served.add(tuple(a.tier_pages.sum(axis=0)))
    assert len(served) > 20  # the settings matter: not a trivial agreement
