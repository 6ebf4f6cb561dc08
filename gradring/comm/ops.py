"""Element-wise building blocks shared by every algorithm: reduce, copy, chunk bounds.

Algorithms work on flat, contiguous 1-D tensors and use torch kernels, which
cover bf16 (numpy lacks it) and release the GIL.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

ReduceOp = dist.ReduceOp

#: The reductions gradring implements itself (others go to the process group).
SUPPORTED_OPS = {"SUM", "AVG", "MAX", "MIN"}

#: dtypes the reductions are tested with; copies (broadcast, all-gather) take any.
REDUCE_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16,
                 torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8)


class Op(NamedTuple):
    """A reduction as the algorithms see it: its name and how to finish it."""

    name: str  # "SUM" | "AVG" | "MAX" | "MIN"

    @property
    def divides(self) -> bool:
        return self.name == "AVG"


SUM = Op("SUM")


def as_op(op: object) -> Op:
    """Translate a ``torch.distributed.ReduceOp`` (or its name) into an :class:`Op`."""
    try:
        return BY_VALUE[op]  # RedOpType members hash; the common case
    except (KeyError, TypeError):
        pass
    if isinstance(op, Op):
        return op
    if isinstance(op, str) and op.upper() in SUPPORTED_OPS:
        return Op(op.upper())
    for name in SUPPORTED_OPS:
        if not isinstance(op, str) and op == getattr(ReduceOp, name):
            return Op(name)
    raise ValueError(f"gradring supports ReduceOp {sorted(SUPPORTED_OPS)}, not {op}")


#: ``ReduceOp`` member -> :class:`Op`, for the reductions gradring does itself.
BY_VALUE: dict[object, Op] = {getattr(ReduceOp, n): Op(n) for n in SUPPORTED_OPS}


def combine(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, op: Op) -> None:
    """``out = a (op) b`` element-wise; ``out`` may be exactly ``a`` or ``b``.

    AVG combines as SUM; the division happens once, in :func:`finish`.
    """
    if op.name in ("SUM", "AVG"):
        torch.add(a, b, out=out)
    elif op.name == "MAX":
        torch.maximum(a, b, out=out)
    else:
        torch.minimum(a, b, out=out)


def reduce_into(out: torch.Tensor, srcs: list[torch.Tensor], op: Op) -> None:
    """``out = srcs[0] (op) srcs[1] (op) ...`` in list order, so every rank that
    computes it gets the same bits. ``out`` may alias ``srcs[0]`` or ``srcs[1]``
    but no later source (that one would be overwritten before it is read)."""
    if len(srcs) == 1:
        if srcs[0].data_ptr() != out.data_ptr():
            copy(out, srcs[0])
        return
    combine(out, srcs[0], srcs[1], op)
    for src in srcs[2:]:
        combine(out, out, src, op)


def finish(t: torch.Tensor, op: Op, world_size: int) -> None:
    """Apply the post-reduction step of ``op`` (AVG divides; integers truncate)."""
    if op.divides and t.numel():
        if t.dtype.is_floating_point:
            t.div_(world_size)
        else:
            t.div_(world_size, rounding_mode="trunc")


def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[:] = src`` for flat contiguous tensors.

    ``Tensor.copy_``: re-measured here (torch 2.13, one thread, private and
    shared mappings, 1-256 MiB) it matched or beat ``numpy.copyto``.
    """
    if dst.numel():
        dst.copy_(src)


def chunk_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """Split ``range(n)`` into ``parts`` contiguous chunks whose sizes differ by at most one.

    Chunk ``i`` is ``[i*n//parts, (i+1)*n//parts)``; empty chunks are allowed
    (``n < parts``), so algorithms never special-case small counts.
    """
    return [(i * n // parts, (i + 1) * n // parts) for i in range(parts)]


def pieces(lo: int, hi: int, max_elems: int) -> list[tuple[int, int]]:
    """Cut ``[lo, hi)`` into pipeline pieces of at most ``max_elems`` elements."""
    if hi <= lo:
        return []
    step = max(1, max_elems)
    return [(s, min(s + step, hi)) for s in range(lo, hi, step)]
