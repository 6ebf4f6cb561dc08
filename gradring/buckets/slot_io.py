"""How gradients go into bucket slots and their results back into ``.grad``.

One function per slot kind (see [Note: slot kinds] in ``bucket.py``): the
per-hook puts of VIEW, HOMED and COPIED slots, the deferred put of a ready
bucket's PACKED slots (see [Note: packed slots] in ``packing.py``),
and the write-back at the end of the backward. Plain functions of a bucket
and a slot: the parameter is the bucket's, the scale the caller's; what a
put leaves to be done later it records through the bucket's own methods.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gradring.buckets.bucket import Bucket, SlotKind
from gradring.buckets.packing import copy_in, copy_in_all, copy_out, copy_out_all, scale_tensor


def put_deferred(bucket: Bucket, scale: float) -> None:
    """The bucket's last gradient arrived: put in its PACKED slots (see
    [Note: packed slots] in ``packing.py``)."""
    grad_mode = torch.is_grad_enabled()  # on only under backward(create_graph=True)
    if grad_mode:
        torch._C._set_grad_enabled(False)
    try:
        if not grad_mode and not bucket.packed_flat and \
                copy_in_all(bucket.packed_views, bucket.packed_params, scale):
            return
        buffer, views = bucket.buffer, bucket.views
        for r, run in enumerate(bucket.runs):
            # create_graph: slot by slot, so that .grad is written with autograd on.
            if grad_mode or not copy_in(buffer, views, run, scale):
                bucket.unpack(r)
                for s in range(run.lo, run.hi):
                    put_copied(bucket, s, scale)
    finally:
        if grad_mode:
            torch._C._set_grad_enabled(True)


def put_nothing(bucket: Bucket, s: int) -> None:
    """Slot ``s``'s parameter has no gradient in this backward: its slot adds
    zeros, and the finalize writes the result back."""
    bucket.views[s].zero_()
    bucket.write_back(s)


def put_view(bucket: Bucket, s: int, scale: float) -> None:
    """gradient_as_bucket_view: a .grad that is not its slot yet (a new one,
    after ``zero_grad(set_to_none=True)``) is multiplied into the slot and
    pointed at it, and the new tensor is let go; a slot autograd summed
    into in place is scaled where it is. Each element is multiplied by the
    same 0-dim scale once either way, so the bits are those of a copy and
    then a multiply, without the copy's second pass over the new gradient."""
    p = bucket.params[s]
    grad, view = p.grad, bucket.views[s]
    st = scale_tensor(scale, view.dtype) if scale != 1.0 else None
    if grad is None or grad.layout is not torch.strided:
        del grad
        put_copied(bucket, s, scale)
    elif grad.data_ptr() == view.data_ptr():
        if st is not None:
            view.mul_(st)
    else:
        if st is not None and grad.dtype == view.dtype:
            torch.mul(grad, st, out=view)
        else:
            view.copy_(grad)
            if st is not None:
                view.mul_(st)
        p.grad = view


# How a gradient goes into its slot, one function per kind (called by the
# hook); each falls back to COPIED when the gradient does not fit its own kind.
def put_homed(bucket: Bucket, s: int, scale: float) -> None:
    """Copy in (scaled) only what the peers read, the part outside this rank's
    own chunk; the collective reads the rest from ``.grad`` and writes the
    whole result back into it."""
    grad = bucket.params[s].grad
    view = bucket.views[s]
    # A gradient that requires grad (backward(create_graph=True)) is
    # copied: the collective's thread would record autograd history on it.
    # No gradient, or a sparse one, is copied too. Homing moves the gradient
    # as flat memory: only where the gradient and its slot are both row-major
    # ([Note: the gradient layout contract] in bucket.py).
    if not (grad is not None and grad.layout is torch.strided and grad.is_contiguous()
            and view.is_contiguous()
            and not grad.requires_grad
            and grad.dtype == view.dtype and grad.device == view.device
            and grad.numel() == view.numel()):
        put_copied(bucket, s, scale)
        return
    flat = grad.view(-1)
    start, n = bucket.offsets[s], bucket.numels[s]
    lo, hi = bucket.own
    for a, b in ((start, min(start + n, lo)), (max(start, hi), start + n)):
        if a < b:
            torch.mul(flat[a - start:b - start], scale_tensor(scale, flat.dtype),
                      out=bucket.buffer[a:b])
    bucket.home(start, flat, s)


# [Note: sparse gradients]
# nn.Embedding(sparse=True) and nn.EmbeddingBag(sparse=True) give sparse
# COO gradients. Torch's DDP reduces each as a sparse tensor in a bucket of
# its own. Here every parameter already has a dense slot, so a sparse
# gradient is coalesced, made dense into its slot (scaled like any other)
# and summed with its bucket: torch's order of operations (its gloo sparse
# all-reduce coalesces each rank's gradient, repeated rows summed in
# coalesce's order, then adds the ranks'), so at world 2 the values are
# torch's bit for bit even where ids repeat many times in a batch
# (tests/ranks/test_sparse_repeated_ids.py); at the end of the backward .grad becomes a coalesced
# sparse tensor again, with the gradient's sparse dimensions and the rows
# whose sum is not zero. Every rank takes part in the same bucket
# collective whatever layout its gradient has, so nothing can pair up
# wrongly or wait forever. The price is a dense pass over the whole
# table every step, and a row that ranks touched but whose sum is exactly
# zero is left out of the indices (torch's keeps it, with zeros). A comm
# hook sees the dense values in the bucket.
def put_copied(bucket: Bucket, s: int, scale: float) -> None:
    grad = bucket.params[s].grad
    view = bucket.views[s]
    if grad is None:
        put_nothing(bucket, s)
    elif grad.layout is not torch.strided:
        # A sparse gradient (nn.Embedding(sparse=True)) is summed densely
        # in its slot, coalesced first; see [Note: sparse gradients].
        view.copy_(grad.coalesce().to_dense())
        if scale != 1.0:
            view.mul_(scale_tensor(scale, view.dtype))
    elif scale != 1.0:
        torch.mul(grad, scale_tensor(scale, grad.dtype), out=view)
    else:
        view.copy_(grad)
    bucket.write_back(s)  # the result goes back into .grad at finalize


def write_grads(bucket: Bucket, used: list[int] | None) -> None:
    """Write the bucket's reduced values where ``.grad`` needs them; ``used``
    (per global parameter index) leaves alone the parameters no rank used."""
    # Only the slots whose put left the result to be written back (copied in,
    # or no gradient), and the packed runs: homed and view slots already
    # hold it in .grad.
    homed = bucket.homed_slots
    for slot in bucket.to_write:
        if slot not in homed:  # else the collective wrote the result into .grad
            _write_slot(bucket, slot, used)
    runs, unpacked, views = bucket.runs, bucket.unpacked, bucket.views
    if runs and not unpacked and (used is None or all(
            used[i] for run in runs for i in run.indices)) and \
            copy_out_all(bucket.packed_params, bucket.packed_views):
        return
    for r, run in enumerate(runs):
        if r in unpacked:
            continue  # its slots went one by one, into to_write
        if (used is None or all(used[i] for i in run.indices)) and copy_out(views, run):
            continue
        for slot in range(run.lo, run.hi):
            _write_slot(bucket, slot, used)


def _write_slot(bucket: Bucket, slot: int, used: list[int] | None) -> None:
    if used is not None and used[bucket.param_indices[slot]] == 0:
        return  # unused on every rank: leave .grad untouched
    p = bucket.params[slot]
    view = bucket.views[slot]
    grad = p.grad
    if grad is not None and grad.layout is not torch.strided:
        p.grad = view.to_sparse(grad.sparse_dim())  # see [Note: sparse gradients]
        return
    if grad is not None and grad.data_ptr() == view.data_ptr():
        return  # .grad is the slot itself (view mode)
    kind = bucket.kinds[slot]
    if kind is SlotKind.VIEW:
        p.grad = view
    elif grad is None:
        p.grad = view.clone()
    elif grad.requires_grad:
        # backward(create_graph=True): torch's DDP writes the result
        # with autograd recording, so .grad keeps requiring grad (its
        # history is the copy; the all-reduce is not differentiated).
        with torch.enable_grad():
            grad.copy_(view)
    else:
        grad.copy_(view)


#: Per slot kind, what its hook puts in with (see [Note: slot kinds]); None
#: for the kind that is always deferred (see [Note: packed slots]).
PUT_AT_HOOK: dict[SlotKind, Callable[[Bucket, int, float], None] | None] = {
    SlotKind.VIEW: put_view, SlotKind.PACKED: None,
    SlotKind.HOMED: put_homed, SlotKind.COPIED: put_copied,
}
