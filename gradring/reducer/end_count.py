"""Small gradients counted in at the end of the backward, without a hook of their own.

[Note: counted at the end]
A packed slot's hook (see [Note: packed slots] in ``buckets/packing.py``)
does no tensor work: it only counts the gradient in, and the whole bucket's
small slots are copied in once its last gradient has arrived. Yet the hook
itself is what such a slot costs most: autograd calling into Python once per
parameter measured 1.4-2.5 us on this VM, and the counting another 1-1.5 us
(``benchmarks/hook_cost.py``), against torch's C++ reducer at 7-8 us per
parameter in all. On 2,000 tensors of 64 floats that was most of gradring's
overhead.

A bucket the finalize reduces anyway (every bucket when ready buckets do not
launch at once, else the last one: see [Note: the last bucket] in
``reducer.py``) gains nothing from knowing early that a small gradient is
in. So, once the bucket order is final and on the reducer's default path
(no comm hook, fused or in-backward optimizer, find_unused_parameters,
static_graph, gradient_as_bucket_view (whose ``.grad`` views share the
bucket's version counter), shared parameters or compiled autograd), the
packed slots of those buckets go without a hook. What the
hook told, the end of the backward reads from ``.grad`` itself:

- after the forward, this object takes a snapshot of each such parameter's
  ``.grad``: the tensor (a reference, so that its identity cannot be reused)
  and its version counter;
- autograd puts a gradient in by adding in place (the version moves on) or
  by setting a new tensor (the identity changes), and nothing else; so at
  the end of the backward a parameter whose ``.grad`` is the same tensor at
  the same version received no gradient in this backward.

A bucket whose slots are all small keeps the hook of one, so that a
backward through the whole bucket runs a hook; the first hook of a backward
queues the count for its end. If a gradient is missing there, the reduction stays unfinished
and the next forward raises, naming it, as when a hook never fired; a
backward that reached only unhooked parameters (so no hook ran) is caught
by that next forward too (``any_arrived``): a ``.grad`` that moved to a
value other than zeros, or, when ``zero_grad(set_to_none=True)`` dropped it
since, unhooked parameters that an optimizer step changed in place while no
hooked one changed. Not caught: the same with ``zero_grad(set_to_none=False)``
between the step and the next forward (the step then changes every
parameter). A synchronised forward with no backward after it, followed by an
in-place change of small parameters only, under ``no_grad``, then a forward,
raises as if it were that case.

Two differences from hooking, both on error paths torch's DDP rejects: a
parameter whose ``.grad`` the user changes in place between the forward and
the backward (``zero_grad(set_to_none=False)`` there) counts as arrived,
and one gradient accumulated twice in one backward (reentrant
checkpointing) is not told apart from one. Both are still caught when they
happen in the first iteration, which hooks every parameter until the bucket
order is final (docs/ddp-differences.md). Compiled autograd reports no end of the backward:
a reducer that saw a compiled backward, or sees compiled autograd switched on
at the forward, keeps every hook.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from itertools import repeat

import torch


class EndCounted:
    """Which parameters go without a hook, and whether their gradients came in."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        # The reducer's parameters, by index.
        self._params = list(params)
        # The unhooked parameters, in bucket order, and per bucket (its index,
        # and its unhooked parameters' indices).
        self.indices: list[int] = []
        # Their parameters, in the same order, and the parameters still hooked.
        self._watched: list[torch.Tensor] = []
        self._hooked: list[torch.Tensor] = []
        self.by_bucket: list[tuple[int, list[int]]] = []
        # The snapshot after the forward: each unhooked parameter's .grad and
        # its version (-1 for None).
        self._grads: list[torch.Tensor | None] = []
        self._versions: list[int] = []
        # Whether every such .grad was None then (zero_grad(set_to_none=True), the
        # common case): a .grad at the end is then a gradient of this backward.
        self._none_before = False
        # And each such parameter's own version then (an optimizer step moves it on).
        self._param_versions: list[int] = []
        self._hooked_versions: list[int] = []

    def plan(self, buckets: Sequence[tuple[int, list[int], list[bool]]]) -> list[int]:
        """Choose the unhooked parameters among ``buckets``: (bucket index, its
        parameter indices in slot order, whether each slot is packed). A bucket
        of nothing but packed slots keeps its first slot hooked. Returns the
        chosen indices (also kept in ``indices``)."""
        by_bucket = []
        for index, param_indices, packed in buckets:
            chosen = [i for i, p in zip(param_indices, packed) if p]
            if len(chosen) == len(param_indices):
                chosen = chosen[1:]  # the bucket's one hook
            if chosen:
                by_bucket.append((index, chosen))
        self.by_bucket = by_bucket
        self.indices = [i for _, chosen in by_bucket for i in chosen]
        self._watched = [self._params[i] for i in self.indices]
        unhooked = set(self.indices)
        self._hooked = [p for i, p in enumerate(self._params) if i not in unhooked]
        self.forget()
        return self.indices

    def clear(self) -> None:
        """Every parameter is hooked again."""
        self.indices, self.by_bucket, self._watched, self._hooked = [], [], [], []
        self.forget()

    def snapshot(self) -> None:
        """After the forward: what each unhooked parameter's ``.grad`` is now."""
        grads = [p.grad for p in self._watched]
        self._grads = grads
        self._param_versions = [p._version for p in self._watched]
        self._hooked_versions = [p._version for p in self._hooked]
        self._none_before = not any(map(operator.is_not, grads, repeat(None)))
        self._versions = [] if self._none_before else \
            [-1 if g is None else g._version for g in grads]

    def missing(self) -> list[int]:
        """At the end of the backward: the unhooked parameters that received no gradient."""
        if len(self._grads) != len(self.indices):  # no snapshot: nothing is known to be in
            return list(self.indices)
        if self._none_before:
            now = [p.grad for p in self._watched]
            if all(map(operator.is_not, now, repeat(None))):  # identity: no Tensor.__eq__
                return []
            return [i for i, g in zip(self.indices, now) if g is None]
        out = []
        for i, p, old, version in zip(self.indices, self._watched, self._grads, self._versions):
            g = p.grad
            if g is None or (g is old and g._version == version):
                out.append(i)
        return out

    def any_arrived(self) -> bool:
        """After a synchronised forward that no hooked gradient followed: whether a
        backward reached unhooked parameters since the snapshot (see [Note:
        counted at the end]). Only on that rare path, so it may look at values."""
        if not self._grads:
            return False
        unmoved = set(self.missing())
        for i, p in zip(self.indices, self._watched):
            g = p.grad
            # Moved: a gradient, unless zero_grad(set_to_none=False) zeroed it.
            if i not in unmoved and (g.layout is not torch.strided or bool(g.any())):
                return True
        # zero_grad(set_to_none=True) drops what a backward left, but an
        # optimizer step on it changed those parameters, and only those: a
        # parameter with no gradient is not stepped (loading weights changes all).
        stepped = any(p._version != v for p, v in zip(self._watched, self._param_versions))
        return stepped and all(p._version == v
                               for p, v in zip(self._hooked, self._hooked_versions))

    def forget(self) -> None:
        """Drop the snapshot (its references to old gradients)."""
        self._grads, self._versions, self._none_before = [], [], False
        self._param_versions, self._hooked_versions = [], []
