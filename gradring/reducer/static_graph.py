"""static_graph: what iteration 1 learns, and the delayed all-reduce's maps.

[Note: static_graph's first iteration]
In iteration 1 the hooks only count how often each parameter's gradient
arrives; nothing is reduced while the backward runs. When it ends (the
output boundary queued the callback, see ``output_boundary.py``), every
bucket is marked ready and reduced at once (``Reducer.delay_all_reduce``),
together with two usage maps in one collective: which parameters' hooks
fired on some rank (kept: the others are skipped from then on, their
``.grad`` never written) and which had a gradient on some rank (this
iteration only: a hook that fired without one leaves ``.grad`` None, as
torch's does). Later iterations expect each parameter's hook the counted
number of times and mark it ready at the last one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class StaticGraph:
    """The counts and usage static_graph's first iteration learnt."""

    def __init__(self, num_params: int) -> None:
        # Hook firings per parameter, counted in iteration 1.
        self._counts = [0] * num_params
        # Parameters whose hooks did not fire on this rank in iteration 1,
        # marked ready at each later backward's first hook.
        self._unused: list[int] = []
        # 0 for parameters no rank used in iteration 1 (their .grad stays put);
        # None until the first iteration's maps came back.
        self._used: list[int] | None = None
        # Whether this backward's delayed all-reduce is queued (once per backward).
        self._delay_queued = False

    def count(self, i: int) -> None:
        """Iteration 1: parameter ``i``'s hook fired."""
        self._counts[i] += 1

    def begin_backward(self) -> list[int]:
        """A new backward: the hook firings each parameter still expects."""
        self._delay_queued = False
        return list(self._counts)

    def was_counted(self, i: int) -> bool:
        """Whether parameter ``i``'s hook fired in iteration 1."""
        return self._counts[i] > 0

    def first_count(self, i: int) -> int:
        """How many times parameter ``i``'s hook fired in iteration 1."""
        return self._counts[i]

    def unused(self) -> list[int]:
        """Parameters whose hooks did not fire in iteration 1 (this rank)."""
        return self._unused

    def used(self) -> list[int] | None:
        """Per parameter, 0 where no rank used it in iteration 1 (None before its end)."""
        return self._used

    def queue_delay_once(self) -> bool:
        """True the first time in this backward: queue the delayed all-reduce now."""
        if self._delay_queued:
            return False
        self._delay_queued = True
        return True

    def first_iteration_maps(self, params: Sequence[torch.Tensor]) -> torch.Tensor:
        """The end of iteration 1: note the unused parameters and return both
        usage maps, to be summed over the ranks (see [Note: static_graph's
        first iteration])."""
        counts = self._counts
        self._unused = [i for i, c in enumerate(counts) if c == 0]
        return torch.tensor([int(c > 0) for c in counts]
                            + [int(p.grad is not None) for p in params], dtype=torch.int32)

    def keep_used(self, maps: list[int]) -> list[int]:
        """The summed maps came back: keep the first (hooks fired anywhere) and
        return the second (this iteration's gradients) for the write-back."""
        n = len(self._counts)
        self._used = maps[:n]
        return maps[n:]
