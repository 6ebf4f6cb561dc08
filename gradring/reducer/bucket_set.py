"""The installed buckets: where each parameter's gradient goes.

[Note: installing buckets]
A bucket assignment (lists of parameter indices, in launch order) becomes
``Bucket`` objects: flat buffers from the group's allocator (shared memory on
one host), each slot's kind decided once (see [Note: slot kinds] in
``buckets/bucket.py``), and per parameter one *route*: its bucket, its slot,
and the put function its hook calls (none for a deferred slot, which its
bucket puts in when full). Under ``gradient_as_bucket_view`` an existing
``.grad`` is copied into its new slot and pointed at it, so values
accumulated before (``no_sync``) survive an install.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from gradring.buckets import Bucket
from gradring.buckets.slot_io import CORE_PUTS, SlotContext
from gradring.fast_paths import FastPaths
from gradring.group_comm import GroupComm

#: A parameter's route: its bucket, its slot, and its hook's put function
#: (None for a deferred slot).
Route = tuple[Bucket, int, "Callable[[Bucket, int, float], None] | None"]


class BucketSet:
    """The reducer's installed buckets and each parameter's route into them."""

    def __init__(self, params: Sequence[torch.Tensor], comm: GroupComm, *,
                 view_mode: bool) -> None:
        self._params = list(params)
        self._comm = comm
        # gradient_as_bucket_view: .grad is the slot.
        self._view_mode = view_mode
        # Sizes in bytes per parameter.
        self._sizes = [p.numel() * p.element_size() for p in self._params]
        # The installed buckets, in launch order.
        self.buckets: list[Bucket] = []
        # param index -> (bucket index, slot index).
        self._locator: list[tuple[int, int]] = []
        # param index -> route, looked up once per gradient.
        self.routes: list[Route] = []
        # Whether a comm hook is set (slots are then plain copies).
        self._hooked = False
        # Whether another live reducer acts on these parameters (nested DDP):
        # gradients are then copied, never kept in .grad.
        self._shared = False
        # The fast paths in force (rank 0's, see rebuild.rank0_plan).
        self._fast = FastPaths()
        # Per parameter, whether its arrival may be counted without a Python
        # hook; None while counting is off ([Note: counted slots] in packed.py).
        self._countable: list[bool] | None = None

    # ------------------------------------------------------------ installing
    def install(self, groups: list[list[int]], fast: FastPaths) -> None:
        """Install ``groups`` (see [Note: installing buckets])."""
        self._fast = fast
        self._install(groups)

    def _install(self, groups: list[list[int]]) -> None:
        comm, params = self._comm, self._params
        buckets = []
        locator: list[tuple[int, int]] = [(0, 0)] * len(params)
        for bi, idxs in enumerate(groups):
            bucket = Bucket(bi, idxs, [params[i] for i in idxs], comm.empty)
            self._place(bucket)
            for slot, i in enumerate(idxs):
                locator[i] = (bi, slot)
            buckets.append(bucket)
        self.buckets, self._locator = buckets, locator
        self._build_routes()
        if self._view_mode:
            # Keep accumulated values (e.g. from no_sync) and point .grad at the
            # new views; a sparse .grad is never a view (as in torch's DDP).
            with torch.no_grad():
                for i, p in enumerate(params):
                    if p.grad is not None and p.grad.layout is torch.strided:
                        b, s = locator[i]
                        view = buckets[b].views[s]
                        view.copy_(p.grad)
                        p.grad = view

    def _place(self, bucket: Bucket) -> None:
        comm = self._comm
        ctx = SlotContext(view_mode=self._view_mode, hooked=self._hooked, shared=self._shared,
                          world_size=comm.world_size,
                          own=comm.own_range(bucket.buffer.numel()),
                          countable=self._countable)
        bucket.place(ctx, self._fast.classes())

    def _build_routes(self) -> None:
        routes: list[Route] = []
        for b, s in self._locator:
            bucket = self.buckets[b]
            path = bucket.path_of(s)
            routes.append((bucket, s, CORE_PUTS[bucket.kinds[s]] if path is None else path.put))
        self.routes = routes

    # --------------------------------------------------- what changes the kinds
    def set_hooked(self) -> None:
        """A comm hook is registered: every slot becomes a plain copy (or view)."""
        self._hooked = True
        for bucket in self.buckets:
            self._place(bucket)
        self._build_routes()

    def share(self) -> None:
        """Another reducer reduces these gradients too: never keep them in .grad."""
        if self._shared:
            return
        self._shared = True
        for bucket in self.buckets:
            self._place(bucket)
        self._build_routes()

    def count_by(self, countable: list[bool] | None) -> list[Any]:
        """Count arrivals without a Python hook where ``countable`` allows
        (None: nowhere); per parameter, the builtin its hook becomes, or None
        where it keeps the reducer's ([Note: counted slots] in packed.py)."""
        if countable != self._countable:
            self._countable = countable
            for bucket in self.buckets:
                self._place(bucket)
            self._build_routes()
        counters: list[Any] = [None] * len(self._params)
        for i, (b, s) in enumerate(self._locator):
            for path in self.buckets[b].counting:
                counters[i] = path.counter(s) or counters[i]
        return counters

    # ---------------------------------------------------------------- queries
    def bucket_of(self, param_index: int) -> int:
        """The index of the bucket parameter ``param_index`` is in."""
        return self._locator[param_index][0]

    def reset(self) -> None:
        """Every bucket back to FILLING, for the next backward."""
        for b in self.buckets:
            b.reset()

    def grad_bytes_outside(self) -> int:
        """Bytes of ``.grad`` memory outside the buckets' buffers."""
        spans = [(b.buffer.data_ptr(), b.buffer.data_ptr() + b.nbytes) for b in self.buckets]
        outside = 0
        for p in self._params:
            if p.grad is not None and not any(lo <= p.grad.data_ptr() < hi for lo, hi in spans):
                outside += p.grad.numel() * p.grad.element_size()
        return outside
