"""Packed slots: a bucket's small gradients, copied in and out a run at a time.

[Note: packed slots]
A Python hook per parameter is cheap (about a microsecond); what made many
small tensors expensive was the tensor work each hook did on its own: a
scaled copy into the slot, a view handed out as ``.grad``, reference counts,
each a separate call through the dispatcher for 64 floats. torch's C++
reducer pays that per-tensor dispatch too, but without the interpreter
around it.

So a small slot (at most ``SMALL_SLOT_NUMEL`` elements) is *packed*: its hook
only counts the gradient as ready. When the last gradient of the bucket
arrives, every packed slot is copied in at once, a run of neighbouring slots
per call, and the run is scaled by 1/world_size in one multiply:

- a bucket whose packed slots form one run of 1-D slots (biases, norms
  and nothing else) is written by one ``torch.cat`` into its span;
- any other bucket by one ``torch._foreach_copy_`` over all its packed
  slots, then one ``torch._foreach_mul_`` by the scale. In a
  convolutional net the small slots (BatchNorm weights and biases) sit
  between the large ones, and a call per run measured 0.6 ms per step for
  ResNet-shaped models' 14 runs; one call for the bucket does it in a
  fraction of that.

At the end of the backward the results go back into the ``.grad`` tensors
with one ``torch._foreach_copy_`` for the bucket. ``.grad`` stays the tensor
autograd made, as in torch's DDP without ``gradient_as_bucket_view``.

The bits are the ones the per-slot path gives: a copy followed by an in-place
multiply by the same 0-dim scale tensor computes the same products as the
multiply with ``out=`` it replaces (``_foreach_mul_`` with a tensor scale
runs that same multiply per tensor). Reading ``.grad`` when the bucket is ready
rather than in each hook also sees what later hooks of the same parameter
did to it, which is what torch's reducer sees (its hook runs after them).

Whatever the batched calls cannot take (a missing gradient, a sparse one, a
backward with ``create_graph=True``, parameters no rank used) goes run by
run, and within a run that still fails, slot by slot through the reducer's
ordinary path: the run is marked *unpacked* for this backward and its slots are
written back one by one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

#: Slots of at most this many elements are packed (see [Note: packed slots]):
#: below it a gradient's per-call cost outweighs the bytes it moves.
SMALL_SLOT_NUMEL = 4096

_SCALES: dict[tuple[float, bool], torch.Tensor] = {}
_DOUBLE = (torch.float64, torch.complex128)


def scale_tensor(scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``scale`` as a 0-dim tensor to multiply ``dtype`` gradients by, made once per
    value: float64 for double gradients, float32 for the others (the precision
    the kernels compute a Python float in, so the bits are the same, and a 0-dim
    tensor does not change the result dtype). It skips wrapping the float into
    a new tensor on every call: a 64-float multiply measured 1.4 us against 6.3."""
    double = dtype in _DOUBLE
    t = _SCALES.get((scale, double))
    if t is None:
        t = _SCALES[(scale, double)] = torch.tensor(
            scale, dtype=torch.float64 if double else torch.float32)
    return t


@dataclass(frozen=True)
class Run:
    """Neighbouring packed slots ``[lo, hi)`` of one bucket, copied in one call."""

    lo: int
    hi: int
    start: int  # element offset of the run's span in the flat buffer
    numel: int  # elements in the span
    flat: bool  # every slot is 1-D: one torch.cat fills the span
    params: tuple[torch.Tensor, ...]  # the run's parameters, in slot order
    indices: tuple[int, ...]  # their global (definition-order) indices


def packed_runs(packed: Sequence[bool], offsets: Sequence[int], numels: Sequence[int],
                params: Sequence[torch.Tensor], indices: Sequence[int]) -> tuple[Run, ...]:
    """Split a bucket's packed slots into maximal runs of neighbours; a run
    whose slots are all 1-D is ``flat`` (one ``torch.cat`` fills it).

    >>> ps = [torch.zeros(3), torch.zeros(2, 2), torch.zeros(5), torch.zeros(4)]
    >>> [(r.lo, r.hi, r.flat) for r in packed_runs([True, True, False, True],
    ...                                            [0, 3, 7, 12], [3, 4, 5, 4], ps, [0, 1, 2, 3])]
    [(0, 2, False), (3, 4, True)]
    """
    runs: list[Run] = []
    n, s = len(packed), 0
    while s < n:
        if not packed[s]:
            s += 1
            continue
        e = s + 1
        while e < n and packed[e]:
            e += 1
        flat = all(p.dim() == 1 for p in params[s:e])
        runs.append(Run(s, e, offsets[s], offsets[e - 1] + numels[e - 1] - offsets[s], flat,
                        tuple(params[s:e]), tuple(indices[s:e])))
        s = e
    return tuple(runs)


def copy_in_all(views: list[torch.Tensor], params: Sequence[torch.Tensor],
                scale: float) -> bool:
    """Copy every packed gradient of a bucket (``params``, in slot order) into
    its slot (``views``) and scale them all, in two calls whatever the number
    of runs; False (nothing to rely on written) when some gradient does not
    fit a batched call."""
    grads = [p.grad for p in params]
    try:
        torch._foreach_copy_(views, grads)  # type: ignore[arg-type]
    except (TypeError, RuntimeError):  # None, sparse, ...: the caller goes run by run
        return False
    if scale != 1.0:
        torch._foreach_mul_(views, scale_tensor(scale, views[0].dtype))
    return True


def copy_out_all(params: Sequence[torch.Tensor], views: list[torch.Tensor]) -> bool:
    """Write every packed slot's reduced value (``views``) into its
    parameter's ``.grad`` in one call; False (nothing to rely on written)
    when some ``.grad`` is missing or odd."""
    grads = [p.grad for p in params]
    try:
        torch._foreach_copy_(grads, views)  # type: ignore[arg-type]
    except (TypeError, RuntimeError):
        return False
    return True


def copy_in(buffer: torch.Tensor, views: list[torch.Tensor], run: Run, scale: float) -> bool:
    """Copy the run's gradients into a bucket's flat ``buffer`` (through its
    slot ``views``) and scale them; False (and nothing to rely on written)
    when some gradient does not fit a batched call."""
    grads = [p.grad for p in run.params]
    span = buffer.narrow(0, run.start, run.numel)
    try:
        if run.flat:
            torch.cat(grads, out=span)  # type: ignore[arg-type]
        else:
            torch._foreach_copy_(views[run.lo:run.hi], grads)  # type: ignore[arg-type]
    except (TypeError, RuntimeError):  # None, sparse, ...: the caller goes slot by slot
        return False
    if scale != 1.0:
        span.mul_(scale_tensor(scale, span.dtype))
    return True


def copy_out(views: list[torch.Tensor], run: Run) -> bool:
    """Write the run's reduced values (from a bucket's slot ``views``) into
    its parameters' ``.grad``; False (nothing to rely on written) when some
    ``.grad`` is missing or odd."""
    grads = [p.grad for p in run.params]
    try:
        torch._foreach_copy_(grads, views[run.lo:run.hi])  # type: ignore[arg-type]
    except (TypeError, RuntimeError):
        return False
    return True
