"""The bucket rebuild: the arrival order recorded once, the caps in force, rank 0's plan.

[Note: the rebuild]
Buckets are first assigned in definition order, reversed. The first backward
that can show the real order (not find_unused_parameters, whose order is
never final; with static_graph the second backward, as the first marks
everything ready at once) records the order in which gradients arrive. At
the next synchronised forward the buckets are assigned again over that
order, with the rebuild's caps (``BucketCaps.rebuild``), and installed. Every
rank must bucket identically: rank 0's plan (its walk order, assignment,
fast paths and caps) reaches the others in one broadcast (``rank0_plan``).

[Note: the cap's walk]
``bucket_cap_mb`` goes one way; no step writes into an earlier holder:
1. ``DistributedDataParallel._set_caps`` parses it (``BucketCaps.parse``), keeping none.
2. ``Rebuild.caps`` holds it, the one owner; ``Reducer.caps`` and ``bucket_cap_bytes``
   read it (for ``DDP.bucket_bytes_cap``, the logging data and the record).
3. Construction assigns with ``BucketCaps.initial``; the rebuild with ``BucketCaps.rebuild``.
4. Under "auto" rank 0 alone decides ([Note: automatic bucket cap]); its plan brings its
   caps, and ``Rebuild.done`` gives them to the owner once (other caps: each rank's own).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from gradring import config
from gradring.buckets import BucketCaps, assign_buckets
from gradring.fast_paths import FastPaths
from gradring.reducer import autocap


class Rebuild:
    """The recorded arrival order, the caps in force, and what the rebuild made."""

    def __init__(self, num_params: int, caps: BucketCaps) -> None:
        # How many parameters a complete order lists.
        self._n = num_params
        # Order in which gradients arrived, recorded once for the rebuild; changed
        # in place only (recorder() hands out its append).
        self._order: list[int] = []
        # bucket_cap_mb="auto": timings of the recorded backward (see [Note:
        # automatic bucket cap] in autocap.py); None once decided, or without "auto".
        self._stamps: Any = autocap.Stamps(num_params) if caps.auto else None
        # The caps in force: the one owner of the bucket cap (see [Note: the cap's walk]).
        self.caps = caps
        # bucket_cap_mb="auto": the decision and its predictions.
        self.auto_cap: Any = None
        # Whether the buckets were rebuilt (once per reducer).
        self.has_rebuilt = False
        # What _get_ddp_logging_data reports about the rebuilt buckets.
        self.bucket_sizes: list[int] = []
        self.param_indices: list[list[int]] = []

    # -------------------------------------------------------- the recorded backward
    def stamp_forward(self) -> None:
        """"auto": a forward before the backward to record."""
        if self._stamps is not None and not self._order:
            self._stamps.t_forward = time.perf_counter()

    def stamp_backward(self) -> None:
        """"auto": the backward to record is next."""
        if self._stamps is not None and not self._order:
            self._stamps.t_backward = time.perf_counter()

    def stamp_end(self) -> None:
        """"auto": the recorded backward ended."""
        if self._stamps is not None:
            self._stamps.t_end = time.perf_counter()

    def recorder(self) -> Callable[[int], None]:
        """What the recording backward calls with each arriving parameter's
        index: the order's own append (no Python frame per gradient), or with
        "auto" one that also stamps the time."""
        return self._order.append if self._stamps is None else self._note_stamped

    def _note_stamped(self, i: int) -> None:
        self._order.append(i)
        self._stamps.mark(i)

    def order(self) -> list[int]:
        """The arrival order recorded so far."""
        return list(self._order)

    def complete(self) -> bool:
        """Whether a whole backward's order is recorded (the rebuild is due)."""
        return len(self._order) == self._n

    def stand_in(self) -> None:
        """Join's shadow backward: record definition order if nothing complete
        was seen, so this rank rebuilds in step with the others (rank 0's
        order is what counts)."""
        if not self.complete():
            self._order[:] = range(self._n)  # in place: recorder() hands out its append

    # -------------------------------------------------------------- the rebuild
    def caps_to_assign(self, comm: Any, names: list[str], sizes: list[int],
                       keys: list[Any]) -> BucketCaps:
        """The caps in force, or under "auto" on rank 0 the ones it chose."""
        if self._stamps is None:
            return self.caps
        self.auto_cap = autocap.choose_cap(comm, names, sizes, keys, *self._stamps.parts())
        self._stamps = None
        mine = self.auto_cap.cap_bytes  # 0 off rank 0: rank0_plan brings its caps
        return self.caps.chosen(mine, self.auto_cap.first_bytes) if mine else self.caps

    def done(self, groups: Sequence[Sequence[int]], sizes: Sequence[int],
             rank0_caps: tuple[int, int]) -> None:
        """The rebuilt buckets are installed: report ``groups`` (torch's; ``sizes`` in
        bytes per parameter), record no more; under "auto" take ``rank0_caps``."""
        if self.caps.auto:
            self.caps = self.caps.chosen(*rank0_caps)
            self.auto_cap = self.auto_cap._replace(cap_bytes=self.caps.cap,
                                                   first_bytes=self.caps.first)
        self.has_rebuilt = True
        self.bucket_sizes = [sum(sizes[i] for i in g) for g in groups]
        self.param_indices = [list(g) for g in groups]
        self._order.clear()


def rank0_plan(comm: Any, sizes: list[int], keys: list[Any], limits: Sequence[int],
               order: list[int], caps: BucketCaps,
               ) -> tuple[list[list[int]], FastPaths, tuple[int, int]]:
    """Assign ``sizes`` over ``order`` with ``limits``; rank 0's assignment (each
    bucket in walk order), fast paths ([Note: the core and its fast paths]) and
    (cap, first bucket's cap) then reach every rank in one broadcast."""
    groups = assign_buckets(sizes, limits, keys=keys, order=order)
    fast = config.current().fast_paths
    n = len(order)
    if comm.world_size == 1:
        return groups, fast, (caps.cap, caps.first)
    plan = torch.empty(2 * n + 3, dtype=torch.int64)
    plan[:n] = torch.tensor(order, dtype=torch.int64)
    for g, idxs in enumerate(groups):
        plan[n + torch.tensor(idxs, dtype=torch.int64)] = g
    plan[2 * n:] = torch.tensor([fast.bits(), caps.cap, caps.first], dtype=torch.int64)
    comm.broadcast_coalesced([plan])
    bits, cap, first = plan[2 * n:].tolist()
    walk, bucket_of = plan[:n].tolist(), plan[n:2 * n].tolist()
    out: list[list[int]] = [[] for _ in range(max(bucket_of) + 1)]
    for i in walk:
        out[bucket_of[i]].append(i)
    return out, FastPaths.from_bits(bits), (cap, first)
