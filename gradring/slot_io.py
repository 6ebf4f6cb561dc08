"""How gradients go into bucket slots and their results back into ``.grad``.

One method per slot kind (see [Note: slot kinds] in ``buckets.py``): the
per-hook puts of HOMED, LENT and COPIED slots, the deferred put of a ready
bucket's VIEW and PACKED slots (see [Note: packed slots] in ``packing.py``),
and the write-back at the end of the backward. A mixin of the Reducer: it
reads the reducer's parameters, scale and recycled gradients, and owns no
state of its own.
"""

from __future__ import annotations

from typing import Any

import torch

from gradring.buckets import Bucket, SlotKind
from gradring.lending import fresh
from gradring.packing import copy_in, copy_in_all, copy_out, copy_out_all, scale_tensor


class SlotIO:
    """The Reducer's gradient puts and write-backs (a mixin)."""

    params: list[torch.nn.Parameter]
    comm_hook: Any
    divide_factor: int
    grad_as_view: bool
    _recycled: dict[int, torch.Tensor]

    def _put_deferred(self, bucket: Bucket, last: int) -> None:
        """The bucket's last gradient (parameter ``last``'s) arrived: put in its
        VIEW slots, or its held and PACKED slots (see [Note: held slots])."""
        scale = 1.0 if self.comm_hook is not None else 1.0 / self.divide_factor
        grad_mode = torch.is_grad_enabled()  # on only under backward(create_graph=True)
        if grad_mode:
            torch._C._set_grad_enabled(False)
        try:
            if self.grad_as_view:
                self._put_views(bucket, scale)
                return
            if bucket.held:
                self._put_held(bucket, scale, last)
            if not bucket.runs:
                return
            if not grad_mode and not bucket.packed_flat and copy_in_all(bucket, scale):
                return
            for r, run in enumerate(bucket.runs):
                # create_graph: slot by slot, so that .grad is written with autograd on.
                if grad_mode or not copy_in(bucket, run, scale):
                    bucket.loose.add(r)
                    for s in range(run.lo, run.hi):
                        self._put_one(bucket, s, run.indices[s - run.lo], scale)
        finally:
            if grad_mode:
                torch._C._set_grad_enabled(True)

    def _put_held(self, bucket: Bucket, scale: float, last: int) -> None:
        kinds, indices, params = bucket.kinds, bucket.param_indices, self.params
        for s in bucket.held:
            i = indices[s]
            if params[i].grad is None:
                bucket.views[s].zero_()
                bucket.to_write.append(s)
            elif kinds[s] is SlotKind.LENT:
                self._put_lent(bucket, s, i, scale, i != last)
            else:
                self._put_homed(bucket, s, i, scale)

    def _put_one(self, bucket: Bucket, s: int, i: int, scale: float) -> None:
        if self.params[i].grad is None:
            bucket.views[s].zero_()
            bucket.to_write.append(s)
        else:
            self._put_copied(bucket, s, i, scale)

    def _put_views(self, bucket: Bucket, scale: float) -> None:
        """gradient_as_bucket_view: a .grad that is not its slot yet (a new one,
        after ``zero_grad(set_to_none=True)``) is multiplied into the slot and
        pointed at it; slots autograd summed into in place are scaled where
        they are (the whole buffer in one multiply when that is every slot).
        Each element is multiplied by the same 0-dim scale once either way, so
        the bits are those of a copy and then a multiply, without the copy's
        second pass over the new gradients."""
        views = bucket.views
        st = scale_tensor(scale, bucket.buffer.dtype) if scale != 1.0 else None
        summed = []  # slots that already were their .grad
        for s, p in enumerate(bucket.params):
            grad, view = p.grad, views[s]
            if grad is None:
                view.zero_()
                bucket.to_write.append(s)
            elif grad.layout is not torch.strided:
                self._put_copied(bucket, s, bucket.param_indices[s], scale)
            elif grad.data_ptr() == view.data_ptr():
                summed.append(view)
            else:
                if st is not None and grad.dtype == view.dtype:
                    torch.mul(grad, st, out=view)
                else:
                    view.copy_(grad)
                    if st is not None:
                        view.mul_(st)
                p.grad = view
        if st is not None and summed:
            if len(summed) == len(views):
                bucket.buffer.mul_(st)
            else:
                torch._foreach_mul_(summed, st)

    # How a gradient goes into its slot, one method per kind (called by the
    # hook, or for a held slot when its bucket is ready); each falls back to
    # the next simpler kind when the gradient does not fit its own. Each reads
    # .grad itself and holds it in exactly one local, because lending.fresh()
    # compares reference counts against a probe made the same way.
    def _put_lent(self, bucket: Bucket, s: int, i: int, scale: float,
                  later: bool = False) -> None:
        grad = self.params[i].grad
        view = bucket.views[s]
        strided = grad.layout is torch.strided  # else sparse: _put_homed copies it
        if strided and grad.data_ptr() == view.data_ptr():
            if scale != 1.0:
                view.mul_(scale_tensor(scale, view.dtype))
        elif strided and not grad.requires_grad and fresh(grad, later):
            self.params[i].grad = bucket.lending.lend(s, grad, scale)
            self._recycled[i] = grad
        else:
            del grad
            self._put_homed(bucket, s, i, scale)

    def _put_homed(self, bucket: Bucket, s: int, i: int, scale: float) -> None:
        """Copy in (scaled) only what the peers read, the part outside this rank's
        own chunk; the collective reads the rest from ``.grad`` and writes the
        whole result back into it."""
        grad = self.params[i].grad
        view = bucket.views[s]
        # A gradient that requires grad (backward(create_graph=True)) is
        # copied: the collective's thread would record autograd history on it.
        if not (grad.layout is torch.strided and grad.is_contiguous()
                and not grad.requires_grad
                and grad.dtype == view.dtype and grad.device == view.device
                and grad.numel() == view.numel()):
            self._put_copied(bucket, s, i, scale)
            return
        flat = grad.view(-1)
        start, n = bucket.offsets[s], bucket.numels[s]
        lo, hi = bucket.own
        for a, b in ((start, min(start + n, lo)), (max(start, hi), start + n)):
            if a < b:
                torch.mul(flat[a - start:b - start], scale_tensor(scale, flat.dtype),
                          out=bucket.buffer[a:b])
        bucket.homes.append((start, flat))
        bucket.homed_slots.add(s)

    # [Note: sparse gradients]
    # nn.Embedding(sparse=True) and nn.EmbeddingBag(sparse=True) give sparse
    # COO gradients. Torch's DDP reduces each as a sparse tensor in a bucket of
    # its own. Here every parameter already has a dense slot, so a sparse
    # gradient is made dense into its slot (scaled like any other) and summed
    # with its bucket; at the end of the backward .grad becomes a coalesced
    # sparse tensor again, with the gradient's sparse dimensions and the rows
    # whose sum is not zero. Every rank takes part in the same bucket
    # collective whatever layout its gradient has, so nothing can pair up
    # wrongly or wait forever. The price is a dense pass over the whole
    # table every step, and a row that ranks touched but whose sum is exactly
    # zero is left out of the indices (torch's keeps it, with zeros). A comm
    # hook sees the dense values in the bucket.
    def _put_copied(self, bucket: Bucket, s: int, i: int, scale: float) -> None:
        grad = self.params[i].grad
        view = bucket.views[s]
        if grad.layout is not torch.strided:
            # A sparse gradient (nn.Embedding(sparse=True)) is summed densely
            # in its slot; see [Note: sparse gradients].
            view.copy_(grad.to_dense())
            if scale != 1.0:
                view.mul_(scale_tensor(scale, view.dtype))
        elif scale != 1.0:
            torch.mul(grad, scale_tensor(scale, grad.dtype), out=view)
        else:
            view.copy_(grad)
        bucket.to_write.append(s)  # the result goes back into .grad at finalize

    def _write_grads(self, bucket: Bucket, used: list[int] | None) -> None:
        # Only the slots whose put left the result to be written back (copied in,
        # or no gradient), and the packed runs: homed, lent and view slots
        # already hold it in .grad.
        homed = bucket.homed_slots
        for slot in bucket.to_write:
            if slot not in homed:  # else the collective wrote the result into .grad
                self._write_slot(bucket, slot, used)
        runs = bucket.runs
        if runs and not bucket.loose and (used is None or all(
                used[i] for run in runs for i in run.indices)) and copy_out_all(bucket):
            return
        for r, run in enumerate(runs):
            if r in bucket.loose:
                continue  # its slots went one by one, into to_write
            if (used is None or all(used[i] for i in run.indices)) and copy_out(bucket, run):
                continue
            for slot in range(run.lo, run.hi):
                self._write_slot(bucket, slot, used)

    def _write_slot(self, bucket: Bucket, slot: int, used: list[int] | None) -> None:
        i = bucket.param_indices[slot]
        if used is not None and used[i] == 0:
            return  # unused on every rank: leave .grad untouched
        p = self.params[i]
        view = bucket.views[slot]
        grad = p.grad
        if grad is not None and grad.layout is not torch.strided:
            p.grad = view.to_sparse(grad.sparse_dim())  # see [Note: sparse gradients]
            return
        if grad is not None and grad.data_ptr() == view.data_ptr():
            return  # .grad is the slot itself (view mode, or lent)
        kind = bucket.kinds[slot]
        if kind is SlotKind.VIEW:
            p.grad = view
        elif grad is None:
            p.grad = bucket.lending.hand_out(slot) if kind is SlotKind.LENT \
                else view.clone()
        elif grad.requires_grad:
            # backward(create_graph=True): torch's DDP writes the result
            # with autograd recording, so .grad keeps requiring grad (its
            # history is the copy; the all-reduce is not differentiated).
            with torch.enable_grad():
                grad.copy_(view)
        else:
            grad.copy_(view)
