"""The bucket rebuild: the arrival order recorded once, and rank 0's assignment on every rank.

[Note: the rebuild]
Buckets are first assigned in definition order, reversed. The first backward
that can show the real order (not find_unused_parameters, whose order is
never final; with static_graph the second backward, as the first marks
everything ready at once) records the order in which gradients arrive. At
the next synchronised forward the buckets are assigned again over that
order, with the rebuild's caps (``BucketCaps.rebuild``), and installed. Every
rank must bucket identically, so rank 0's walk order and assignment travel
to the others in one broadcast (``rank0_groups``), with rank 0's fast
paths. With ``bucket_cap_mb="auto"`` the recorded backward is also timed
and the cap chosen at the rebuild ([Note: automatic bucket cap] in
``autocap.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from gradring.buckets import BucketCaps
from gradring.fast_paths import FastPaths
from gradring.reducer import autocap


class Rebuild:
    """The recorded arrival order, the "auto" cap's timings, and what the rebuild made."""

    def __init__(self, num_params: int, *, auto_cap: bool) -> None:
        # How many parameters a complete order lists.
        self._n = num_params
        # Order in which gradients arrived, recorded once for the rebuild; changed
        # in place only (recorder() hands out its append).
        self._order: list[int] = []
        # bucket_cap_mb="auto": timings of the recorded backward (see [Note:
        # automatic bucket cap] in autocap.py); None once decided, or without "auto".
        self._stamps: Any = autocap.Stamps(num_params) if auto_cap else None
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
    def caps(self, comm: Any, names: list[str], sizes: list[int], keys: list[Any],
             caps: BucketCaps) -> BucketCaps:
        """The rebuild's caps: ``caps``, or with "auto" the caps it chose."""
        if not caps.auto or self._stamps is None:
            return caps
        self.auto_cap = autocap.choose_cap(comm, names, sizes, keys, *self._stamps.parts())
        self._stamps = None
        return caps.chosen(self.auto_cap.cap_bytes, self.auto_cap.first_bytes)

    def done(self, groups: Sequence[Sequence[int]], sizes: Sequence[int]) -> None:
        """The rebuilt buckets are installed: report ``groups`` (the buckets
        torch's DDP would make; ``sizes`` in bytes per parameter), and record no more."""
        self.has_rebuilt = True
        self.bucket_sizes = [sum(sizes[i] for i in g) for g in groups]
        self.param_indices = [list(g) for g in groups]
        self._order.clear()


def rank0_groups(comm: Any, groups: list[list[int]], order: list[int],
                 fast: FastPaths) -> tuple[list[list[int]], FastPaths]:
    """Rank 0's bucket assignment and fast paths, on every rank.

    ``groups`` (this rank's assignment) was built by walking ``order``, so
    each bucket lists its parameters in walk order; one broadcast of the
    walk order and of each parameter's bucket number rebuilds rank 0's.
    Rank 0's fast paths (see [Note: the core and its fast paths] in
    ``gradring/fast_paths.py``) travel in the same broadcast and become
    every rank's.
    """
    n = len(order)
    if comm.world_size == 1:
        return groups, fast
    plan = torch.empty(2 * n + 1, dtype=torch.int64)
    plan[:n] = torch.tensor(order, dtype=torch.int64)
    for g, idxs in enumerate(groups):
        plan[n + torch.tensor(idxs, dtype=torch.int64)] = g
    plan[2 * n] = fast.bits()  # rank 0's fast paths travel along
    comm.broadcast_coalesced([plan])
    fast = FastPaths.from_bits(int(plan[2 * n]))
    walk, bucket_of = plan[:n].tolist(), plan[n:2 * n].tolist()
    out: list[list[int]] = [[] for _ in range(max(bucket_of) + 1)]
    for i in walk:
        out[bucket_of[i]].append(i)
    return out, fast
