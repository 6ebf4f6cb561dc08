"""find_unused_parameters: which parameters each forward left out, and the usage map.

[Note: used since the last reduction]
Under no_sync, gradients accumulate in .grad and nothing is reduced; the
synchronised backward that follows reduces the whole accumulated .grad.
So "used" means "had a gradient on this rank in any backward since the
usage map was last all-reduced", as in torch: the map is filled by every
hook, no_sync's included, and started afresh only once it is sent. A
parameter that this forward did not reach but an earlier no_sync step
did is marked ready with its accumulated .grad (see Reducer._mark_ready), and a
parameter used on any rank gets the reduced gradient on every rank,
even where its .grad was None (tests/ranks/test_no_sync_unused.py).

[Note: skipped buckets]
skip_all_reduce_unused_params=True (with find_unused_parameters), as in
torch: a bucket all of whose parameters this rank's forward did not
reach is not reduced at all. Its "launch" is a future that already
holds the bucket, and the finalize writes nothing of it, since the
usage map says no rank used those parameters: torch's contract for the
option is that the unused parameters are the same on every rank (a rank
that breaks it pairs the wrong collectives, in torch as here).
A parameter this forward did not reach but an earlier no_sync backward gave
a gradient still has an accumulated .grad to reduce: its bucket is not skipped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from gradring import errors
from gradring.announce import stderr_warning_once
from gradring.graph import reachable_params
from gradring.observe.trace import profiled


class UnusedTracker:
    """find_unused_parameters' state: this forward's unused parameters, the
    local usage map since it was last sent, and the last global one."""

    def __init__(self, num_params: int, *, skip_unused_buckets: bool) -> None:
        self._n = num_params
        # skip_all_reduce_unused_params: see [Note: skipped buckets].
        self.skip_unused_buckets = skip_unused_buckets
        # Parameters the last forward did not reach.
        self.unused: list[int] = []
        # 1 where this rank produced a gradient since the usage map was last
        # sent, no_sync backwards included (see [Note: used since the last
        # reduction]; a bytearray: setting an item of a tensor in every hook
        # costs microseconds). The hooks write it directly.
        self.local_used = bytearray(num_params)
        # The last all-reduced usage map, int32 ranks-per-parameter (what
        # torch's _get_local_used_map returns after a backward).
        self.global_used: torch.Tensor | None = None
        # The previous forward's unused set, and whether it has been the same
        # every iteration so far (torch's _ddp_graph_static).
        self._prev_unused: list[int] | None = None
        self.graph_static = True
        # Whether "find_unused_parameters found nothing unused" was said (once).
        self._warned_nothing_unused = False

    def begin_backward(self, outputs: Sequence[torch.Tensor] | None, index_of: dict[int, int],
                       bucket_params: Sequence[Sequence[int]]) -> frozenset[int]:
        """After a forward: find what it did not reach; the buckets to skip
        (see [Note: skipped buckets])."""
        with profiled("torch.distributed.ddp.reducer::search_unused_parameters"):
            reached = reachable_params(outputs or [], index_of)
        self.unused = [i for i in range(self._n) if i not in reached]
        if self._prev_unused is not None and self.unused != self._prev_unused:
            self.graph_static = False  # for good, as torch's flag
        self._prev_unused = self.unused
        if not self.unused and not self._warned_nothing_unused:
            self._warned_nothing_unused = True
            # torch's C++ reducer says it on stderr, once per process.
            stderr_warning_once("nothing_unused", errors.nothing_unused())
        if not self.skip_unused_buckets:
            return frozenset()
        local = self.local_used
        unused = {i for i in self.unused if not local[i]}
        return frozenset(k for k, idxs in enumerate(bucket_params)
                         if all(i in unused for i in idxs))

    def send(self, comm: Any) -> Any:
        """The last bucket launched: all-reduce the usage map (a future) and start afresh."""
        used = torch.frombuffer(self.local_used, dtype=torch.uint8)
        fut = comm.all_reduce(used.to(torch.int32), label="DDP unused-parameter map")
        self.local_used = bytearray(self._n)
        return fut

    def shadow(self, comm: Any) -> None:
        """Join: as torch's joined rank, all-reduce the last map it holds (the
        global one of its last backward) in place, so a parameter any rank used
        before stays "used" for the ranks still training (its gradient becomes
        zeros, not None)."""
        if self.global_used is None:
            self.global_used = torch.zeros(self._n, dtype=torch.int32)
        comm.all_reduce(self.global_used, label="DDP unused-parameter map").wait()

    def local_used_map(self) -> torch.Tensor:
        """torch's ``_get_local_used_map``: how many ranks used each parameter
        since the map was last sent (int32, one per parameter)."""
        if self.global_used is None:
            return torch.zeros(self._n, dtype=torch.int32)
        return self.global_used
