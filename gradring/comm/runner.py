"""Running one issued collective: pick the transport and algorithm, run it, report.

The engine thread (or the caller, for a synchronous call on shm) runs each
:class:`Plan` through :func:`run`, in issue order. Algorithms come from the
registry (``algos/__init__.py``), the choice from ``select.py``, and failures
go through the group's :class:`~gradring.comm.failures.Failures`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from gradring.comm import algos, desync, select
from gradring.comm.algos import direct
from gradring.comm.external import ExternalParts
from gradring.comm.ops import Op
from gradring.comm.recorder import Entry
from gradring.comm.store import exchange_lists, group_store, instance_prefix
from gradring.comm.transport import CollectiveError, CollectiveInfo, Kind
from gradring.comm.transports.shm import space
from gradring.comm.transports.shm.space import ShmExhausted

if TYPE_CHECKING:
    from gradring.comm.context import GroupContext


class Plan(NamedTuple):
    """One issued collective, as the engine runs it."""

    kind: Kind
    output: torch.Tensor  # written (all_reduce/broadcast: the tensor itself)
    input: torch.Tensor  # read (same object as output for in-place collectives)
    op: Op  # reduction (SUM for copies)
    root: int  # broadcast source, as a group rank
    seq: int  # issue number within the group, identical on every rank
    env: select.Overrides  # GRADRING_TRANSPORT / GRADRING_ALGO at issue time
    entry: Entry | None = None  # its flight-recorder entry
    parts: ExternalParts | None = None  # all_reduce only: see [Note: external parts]


def run(ctx: GroupContext, plan: Plan) -> None:
    """Run ``plan`` on the calling thread (engine or inline) for group ``ctx``."""
    try:
        _run(ctx, plan)
    except ShmExhausted as exc:
        # Every rank raised it in this collective (shm/space.py): all fall back together.
        shm = ctx.transports.existing_shm()
        in_use = _largest_holding(ctx, shm.memory.reserved if shm else 0)
        advice = space.advice(exc.needed, in_use, ctx.world_size)
        ctx.transports.drop_shm(str(exc))
        if plan.env.transport == "shm":
            err = CollectiveError(f"{exc}; GRADRING_TRANSPORT=shm forbids falling back to "
                                  f"the process group. {advice}")
            ctx.failures.record(plan.entry, err)
            raise err from None
        space.warn_once(advice + "; gradring now runs this group's collectives over the "
                        "process group instead (slower)")
        _run(ctx, plan)


def _largest_holding(ctx: GroupContext, mine: int) -> int:
    """The most /dev/shm bytes any rank of the group holds, so that every rank advises
    the same figure (see [Note: one figure, two causes] in ``shm/space.py``). Every rank
    raised ``ShmExhausted`` in the same collective, so every rank asks: one store round
    (``mine`` alone if a peer does not answer within 2 s)."""
    try:
        tag = instance_prefix(group_store(ctx.group), "shm-room", ctx.world_size)
    except Exception:  # noqa: BLE001 - no store: this rank's own figure
        return mine
    theirs = exchange_lists(ctx, tag, [mine])
    return max([mine] + [v[0] for v in theirs.values() if v and type(v[0]) is int])


def _run(ctx: GroupContext, plan: Plan) -> None:
    out, copy_back = _flat(plan.output)
    inp = out if plan.input is plan.output else _flat(plan.input)[0]
    entry = plan.entry
    label, transport = "?", None
    try:
        label, transport = select.pick_transport(ctx.transports, plan.env.transport, ctx.name)
        nbytes = inp.numel() * inp.element_size()
        choice = select.choose(plan.kind, nbytes, ctx.world_size, label, plan.env.algo)
        info = CollectiveInfo(plan.seq, plan.kind, nbytes, inp.dtype,
                              f"{choice.algo} over {choice.transport}", ctx.name,
                              tuple(plan.input.shape), entry.label if entry else None)
        if entry is not None:
            entry.start(info.algo)
        transport.start(info)
        algos.run(choice.algo, transport,
                  algos.Call(info, out, inp, plan.op, plan.root, plan.parts))
        finish = getattr(transport, "finish", None)
        if finish is not None:
            finish()  # shm's closing agreement: see [Note: sticky failures]
    except ShmExhausted:
        raise  # not a failure: run() falls back
    except BaseException as exc:
        err = _failed(ctx, entry, label, transport, exc)
        if err is exc:
            raise
        raise err from (None if isinstance(exc, desync.DesyncError) else exc)
    if copy_back:
        plan.output.copy_(out.view(plan.output.shape))
    if entry is not None:
        entry.finish()
    ctx.last_seq = plan.seq


def run_small_all_reduce(ctx: GroupContext, entry: Entry, transport: Any, flat: torch.Tensor,
                         op: Op) -> None:
    """A small all-reduce of flat contiguous ``flat`` on ``transport`` (shm), run on
    the caller's thread by ``small_sync.py``: what :func:`_run` does for it, without
    the choosing (``direct/inline`` is what ``select.choose`` picks for it)."""
    info = CollectiveInfo(entry.seq, Kind.ALL_REDUCE, entry.nbytes, flat.dtype,
                          "direct/inline over shm", ctx.name, tuple(entry.shape), entry.label)
    entry.start(info.algo)
    try:
        transport.start(info)
        direct.all_reduce_inline(transport, info, flat, op)
        transport.finish()
    except BaseException as exc:
        err = _failed(ctx, entry, "shm", transport, exc)
        if err is exc:
            raise
        raise err from None
    entry.finish()
    ctx.last_seq = entry.seq


def _failed(ctx: GroupContext, entry: Entry | None, label: str, transport: Any,
            exc: BaseException) -> BaseException:
    """Record the failure ``exc`` of a collective on ``transport`` (``label`` as
    ``select.pick_transport`` names it) and return the error the caller gets."""
    failures = ctx.failures
    if isinstance(exc, desync.DesyncError):
        return failures.desync(entry, exc)
    if isinstance(exc, CollectiveError):
        if label == select.HOSTS:
            # An inter-host (or intra-host) failure of this rank fails its host's shared
            # memory too: host peers stop and name it (see [Note: hierarchical closing
            # agreement] in algos/hierarchical.py).
            transport.mark_failed(exc)
        # shm's own errors already say who is missing; elsewhere the board knows more.
        err = exc if label == "shm" else failures.with_board(exc)
        failures.record(entry, err)
        return err
    # Not the transport's own error (a torch shape error, an OSError or ValueError
    # from mapping memory, KeyboardInterrupt...): fail for the whole group, so that
    # peers stop waiting at once and can name it.
    mark = getattr(transport, "mark_failed", None)
    if mark is not None:
        mark(exc)
    failures.record(entry, exc)
    return exc


def _flat(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A flat contiguous view of ``t``, or a contiguous copy (then copy back after)."""
    if t.is_contiguous():
        return t.view(-1), False
    return t.contiguous().view(-1), True
