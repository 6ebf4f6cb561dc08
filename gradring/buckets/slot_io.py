"""The core's way for gradients into bucket slots and their results back into ``.grad``.

One put per core slot kind (see [Note: slot kinds] in ``bucket.py``), VIEW
and COPIED, and the write-back at the end of the backward, which then hands
each fast path's slots to the path (``homed.py``, ``packed.py``). Plain
functions of a bucket and a slot: the parameter is the bucket's, the scale
the caller's; what a put leaves to be written back it records in the
bucket's ``to_write``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from gradring.buckets.bucket import Bucket, SlotKind
from gradring.buckets.packing import scale_tensor


class SlotContext(NamedTuple):
    """What decides a bucket's slot kinds besides its parameters."""

    view_mode: bool   # gradient_as_bucket_view
    hooked: bool      # a comm hook is set: slots are plain copies
    shared: bool      # another live reducer acts on these parameters
    world_size: int
    own: tuple[int, int]  # the part of the buffer this rank reduces (comm.own_range)
    # Per global parameter index, whether its arrival may be counted without a
    # Python hook; None while counting is off ([Note: counted slots] in packed.py).
    countable: Sequence[bool] | None = None


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
    (per global parameter index) leaves alone the parameters no rank used.
    The core writes the slots its puts left to it (copied in, or no
    gradient); each fast path writes its own."""
    for slot in bucket.to_write:
        write_slot(bucket, slot, used)
    for write_back in bucket.path_writes:
        write_back(bucket, used)


def write_slot(bucket: Bucket, slot: int, used: list[int] | None) -> None:
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


#: Per core slot kind, what its hook puts in with (see [Note: slot kinds]).
CORE_PUTS: dict[SlotKind, Callable[[Bucket, int, float], None]] = {
    SlotKind.VIEW: put_view, SlotKind.COPIED: put_copied,
}
