"""Counting packed slots' arrivals without a Python hook: when it is on, and
what it leaves the reducer to check (see [Note: counted slots] in
``buckets/packed.py``)."""

from __future__ import annotations

import collections
import sys
from collections.abc import Callable

from gradring.buckets import Bucket, BucketState
from gradring.reducer.bucket_set import BucketSet
from gradring.reducer.grad_hooks import GradHooks

_FILLING = BucketState.FILLING


class Counting:
    """Whether this reducer's packed slots are counted by builtins, and the
    checks that stand in for their missing Python hooks."""

    def __init__(self, hooks: GradHooks, bucket_set: BucketSet) -> None:
        self._hooks = hooks
        self._set = bucket_set
        # Whether some slot is counted by a builtin now.
        self.on = False
        # What the plan was made for: None (to be made), or whether counting
        # was allowed and compiled autograd was on.
        self._made_for: tuple[bool, bool] | None = None
        # Parameters of buckets whose last slot once fired before their
        # counted ones: their arrival order is not the recorded one, so they
        # keep the reducer's hooks from the next forward on.
        self._excluded: set[int] = set()

    def stale(self) -> None:
        """Buckets, slot kinds or the mode changed: plan again at the next forward."""
        self._made_for = None

    def plan(self, allowed: bool) -> None:
        """At a synchronised forward: count where ``allowed`` (final bucket order,
        settled hooks, the default graph mode) and compiled autograd is off."""
        key = (allowed, compiled_autograd_on())
        if key == self._made_for:
            return
        self._made_for = key
        countable = self._hooks.on_tensor() if key == (True, False) else None
        if countable is not None:
            for i in self._excluded:
                countable[i] = False
        counters = self._set.count_by(countable)
        self._hooks.count_with(counters)
        self.on = any(c is not None for c in counters)

    def missed(self, bucket: Bucket) -> None:
        """``bucket``'s Python hooks are all in, its counted slots not: its
        gradients arrive in another order than recorded. Count none of its
        slots from the next forward on (this backward completes it late)."""
        self._excluded.update(bucket.param_indices)
        self._made_for = None

    def pending_arrivals(self) -> bool:
        """Whether a counted slot was heard since the buckets were last reset."""
        return self.on and any(b.counted_in() for b in self._set.buckets)

    def arrived(self, index_of: dict[int, int]) -> set[int]:
        """The indices of the parameters counted in since the last reset."""
        return {index_of[id(p)] for b in self._set.buckets for p in b.counted_params()}

    def catch_up(self, first: int, complete: Callable[[Bucket], None]) -> None:
        """From bucket ``first`` on, ``complete`` each filling bucket whose
        gradients are all in, up to the first that is not (lower buckets launch
        first, so nothing above it could launch anyway)."""
        buckets = self._set.buckets
        for bucket in buckets[first:]:
            if bucket.state is _FILLING:
                if not bucket.all_in():
                    return
                complete(bucket)

    def heard_twice(self, index_of: dict[int, int]) -> int | None:
        """A parameter counted in twice in this backward, or None."""
        for bucket in self._set.buckets:
            if bucket.counted_in() > bucket.n_counted:
                ids = collections.Counter(id(p) for p in bucket.counted_params())
                return index_of[ids.most_common(1)[0][0]]
        return None


def compiled_autograd_on() -> bool:
    """Whether compiled autograd is enabled (hooks then run inside its graph,
    and the engine's end-of-backward callbacks are not available)."""
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    if ca is None:
        return False
    if getattr(ca, "compiled_autograd_enabled", False):
        return True
    config = sys.modules.get("torch._dynamo.config")
    return bool(getattr(config, "compiled_autograd", False))
