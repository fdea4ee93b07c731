"""What the TP ranks of one engine agree on in a step, before its forward.

With tensor parallelism every block is split across the ranks (each holds its KV heads), each
rank's worker loads its own shard, and attention all-reduces across the ranks: a block that one
rank failed to fill spoils the forward on every rank. So, once each rank has made its loads,
the ranks take the least of what each filled (one all-reduce of a few integers over vLLM's TP
group, on its CPU group), and every rank reports the same failed blocks and stores nothing
computed over them (docs/decisions/vllm-tp-load-agreement.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

Agree = Callable[[list[int]], list[int]]
"""This rank's values -> the least of each over the ranks (every rank gives as many, in the
same order, in the same step)."""


def least_over(group: Any) -> Agree:
    """An `Agree` over the ranks of `group`, a torch.distributed process group that moves CPU
    tensors (vLLM's `get_tp_group().cpu_group`, gloo): one all-reduce (MIN) per call."""

    def agree(values: list[int]) -> list[int]:
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        return [int(v) for v in t.tolist()]

    return agree


def tp_agreement() -> Agree | None:
    """The `Agree` of this worker's TP group in vLLM (None with one rank: nothing to agree)."""
    from vllm.distributed.parallel_state import get_tp_group

    tp = get_tp_group()
    return least_over(tp.cpu_group) if tp.world_size > 1 else None
