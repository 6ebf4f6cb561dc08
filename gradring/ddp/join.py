"""Uneven inputs: the DDP side of Join (torch's ``Join`` context manager).

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
    used-bitmap all-reduce               its last global bitmap (as torch)

so nobody waits for a partner that will never come. At the end, the last rank
to join broadcasts its parameters so every replica ends identical.

Everything of Join on the DDP side is here: the division (by the initial
world size or by the ranks still training), the per-forward notification of
a rank still training, the sync flag, the choice of the source rank, the
shadow iteration and the final model sync. The DDP's torch-named Join
methods delegate to these functions; the reducer contributes one primitive,
``shadow_backward()`` (the bucket all-reduces with zero gradients).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.algorithms import join as _torch_join

from gradring.comm import peers
from gradring.group_comm import GroupComm

# gradring's DDP joins torch's own Join context manager: re-exported for users.
Join = _torch_join.Join
Joinable = _torch_join.Joinable
JoinHook = _torch_join.JoinHook

__all__ = ["DDPJoinHook", "Join", "JoinHook", "Joinable", "JoiningDDP"]


class JoiningReducer(Protocol):
    """What Join asks of the DDP's reducer."""

    def set_divide_factor(self, factor: int) -> None: ...

    def rebuild_if_needed(self) -> bool: ...

    def shadow_backward(self) -> None: ...


class JoiningDDP(Protocol):
    """Everything Join reads and calls on a DDP (``ddp/module.py``'s class):
    the group, the device, the reducer, the two syncs, and the two flags
    Join sets (torch's names)."""

    divide_by_initial_world_size: bool
    require_forward_param_sync: bool

    @property
    def comm(self) -> GroupComm: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def reducer(self) -> JoiningReducer: ...

    def _sync_buffers(self, *, active: bool = True) -> None: ...

    def _sync_params_and_buffers(self, src: int, *, buffers: bool = True) -> None: ...

    def _sync_final_model(self, is_last_joiner: bool) -> None: ...


class DDPJoinHook(JoinHook):
    """What a joined rank runs while the others keep training."""

    def __init__(self, ddp: JoiningDDP,
                 divide_by_initial_world_size: bool = True) -> None:
        # The DDP instance whose collectives are shadowed.
        self.ddp = ddp
        set_division(ddp, initial=divide_by_initial_world_size)

    def main_hook(self) -> None:
        shadow_iteration(self.ddp)

    def post_hook(self, is_last_joiner: bool) -> None:
        # Through DDP's method, as torch's hook: it keeps the rank (_authoritative_rank).
        self.ddp._sync_final_model(is_last_joiner)


def any_rank(comm: GroupComm, value: bool, device: torch.device) -> bool:
    """All-reduce a boolean: True when any rank passed True (Join's sync flag)."""
    t = torch.tensor([int(value)], dtype=torch.int32, device=device)
    comm.all_reduce_now(t)
    return bool(t.item())


def highest_rank(comm: GroupComm, cond: bool, device: torch.device) -> int:
    """The highest group rank that passed ``cond=True`` (-1 if none did)."""
    t = torch.tensor([comm.rank if cond else -1], dtype=torch.int64, device=device)
    comm.all_reduce_now(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def set_division(ddp: JoiningDDP, *, initial: bool) -> None:
    """Average over the initial world size, or (``initial=False``) over the ranks
    still training, which each forward then counts (see :func:`notify`)."""
    ddp.divide_by_initial_world_size = initial
    if initial:
        ddp.reducer.set_divide_factor(ddp.comm.world_size)


def notify(ddp: JoiningDDP, sync: bool) -> None:
    """A rank still training, at the start of each forward: Join's all-reduce of
    1 (its sum is the number of such ranks), then the sync flag ``sync``."""
    # torch's Join issues its all-reduce on gloo: a peer dying there is named by
    # gradring (see [Note: naming a peer behind a gloo error] in comm/peers.py).
    with peers.naming_dead_peers(ddp.comm.group, "Join's all-reduce of the ranks still "
                                                 "training"):
        work = Join.notify_join_context(ddp)
        if work is not None:
            work.wait()
    if work is not None:
        if not ddp.divide_by_initial_world_size:
            ddp.reducer.set_divide_factor(int(work.result()[0].item()))
    any_rank(ddp.comm, sync, ddp.device)


def buffer_source(ddp: JoiningDDP, active: bool) -> int:
    """Under Join, the rank whose buffers a forward's sync sends: the highest
    rank still training (``active``), as torch does (rank 0 outside Join)."""
    return highest_rank(ddp.comm, active, ddp.device)


def shadow_iteration(ddp: JoiningDDP) -> None:
    """A joined rank mirrors one training iteration of the others ([Note: shadowing])."""
    should_sync = any_rank(ddp.comm, False, ddp.device)
    if should_sync:
        ddp.reducer.rebuild_if_needed()
    ddp._sync_buffers(active=False)
    ddp.require_forward_param_sync = should_sync
    if should_sync:
        ddp.reducer.shadow_backward()


def sync_final_model(ddp: JoiningDDP, *, is_last_joiner: bool) -> int:
    """After everyone joined: the last joiner's parameters and buffers win.
    Returns that rank (torch's ``_authoritative_rank``)."""
    rank = highest_rank(ddp.comm, is_last_joiner, ddp.device)
    ddp._sync_params_and_buffers(rank)
    return rank
