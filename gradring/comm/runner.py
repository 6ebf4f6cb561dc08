"""Running one issued collective: pick the transport and algorithm, run it, report.

The engine thread (or the caller, for a synchronous call on shm) runs each
:class:`~gradring.comm.collective.Collective` through :func:`run`, in issue
order; a small synchronous all-reduce through :func:`small_all_reduce`.
Algorithms come from the registry (``algos/__init__.py``), the choice from
``select.py``, and failures go through the group's :class:`~gradring.comm.failures.Failures`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from gradring.comm import algos, desync, ops, select
from gradring.comm.algos import direct
from gradring.comm.collective import Collective
from gradring.comm.ops import Op
from gradring.comm.recorder import RECORDER
from gradring.comm.store import exchange_lists, group_store, instance_prefix
from gradring.comm.transport import CollectiveError, Kind
from gradring.comm.transports.shm import space
from gradring.comm.transports.shm.space import ShmExhausted

if TYPE_CHECKING:
    from gradring.comm.context import GroupContext

_DTYPES = frozenset(ops.REDUCE_DTYPES)


def run(ctx: GroupContext, c: Collective) -> None:
    """Run ``c`` on the calling thread (engine or inline) for group ``ctx``."""
    try:
        _run(ctx, c)
    except ShmExhausted as exc:
        # Every rank raised it in this collective (shm/space.py): all fall back together.
        shm = ctx.transports.existing_shm()
        if exc.limited:  # a process limit, not /dev/shm: no store round, no size advice
            advice = space.limit_notice(exc.limited)
        else:
            in_use = _largest_holding(ctx, shm.memory.reserved if shm else 0)
            advice = space.advice(exc.needed, in_use, ctx.world_size)
        ctx.transports.drop_shm(str(exc))
        if c.env.transport == "shm":
            err = CollectiveError(f"{exc}; GRADRING_TRANSPORT=shm forbids falling back to "
                                  f"the process group. {advice}")
            ctx.failures.record(c, err)
            raise err from None
        space.warn_once(advice + "; gradring now runs this group's collectives over the "
                        "process group instead (slower)")
        _run(ctx, c)


def _largest_holding(ctx: GroupContext, mine: int) -> int:
    """The most /dev/shm bytes any rank of the group holds, so that every rank advises
    the same figure (see [Note: one figure, two causes] in ``shm/space.py``). Every rank
    raised ``ShmExhausted`` in the same collective, so every rank asks: one store round
    (``mine`` alone if a peer does not answer within 2 s)."""
    try:
        tag = instance_prefix(group_store(ctx.group), "shm-room", ctx.world_size)
    except Exception:  # noqa: BLE001 - no store: this rank's own figure
        return mine
    try:
        theirs = exchange_lists(ctx, tag, [mine])
    except Exception:  # noqa: BLE001 - e.g. no descriptor left for a FileStore: advice only
        return mine
    return max([mine] + [v[0] for v in theirs.values() if v and type(v[0]) is int])


def _run(ctx: GroupContext, c: Collective) -> None:
    output, inp_t = c.output, c.input
    assert output is not None and inp_t is not None, "a collective runs once"
    out, copy_back = _flat(output)
    inp = out if inp_t is output else _flat(inp_t)[0]
    label, transport = "?", None
    try:
        label, transport = select.pick_transport(ctx.transports, c.env.transport, ctx.name)
        choice = select.choose(c.kind, c.nbytes, ctx.world_size, label, c.env.algo)
        c.start(f"{choice.algo} over {choice.transport}")
        transport.start(c)
        algos.run(choice.algo, transport, algos.Call(c, out, inp, c.op, c.root, c.parts))
        finish = getattr(transport, "finish", None)
        if finish is not None:
            finish()  # shm's closing agreement: see [Note: sticky failures]
    except ShmExhausted:
        raise  # not a failure: run() falls back
    except BaseException as exc:
        err = _failed(ctx, c, label, transport, exc)
        if err is exc:
            raise
        raise err from (None if isinstance(exc, desync.DesyncError) else exc)
    if copy_back:
        output.copy_(out.view(output.shape))
    c.finish()
    ctx.last_seq = c.seq


def small_all_reduce(ctx: GroupContext, tensor: torch.Tensor, op: Any,
                     label: str | None) -> bool:
    """Run a synchronous ``all_reduce(tensor, op)`` on the caller's thread and return
    True, or return False having done nothing (the caller takes the general path).

    [Note: the small synchronous path]
    The most common collective is a synchronous all-reduce of a few bytes (a loss,
    a metric): its cost is the path around it, the plan of ``api._issue`` and the
    lookups and dispatch of :func:`run`. A call that needs none of that (CPU,
    contiguous, at most ``select.INLINE_MAX_BYTES``, a reduction gradring does, no
    ``requires_grad`` (see [Note: arguments are checked before the collective is
    issued] in ``api.py``), no override, shm connected (``ctx.small``), the group
    not failed, the engine idle) runs ``direct/inline``, what ``select.choose``
    picks for it anyway, through the engine's one synchronous entry
    (:meth:`Engine.run_now`): issue order, sequence number, recorder entry, desync
    fingerprint, deadlines and failure handling (:func:`_failed`) are the general
    path's, and so are the bits (``tests/jobs/test_small_sync.py`` runs both ways).
    """
    transport = ctx.small
    try:  # no cost unless it raises (3.11's exceptions): the 8-byte floor
        if tensor.requires_grad or not tensor.is_cpu or tensor.dtype not in _DTYPES:
            return False  # a Parameter, autograd's: written through .data (api.py)
        # (a sparse tensor is not contiguous: the general path hands it to gloo)
        nbytes = tensor.numel() * tensor.element_size()
        if not 0 < nbytes <= select.INLINE_MAX_BYTES or not tensor.is_contiguous():
            return False
        mine = ops.BY_VALUE.get(op)
    except (AttributeError, RuntimeError, TypeError):
        return False  # not a tensor, a layout without strides, an unhashable op: api.py
    env = select.overrides()
    engine = ctx.engine
    if mine is None or env.transport is not None or env.algo is not None \
            or ctx.failures.broken is not None or not transport.usable() or engine.busy():
        return False  # behind asynchronous work: it queues on the general path
    entry = RECORDER.issue(ctx.name, ctx.next_seq(), Kind.ALL_REDUCE, nbytes,
                           tensor.dtype, tensor.shape, label=label)
    engine.run_now(run_small_all_reduce, ctx, entry, transport, tensor, mine)
    return True


def run_small_all_reduce(ctx: GroupContext, c: Collective, transport: Any,
                         tensor: torch.Tensor, op: Op) -> None:
    """What :func:`_run` does for a small all-reduce of contiguous ``tensor`` (any
    shape: a flat view would cost more than its sum) on shm, without the choosing."""
    c.start("direct/inline over shm")
    try:
        transport.start(c)
        direct.all_reduce_inline(transport, c, tensor, op)
        transport.finish()
    except BaseException as exc:
        err = _failed(ctx, c, "shm", transport, exc)
        if err is exc:
            raise
        raise err from None
    c.finish()
    ctx.last_seq = c.seq


def _failed(ctx: GroupContext, entry: Collective | None, label: str, transport: Any,
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
