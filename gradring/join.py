"""Uneven inputs: gradring's DDP as a Joinable.

[Note: shadowing]
Inside ``Join([ddp])`` a rank that ran out of data keeps issuing, once per
iteration of the others, exactly the collectives a training iteration issues,
in the same order, with neutral contents:

    others (forward+backward)            joined rank (main_hook)
    Join's all-reduce of 1               Join's all-reduce of 0 (torch's Join)
    sync-flag all-reduce                 sync-flag all-reduce of 0
    bucket rebuild broadcast (once)      the same rebuild
    buffer broadcast                     buffer broadcast
    bucket all-reduces, in order         the same buckets, all zeros
    used-bitmap all-reduce               a zero bitmap

so nobody waits for a partner that will never come. At the end, the last rank
to join broadcasts its parameters so every replica ends identical.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms import join as _torch_join

# gradring's DDP joins torch's own Join context manager: re-exported for users.
Join = _torch_join.Join
Joinable = _torch_join.Joinable
JoinHook = _torch_join.JoinHook

__all__ = ["Join", "Joinable", "JoinHook", "DDPJoinHook"]


class DDPJoinHook(JoinHook):
    """What a joined rank runs while the others keep training."""

    def __init__(self, ddp: Any, divide_by_initial_world_size: bool = True) -> None:
        # The DDP instance whose collectives are shadowed.
        self.ddp = ddp
        # Average over the initial world size (default) or over the ranks still training.
        ddp.set_join_division(initial=divide_by_initial_world_size)

    @staticmethod
    def notify(ddp: Any) -> None:
        """Called by a non-joined rank at the start of each forward."""
        work = Join.notify_join_context(ddp)
        if work is not None and not ddp.divide_by_initial_world_size:
            work.wait()
            ddp.reducer.set_divide_factor(int(work.result()[0].item()))
        elif work is not None:
            work.wait()

    def main_hook(self) -> None:
        self.ddp.shadow_iteration()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.ddp.sync_final_model(is_last_joiner=is_last_joiner)


def global_flag(comm: Any, value: bool, device: torch.device) -> bool:
    """All-reduce a boolean: True when any rank passed True."""
    t = torch.tensor([int(value)], dtype=torch.int32, device=device)
    comm.all_reduce_now(t)
    return bool(t.item())


def last_joiner_rank(comm: Any, is_last_joiner: bool, device: torch.device) -> int:
    t = torch.tensor([comm.rank if is_last_joiner else -1], dtype=torch.int64, device=device)
    comm.all_reduce_now(t, op=dist.ReduceOp.MAX)
    return int(t.item())
