"""The functional API, mirroring ``torch.distributed``'s signatures and semantics.

CUDA tensors, reductions and dtypes gradring does not do itself (``PRODUCT``,
complex) and ``GRADRING_ALGO=native`` go to the process group's native
collective, with torch's own return values. ``src`` of :func:`broadcast` is a
*global* rank, like torch's (``group_src``: a group rank). A rank outside
``group`` gets ``None`` back and nothing happens, as in torch.

[Note: arguments are checked before the collective is issued]
Each function takes what ``torch.distributed``'s takes on gloo and refuses what
it refuses, with the same exception type: a non-tensor is torch's
``TypeError``, before anything else; a tensor that requires grad (an
``nn.Parameter``) is written through ``tensor.data``, as gloo writes it
without autograd knowing; a sparse (non-strided) tensor goes to the process
group. All of it is decided from the arguments alone, before the collective
is numbered, so a refused call is refused on every rank that makes it and no
byte moves; a process-group call that raises at once fails that call only,
not the group. The 8-byte path (``runner.small_all_reduce``) pays one check
(``requires_grad``) and leaves the others to the general path.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from gradring.comm import desync, engine, ops, runner, select
from gradring.comm.collective import Collective
from gradring.comm.context import GroupContext, context, existing_context
from gradring.comm.engine import Job, Work
from gradring.comm.external import ExternalParts, finish_out, own_range, stage_in
from gradring.comm.recorder import RECORDER
from gradring.comm.registry import GROUPS
from gradring.comm.transport import Kind

ReduceOp = dist.ReduceOp
#: torch's record of its default group; the small path reads ``_default_pg`` from it
#: (None before init_process_group) instead of calling ``_get_default_group``, three
#: Python calls. Where a torch lacks it, the small path is just not taken for group=None.
_WORLD = getattr(dist.distributed_c10d, "_world", None)


_STRIDED = torch.strided


def _is_native(*tensors: torch.Tensor) -> bool:
    return any(t.device.type != "cpu" or t.layout is not _STRIDED for t in tensors) \
        or select.overrides().algo == "native"


def _checked(tensor: Any, name: str, call: str) -> torch.Tensor:
    """``tensor`` if it is one, else torch's TypeError (see [Note: arguments are checked
    before the collective is issued])."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"gradring.comm.{call}: Invalid function argument. Expected parameter "
                        f"`{name}` of type torch.Tensor but got {type(tensor)} instead.")
    return tensor


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor gradring reads and writes for ``tensor``: its ``.data`` when it
    requires grad (written outside autograd, as gloo does), else itself."""
    return tensor.data if tensor.requires_grad else tensor


def _reduction(op: Any, dtype: torch.dtype) -> ops.Op | None:
    """gradring's Op for ``op`` on ``dtype``, or None when the process group must do it."""
    try:
        mine = ops.as_op(op)
    except ValueError:
        return None
    return mine if dtype in ops.REDUCE_DTYPES else None


#: ``on_done(future)``: run when the collective completes, added to its future before
#: the engine can run it (added afterwards, the caller had to win the GIL back from
#: the engine thread that had just started: 0.4 ms per DDP bucket).
OnDone = Callable[[torch.futures.Future], None]


def _issued(ctx: GroupContext, kind: Kind, inp: torch.Tensor, label: str | None,
            **run: Any) -> Collective:
    """Number the collective and describe it (the flight recorder keeps it); ``run``:
    what it runs on (see :class:`~gradring.comm.collective.Collective`)."""
    return RECORDER.issue(ctx.name, ctx.next_seq(), kind, inp.numel() * inp.element_size(),
                          inp.dtype, inp.shape, label=label, **run)


def _refused(ctx: GroupContext, entry: Collective, async_op: bool) -> Work | None:
    """After the watchdog failed a collective the engine is still stuck in, fail at once."""
    err = ctx.failures.refused(entry)
    if async_op:
        return engine.failed(err)
    raise err


def _issue(ctx: GroupContext, kind: Kind, output: torch.Tensor, inp: torch.Tensor,
           op: ops.Op, root: int, async_op: bool, value: list[torch.Tensor],
           parts: ExternalParts | None = None, label: str | None = None,
           on_done: OnDone | None = None) -> Work | None:
    env = select.overrides()
    c = _issued(ctx, kind, inp, label, output=output, input=inp, op=op, root=root,
                parts=parts, env=env)
    if ctx.failures.broken is not None:
        return _refused(ctx, c, async_op)
    fut: torch.futures.Future = torch.futures.Future()
    if on_done is not None:
        fut.add_done_callback(on_done)
    if ctx.connect_shm(env):  # shm: waits enforce deadlines and fail fast themselves
        ctx.small = ctx.transports.existing_shm()
        if not async_op:
            ctx.engine.run_now(runner.run, ctx, c)
            return None
        ctx.engine.submit(Job(functools.partial(runner.run, ctx, c), fut, value))
        return Work(fut, ctx.engine)
    # Elsewhere a blocked gloo wait cannot be interrupted: the caller waits on a
    # watched future instead, synchronous calls included (see watchdog.py).
    ctx.engine.submit(Job(functools.partial(runner.run, ctx, c), fut, value))
    work = Work(ctx.watch(c, fut, value), ctx.engine)
    if async_op:
        return work
    work.wait()
    return None


def _native(group: Any, kind: Kind, inp: torch.Tensor, tensors: Sequence[torch.Tensor],
            value: list[torch.Tensor], async_op: bool, call: Callable[[bool], Any],
            label: str | None = None, on_done: OnDone | None = None) -> Any:
    """A process-group collective (gloo) under gradring's deadline, board, flight
    recorder and ``GRADRING_CHECK``; CUDA tensors go straight to torch (NCCL has its
    own watchdog). ``call(async_op)`` issues it."""
    if any(t.device.type != "cpu" for t in tensors):
        return call(async_op)
    ctx = context(group)
    if ctx is None or ctx.world_size == 1:
        return call(async_op)
    entry = _issued(ctx, kind, inp, label)
    if ctx.failures.broken is not None:
        return _refused(ctx, entry, async_op)
    entry.start("native")
    if desync.enabled():
        try:
            desync.check_native(entry, ctx.group, ctx.rank, ctx.world_size)
        except desync.DesyncError as exc:
            raise ctx.failures.desync(entry, exc) from None
    try:
        work = call(True)
    except Exception as exc:
        # Refused before it started (torch's own checks of the arguments): this call
        # fails, not the group, as in torch (see [Note: arguments are checked before
        # the collective is issued]).
        entry.fail(f"{type(exc).__name__}: {exc}")
        raise
    try:
        native = work.get_future()
    except RuntimeError:  # a backend without futures: torch's own work, unwatched
        return work if async_op else work.wait() and None
    mine = Work(ctx.watch(entry, native, value))
    if on_done is not None:
        mine.get_future().add_done_callback(on_done)
    if async_op:
        return mine
    mine.wait()
    return None


def _done(async_op: bool, value: list[torch.Tensor],
          on_done: OnDone | None = None) -> Work | None:
    """Nothing to run (world size 1, no elements): done already."""
    if not async_op:
        return None
    work = engine.completed(value)
    if on_done is not None:
        work.get_future().add_done_callback(on_done)
    return work


def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None,
               async_op: bool = False, *, label: str | None = None,
               on_done: OnDone | None = None) -> Work | None:
    """Reduce ``tensor`` across ``group`` in place (SUM, AVG, MAX, MIN), as torch's.

    AVG on integers truncates towards zero; CUDA tensors use the process
    group's. ``label`` names the collective in errors, desync checks and the
    flight recorder (else the enclosing ``comm.label``'s); ``on_done(future)``
    runs when it completes.
    """
    if not async_op:  # [Note: the small synchronous path] in runner.py
        ctx = GROUPS.get(group if group is not None else getattr(_WORLD, "_default_pg", None))
        if ctx is not None and ctx.small is not None \
                and runner.small_all_reduce(ctx, tensor, op, label):  # type: ignore[arg-type]
            if on_done is not None:
                engine.completed([tensor]).get_future().add_done_callback(on_done)
            return None
    _checked(tensor, "tensor", "all_reduce")
    mine = _reduction(op, tensor.dtype)
    if mine is None or _is_native(tensor):
        return _native(group, Kind.ALL_REDUCE, tensor, [tensor], [tensor], async_op,
                       lambda a: dist.all_reduce(tensor, op=op, group=group, async_op=a),
                       label, on_done)
    ctx = context(group)
    if ctx is None:
        return None
    if ctx.world_size == 1 or tensor.numel() == 0:
        return _done(async_op, [tensor], on_done)
    data = _plain(tensor)
    return _issue(ctx, Kind.ALL_REDUCE, data, data, mine, 0, async_op, [tensor],
                  label=label, on_done=on_done)


def all_reduce_external(flat: torch.Tensor, parts: ExternalParts, group: Any = None,
                        async_op: bool = True, *, label: str | None = None,
                        on_done: OnDone | None = None) -> Work | None:
    """``parts.scale`` times the SUM of ``flat``, some of whose ranges live in other
    tensors that hold their input and receive their result ([Note: external parts]
    in ``external.py``); the caller has put into ``flat`` everything outside
    ``own_range(flat.numel(), rank, world_size)``. The future resolves to ``[flat]``
    (``async_op=False``: None, run on the caller's thread); ``label`` and
    ``on_done`` as for :func:`all_reduce`.
    """
    ctx = context(group)
    if ctx is None:
        return None
    if _reduction(ReduceOp.SUM, flat.dtype) is None or _is_native(flat) \
            or ctx.world_size == 1 or flat.numel() == 0:
        # No algorithm of ours runs: stage everything, let all_reduce pick the path.
        own = own_range(flat.numel(), ctx.rank, ctx.world_size)
        stage_in(flat, parts, *own)
        work = all_reduce(flat, group=group, async_op=True, label=label)
        assert work is not None
        fut = work.get_future()

        def copy_out(f: torch.futures.Future) -> list[torch.Tensor]:
            f.wait()
            finish_out(flat, parts)
            return [flat]
        done = fut.then(copy_out)
        if on_done is not None:  # for the result with its parts out, not the plain sum
            done.add_done_callback(on_done)
        if not async_op:
            done.wait()
            return None
        return Work(done)
    return _issue(ctx, Kind.ALL_REDUCE, flat, flat, ops.SUM, 0, async_op, [flat], parts,
                  label=label, on_done=on_done)


def broadcast(tensor: torch.Tensor, src: int | None = None, group: Any = None,
              async_op: bool = False, group_src: int | None = None) -> Work | None:
    """Copy global rank ``src``'s ``tensor`` (or group rank ``group_src``'s) to every rank.

    CUDA tensors use the process group's native broadcast.
    """
    _checked(tensor, "tensor", "broadcast")
    if _is_native(tensor):
        return _native(group, Kind.BROADCAST, tensor, [tensor], [tensor], async_op,
                       lambda a: dist.broadcast(tensor, src=src, group=group, async_op=a,
                                                group_src=group_src))
    ctx = context(group)
    if ctx is None:
        return None
    root = _group_rank(ctx, src, group_src)
    if ctx.world_size == 1 or tensor.numel() == 0:
        return _done(async_op, [tensor])
    data = _plain(tensor)
    return _issue(ctx, Kind.BROADCAST, data, data, ops.SUM, root, async_op, [tensor])


def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                           group: Any = None, async_op: bool = False) -> Work | None:
    """Concatenate every rank's ``input_tensor`` into ``output_tensor`` in rank order.

    ``output_tensor`` holds ``world_size`` times as many elements (any shape).
    CUDA tensors use the process group's native all_gather_into_tensor.
    """
    _checked(input_tensor, "input_tensor", "all_gather_into_tensor")
    _checked(output_tensor, "output_tensor", "all_gather_into_tensor")
    if _is_native(output_tensor, input_tensor):
        return _native(group, Kind.ALL_GATHER, input_tensor, [output_tensor, input_tensor],
                       [output_tensor], async_op,
                       lambda a: dist.all_gather_into_tensor(output_tensor, input_tensor,
                                                             group=group, async_op=a))
    return _issue_sized(group, Kind.ALL_GATHER, "all_gather_into_tensor", output_tensor,
                        input_tensor, ops.SUM, async_op, big=output_tensor, small=input_tensor)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor,
                          op: Any = ReduceOp.SUM, group: Any = None,
                          async_op: bool = False) -> Work | None:
    """Reduce every rank's ``input`` and give rank ``r`` the ``r``-th chunk in ``output``.

    ``input`` holds ``world_size`` times as many elements as ``output``. CUDA
    tensors use the process group's native reduce_scatter_tensor.
    """
    _checked(output, "output", "reduce_scatter_tensor")
    _checked(input, "input", "reduce_scatter_tensor")
    mine = _reduction(op, input.dtype)
    if mine is None or _is_native(output, input):
        return _native(group, Kind.REDUCE_SCATTER, input, [output, input], [output], async_op,
                       lambda a: dist.reduce_scatter_tensor(output, input, op=op, group=group,
                                                            async_op=a))
    return _issue_sized(group, Kind.REDUCE_SCATTER, "reduce_scatter_tensor", output, input,
                        mine, async_op, big=input, small=output)


def _issue_sized(group: Any, kind: Kind, name: str, output: torch.Tensor, inp: torch.Tensor,
                 op: ops.Op, async_op: bool, *, big: torch.Tensor,
                 small: torch.Tensor) -> Work | None:
    """All-gather / reduce-scatter: check that ``big`` is W times ``small``; world 1
    copies; an empty ``small`` is a no-op; everything else is issued."""
    ctx = context(group)
    if ctx is None:
        return None
    _check_sizes(name, ctx, big=big, small=small,
                 big_name="output" if big is output else "input",
                 small_name="input" if big is output else "output")
    value = [output]  # the caller's own tensor, also where its .data is written
    output, inp = _plain(output), _plain(inp)
    if ctx.world_size == 1:
        if output.numel():
            output.view(-1).copy_(inp.reshape(-1))
        return _done(async_op, value)
    if small.numel() == 0:
        return _done(async_op, value)
    return _issue(ctx, kind, output, inp, op, 0, async_op, value)


def barrier(group: Any = None, async_op: bool = False,
            device_ids: Sequence[int] | None = None) -> Work | None:
    """Return only once every rank of ``group`` has entered the barrier."""
    if device_ids is not None:
        return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)
    if select.overrides().algo == "native":
        dummy = torch.empty(0, dtype=torch.uint8)
        return _native(group, Kind.BARRIER, dummy, [dummy], [], async_op,
                       lambda a: dist.barrier(group=group, async_op=a))
    ctx = context(group)
    if ctx is None:
        return None
    if ctx.world_size == 1:
        return _done(async_op, [])
    dummy = torch.empty(0, dtype=torch.uint8)
    return _issue(ctx, Kind.BARRIER, dummy, dummy, ops.SUM, 0, async_op, [])


def empty(shape: int | Sequence[int], dtype: torch.dtype = torch.float32, group: Any = None,
          device: Any = None) -> torch.Tensor:
    """An uninitialised tensor in the transport's own memory: collectives on it (or
    on any contiguous view of it) skip the staging copy. On one host a shared-memory
    segment peers read directly, elsewhere (other hosts, CUDA, world size 1) an
    ordinary ``torch.empty``. The first call on a group may connect the transport,
    which is collective: every rank must make it.
    """
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    plain = lambda: torch.empty(shape, dtype=dtype, device=dev)
    if dev.type != "cpu":
        return plain()
    # Made whatever the overrides say, so that a rank whose GRADRING_TRANSPORT differs
    # still agrees on settings here, with the others ([Note: agreed settings]).
    ctx = context(group)
    env = select.overrides()
    if ctx is None or ctx.world_size == 1 or env.algo == "native" or env.transport == "torch" \
            or ctx.failures.broken is not None:
        return plain()
    transport = ctx.transports.shm()
    numel = math.prod(shape)
    if transport is None or numel == 0:
        return plain()
    return transport.empty(numel, dtype).view(shape)


def in_transport_memory(tensor: torch.Tensor, group: Any = None) -> bool:
    """True if collectives on ``tensor`` are zero-copy (it lives in ``comm.empty`` memory)."""
    ctx = existing_context(group)  # none yet: nothing is in its memory (never makes one)
    transport = ctx.transports.existing_shm() if ctx is not None else None
    return (transport is not None and tensor.is_contiguous()
            and transport.locate(tensor) is not None)


def _group_rank(ctx: GroupContext, src: int | None, group_src: int | None) -> int:
    if (src is None) == (group_src is None):
        raise ValueError("broadcast needs exactly one of src (global rank) and group_src")
    if group_src is not None:
        root = group_src
    elif ctx.group is dist.distributed_c10d._get_default_group():
        root = src  # type: ignore[assignment]
    else:
        root = dist.get_group_rank(ctx.group, src)  # type: ignore[arg-type]
    if not 0 <= root < ctx.world_size:
        raise ValueError(f"broadcast source {root} is not a rank of a group of "
                         f"size {ctx.world_size}")
    return root


def _check_sizes(name: str, ctx: GroupContext, *, big: torch.Tensor, small: torch.Tensor,
                 big_name: str, small_name: str) -> None:
    if big.dtype != small.dtype:
        raise TypeError(f"{name}: {big_name} dtype {big.dtype} != {small_name} dtype "
                        f"{small.dtype}")
    if big.numel() != ctx.world_size * small.numel():
        raise ValueError(f"{name}: {big_name} has {big.numel()} elements, expected "
                         f"world_size({ctx.world_size}) * {small_name}({small.numel()}) = "
                         f"{ctx.world_size * small.numel()}")
