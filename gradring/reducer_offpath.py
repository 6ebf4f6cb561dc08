"""The reducer's paths off the per-gradient hot path.

``Reducer`` (reducer.py) inherits these; they run once per iteration at most,
or only on rare paths, so they live apart from the hook and finalize code that
runs for every parameter on every iteration:

- the bucket rebuild at the second forward, with every rank following rank 0's
  assignment;
- ownership among several wrappers of one module ([Note: owners]);
- static_graph's delayed all-reduce of iteration 1 and the output boundary's
  trigger for it;
- Join's shadow backward;
- the unfinished-reduction error and the check behind it;
- the names torch's C++ Reducer gives some of these (Lightning calls them);
- running a callback at the end of backward, compiled autograd included.

Every method here reads and writes only the reducer's own state.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch

from gradring import errors, overlap_policy
from gradring.buckets import Bucket, assign_buckets
from gradring.graph import GraphMode


def _queue_engine_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the autograd engine finishes this backward.

    [Note: compiled autograd]
    Under compiled autograd the backward runs as one compiled function; the
    gradient hooks (modules Dynamo never traces, see ``gradring/compile.py``)
    are graph breaks inside it and run eagerly, in backward order, so the
    buckets still launch while later pieces of the backward compute (where
    the reducer overlaps at all, see [Note: overlap needs a free core]). The
    engine's final callbacks are not available there (Dynamo only accepts
    ``queue_callback`` in a full graph), so the finalize runs as soon as the
    last bucket has launched: every parameter's gradient is in by then, and
    what is left of the backward (gradients of inputs) runs after it instead
    of beside it. static_graph's first iteration, whose reduction has to wait
    for the end of a backward it cannot see coming, is refused.
    """
    if _in_compiled_autograd():
        if getattr(fn, "__func__", None) is ReducerOffPath.delay_all_reduce:
            raise RuntimeError(_STATIC_UNDER_CA)
        fn()
        return
    torch.autograd.Variable._execution_engine.queue_callback(fn)


_STATIC_UNDER_CA = (
    "static_graph=True: the first iteration cannot run under compiled autograd "
    "(its delayed all-reduce must run when the whole backward ended, which compiled "
    "autograd does not report). Run the first backward with compiled autograd off, "
    "then turn it on."
)


def _in_compiled_autograd() -> bool:
    """Whether a compiled-autograd backward is running (without importing Dynamo)."""
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    return ca is not None and bool(ca.in_compiled_autograd_region)


class ReducerOffPath:
    """Mixin of :class:`gradring.reducer.Reducer`: its rare and once-per-iteration paths."""

    def rebuild_if_needed(self) -> bool:
        """At the start of a forward: rebuild buckets in gradient-arrival order, once."""
        if self.has_rebuilt or self.mode is GraphMode.FIND_UNUSED:
            return False
        if len(self._arrival) != len(self.params):
            return False
        order = list(self._arrival)
        if self.auto_stamps is not None:
            from gradring import autocap  # only for bucket_cap_mb="auto"

            self.auto_cap = autocap.choose_cap(self.comm, self.names, self._sizes, self._keys,
                                               *self.auto_stamps.parts())
            self.bucket_cap_bytes = self.auto_cap.cap_bytes
            self.auto_stamps = None
            caps = self.caps.rebuild(self.bucket_cap_bytes)
        else:
            caps = self.caps.rebuild()
        # Every rank must bucket identically: rank 0's order and caps win.
        groups = self._rank0_groups(
            assign_buckets(self._sizes, caps, keys=self._keys, order=order), order)
        self._install(groups)
        self.has_rebuilt = True
        self.rebuilt_bucket_sizes = [b.nbytes for b in self.buckets]
        self.rebuilt_param_indices = [list(b.param_indices) for b in self.buckets]
        self._arrival = []
        return True

    def _rank0_groups(self, groups: list[list[int]], order: list[int]) -> list[list[int]]:
        """Rank 0's bucket assignment, on every rank.

        ``groups`` (this rank's assignment) was built by walking ``order``, so
        each bucket lists its parameters in walk order; one broadcast of the
        walk order and of each parameter's bucket number rebuilds rank 0's.
        Rank 0's overlap choice travels in the same broadcast and becomes
        every rank's ``overlap`` (see [Note: overlap needs a free core]).
        """
        n = len(self.params)
        mine = self._overlap_choice()
        if self.comm.world_size == 1:
            self.overlap, self.overlap_why = mine
            return groups
        plan = torch.empty(2 * n + 1, dtype=torch.int64)
        plan[:n] = torch.tensor(order, dtype=torch.int64)
        for g, idxs in enumerate(groups):
            plan[n + torch.tensor(idxs, dtype=torch.int64)] = g
        plan[2 * n] = int(mine.overlap)  # rank 0's overlap choice travels along
        self.comm.broadcast_coalesced([plan])
        self.overlap = bool(plan[2 * n])
        self.overlap_why = mine.why if self.overlap == mine.overlap else \
            f"rank 0's choice (this rank would have chosen otherwise: {mine.why})"
        walk, bucket_of = plan[:n].tolist(), plan[n:2 * n].tolist()
        out: list[list[int]] = [[] for _ in range(max(bucket_of) + 1)]
        for i in walk:
            out[bucket_of[i]].append(i)
        return out

    def _overlap_choice(self) -> overlap_policy.OverlapChoice:
        """This rank's overlap choice for its parameters' devices and group."""
        devices = {key[1].type for key in self._keys}
        return overlap_policy.choose(
            device_type="cpu" if devices <= {"cpu"} else sorted(devices - {"cpu"})[0],
            on_shared_memory=self.comm.on_shared_memory(), world_size=self.comm.world_size)

    def _claim(self, *, again: bool = False) -> None:
        """Become the owner of this reducer's parameters (see [Note: owners]).
        ``again``: an older reducer takes them back, so two act on them."""
        self._superseded = False
        me = weakref.ref(self)
        for p in self.params:
            entry = _OWNERS.get(id(p))
            if entry is not None and entry[0]() is p:
                old = entry[1]()
                if old is not None and old is not self:
                    if again:
                        old._share()
                        self._share()
                    if not old._superseded:
                        old._step_aside()
            _OWNERS[id(p)] = (weakref.ref(p, _forget_owner(id(p))), me)

    def _share(self) -> None:
        """Another reducer reduces these gradients too: copy them, never keep
        them in place in .grad (homed) or lend bucket memory."""
        if self._shared:
            return
        self._shared = True
        hooked = self.comm_hook is not None
        for bucket in self.buckets:
            bucket.place(bucket.own, homable=False, view_mode=self.grad_as_view, hooked=hooked)
        self._build_routes()

    def _step_aside(self) -> None:
        """A newer reducer owns the parameters now: this one's hooks go quiet
        (it forgets a half-done backward) until its own next forward."""
        self._superseded = True
        self.expect_hooks = False
        self.require_finalize = False
        self._finalized_since_forward = False
        self._drain_launched()
        for b in self.buckets:
            b.reset()

    def _drain_launched(self) -> None:
        """Finish every collective this backward launched, ignoring failures, so
        that none is left dangling for the peers (an abandoned or unfinished
        reduction). A bucket left to the finalize (the last one, or every one
        without overlap: see [Note: the last bucket] in reducer.py) is still
        issued: the peers issue it too."""
        for b in self.buckets:
            try:
                if b.inline:
                    self._reduce_now(b)
                elif b.future is not None:
                    b.future.wait()
            except Exception:  # noqa: BLE001 - the caller reports what matters
                pass

    def check_prior_finished(self) -> None:
        """Any forward with grad enabled, under no_sync() too: the previous
        synchronised backward must have finished its reduction (torch checks
        this in every such forward)."""
        if self.require_finalize:
            self._raise_unfinished()
        # A backward after this forward is not "a second backward after one
        # forward", even when it runs before prepare_for_backward (Lightning's
        # manual optimization under no_sync): its hooks are then ignored.
        self._finalized_since_forward = False

    def delay_all_reduce(self) -> None:
        """static_graph, iteration 1: everything was counted; now reduce all buckets at once."""
        self._static_unused = [i for i, c in enumerate(self._static_counts) if c == 0]
        # Two maps in one collective: which parameters' hooks fired anywhere
        # (kept for later iterations), and which had a gradient anywhere (this
        # iteration only: a hook that fired without one leaves .grad None, as
        # torch's does).
        used = torch.tensor([int(c > 0) for c in self._static_counts]
                            + [int(p.grad is not None) for p in self.params], dtype=torch.int32)
        self._delayed = True
        try:
            for i in range(len(self.params)):
                self._mark_ready(i)
        finally:
            self._delayed = False
        # Learn once which parameters no rank uses; their .grad is never written.
        self._used_future = self.comm.all_reduce(used, label="DDP unused-parameter map")
        self._finalize()

    def shadow_backward(self) -> None:
        """Join: issue this backward's collectives with zero gradients (see [Note: shadowing])."""
        kept = []
        for bucket in self.buckets:
            bucket.lending.claim()  # an old .grad kept elsewhere keeps its values
            # The zeros and the peers' sums are not this rank's gradients: where
            # .grad lives in the bucket (view mode, lent), it is put back after.
            holds_grads = self.grad_as_view or bucket.lending.any_in_use()
            kept.append(bucket.buffer.clone() if holds_grads else None)
            bucket.buffer.zero_()
            self._launch(bucket)
        for bucket, saved in zip(self.buckets, kept):
            bucket.future.wait()
            if saved is not None:
                bucket.buffer.copy_(saved)
            bucket.reset()
        if self.mode is GraphMode.FIND_UNUSED:
            zeros = torch.zeros(len(self.params), dtype=torch.int32)
            self.comm.all_reduce(zeros, label="DDP unused-parameter map").wait()
        if self._recording_arrival() and len(self._arrival) != len(self.params):
            # Rebuild in step with the others; rank 0's order is what counts.
            self._arrival = list(range(len(self.params)))
        self.num_backward += 1

    def _wait_bucket(self, bucket: Bucket) -> Any:
        """Wait for a bucket's collective; a failure names the bucket and its parameters."""
        try:
            return bucket.future.wait()
        except Exception as exc:
            raise self._bucket_failed(bucket, exc) from exc

    def _bucket_failed(self, bucket: Bucket, exc: Exception) -> RuntimeError:
        """The error for a failed bucket collective, naming the bucket and its parameters."""
        self.expect_hooks = False
        self.require_finalize = False
        where = errors.bucket_context(bucket.index, bucket.nbytes, bucket.param_indices,
                                      self.names, self.num_backward + 1)
        return self._fail(f"{exc}\n{where}")

    def static_first_backward(self) -> bool:
        return self.mode is GraphMode.STATIC and self.num_backward == 0

    def on_boundary_backward(self) -> None:
        """The output boundary's backward ran: in static_graph's first
        iteration, queue the delayed all-reduce for the end of this backward."""
        if self.static_first_backward() and not self._delay_queued:
            self._delay_queued = True
            _queue_engine_callback(self.delay_all_reduce)

    def _raise_unfinished(self) -> None:
        missing = [i for i, r in enumerate(self._ready) if not r]
        per_rank = {self.comm.rank: missing}
        per_rank.update(self._peer_missing(missing))
        self._drain_launched()
        self.require_finalize = False
        self.expect_hooks = False
        raise self._fail(
            errors.unfinished_reduction(per_rank, self.names, static_graph=self.static_graph,
                                        world_size=self.comm.world_size)
        )

    def _fail(self, message: str) -> RuntimeError:
        """The error to raise, recorded for DDP's logging data."""
        self.error = message
        return RuntimeError(message)

    def _peer_missing(self, missing: list[int]) -> dict[int, list[int]]:
        """Swap the missing-gradient lists with the other ranks through the store.

        The store, not a collective: ranks in this state may disagree about
        which collectives they issued, and a collective here could pair with
        the wrong one. Ranks that do not answer quickly are simply left out.
        """
        return self.comm.exchange_lists(f"unused/{self.num_forward}", missing)

    # torch's Reducer names, called on ``ddp.reducer`` by Lightning's manual
    # optimization (a backward that runs inside the wrapped module's forward).
    def _rebuild_buckets(self) -> bool:
        """torch's ``_rebuild_buckets``: check the prior reduction finished, then
        rebuild the buckets if this is the time; True if they were rebuilt."""
        self.check_prior_finished()
        return self.rebuild_if_needed()

    def _delay_all_reduce(self) -> None:
        """torch's ``_delay_all_reduce``: static_graph's first iteration, reduce all now."""
        self.delay_all_reduce()


# [Note: owners]
# Each parameter's hooks belong to every reducer built on it, but only its
# owner, the reducer built or run most recently, acts on them. Wrapping a module
# again while the old wrapper is alive (a second Trainer.fit) makes the old
# reducer step aside: its hooks return at once, as torch's do for a reducer that
# expects no hooks, and never raise "backward twice" or join a reduction of the
# new one. The check costs nothing per gradient: stepping aside clears the
# state the hooks look at. A nested DDP (a DDP wrapping a DDP) hands ownership
# back and forth within one forward, so that both reduce, as torch's do.
# id(param) -> (weak param, weak reducer); entries go with their parameter.
_OWNERS: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def _forget_owner(key: int) -> Callable[[Any], None]:
    def forget(_ref: Any) -> None:
        _OWNERS.pop(key, None)
    return forget
