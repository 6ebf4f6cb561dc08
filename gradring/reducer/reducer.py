"""The Reducer: the per-iteration state machine that averages gradients across ranks.

[Note: one backward, as the reducer sees it]
1. ``prepare_for_backward`` (after the forward) resets the iteration's
   state and, under ``find_unused_parameters``, records which parameters the
   forward never reached (``graph.py``).
2. Each parameter's gradient hook ([Note: where the hooks sit] in
   ``grad_hooks.py``) calls ``_on_grad``, which marks the parameter ready:
   its gradient goes into its bucket slot, scaled by 1/world_size, as its
   slot's kind says ([Note: slot kinds] in ``buckets/bucket.py``), and the
   bucket's pending count drops. The first hook of a backward also marks
   the unused parameters ready (their slots are zeroed).
3. A bucket whose count reaches 0 is READY, and ready buckets launch in
   index order ([Note: in-order launch] in ``launcher.py``).
4. When the last bucket has launched, the finalize is queued on the autograd
   engine. At the end of the backward it takes each bucket's result in
   order and writes it where ``.grad`` needs it. When ``loss.backward()``
   returns, gradients are reduced.
If a backward ends with a bucket that never became ready (an unused
parameter without find_unused_parameters), the finalize is never queued, the
reduction stays unfinished, and the next forward raises, naming the
parameters.

The Reducer coordinates; each concept lives with a collaborator that owns
its state: the installed buckets and routes (``bucket_set.py``), launching
and ending collectives (``launcher.py``), the rebuild (``rebuild.py``),
static_graph's first iteration (``static_graph.py``), the hooks
(``grad_hooks.py``) and the owner registry (``owners.py``). What the core does and which fast paths
exist is in [Note: the core and its fast paths] (``gradring/fast_paths.py``).
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from gradring import errors
from gradring.announce import notice
from gradring.buckets import Bucket, BucketCaps, bucket_key
from gradring.buckets.slot_io import write_grads
from gradring.graph import GraphMode
from gradring.group_comm import GroupComm
from gradring.observe.trace import Trace, profiled
from gradring.reducer.bucket_set import BucketSet
from gradring.reducer.counting import Counting
from gradring.reducer.engine_callback import in_compiled_autograd, queue_engine_callback
from gradring.reducer.grad_hooks import GradHooks
from gradring.reducer.launcher import CommHook, Launcher
from gradring.reducer.owners import OWNERS
from gradring.reducer.rebuild import Rebuild, rank0_plan
from gradring.reducer.state import IterationState
from gradring.reducer.static_graph import StaticGraph
from gradring.reducer.unused import UnusedTracker

__all__ = ["CommHook", "Reducer"]

# Compared by identity on the per-gradient path: module constants, one global
# load each, instead of an attribute of the enum class.
_IDLE = IterationState.IDLE
_EXPECTING = IterationState.EXPECTING
_REDUCING = IterationState.REDUCING
_FINALIZED = IterationState.FINALIZED
_STATIC = GraphMode.STATIC
_FIND_UNUSED = GraphMode.FIND_UNUSED


#: Numbers the reducers this process builds (see Reducer._serial).
_SERIALS = itertools.count()


class Reducer:
    """Owns the buckets and drives their reduction during backward."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str],
        comm: GroupComm,
        *,
        caps: BucketCaps,
        mode: GraphMode,
        gradient_as_bucket_view: bool,
        skip_unused_buckets: bool = False,
        static_graph: bool = False,  # given to DDP's constructor: the first buckets are one
    ) -> None:
        # This process's count of reducers so far: the same on every rank (DDPs are
        # built collectively, in the same order), so it keys this reducer's
        # error-path store exchanges apart from an earlier reducer's on the group.
        self._serial = next(_SERIALS)
        # Parameters that require grad, in the module's definition order.
        self.params = list(params)
        # Their qualified names, for errors that name names.
        self.names = list(names)
        # id(param) -> index, for the graph walk and index_of().
        self._index_of = {id(p): i for i, p in enumerate(self.params)}
        # Collectives over the DDP process group (``comm``; the launcher holds it too).
        self._comm = comm
        # How parameters' participation is learnt (see GraphMode); the one
        # place static_graph is stored.
        self.mode = mode
        # Whether the user asked for find_unused_parameters (static_graph, set
        # later, overrides the mode; errors' advice still knows it was asked).
        self.find_unused_asked = mode is GraphMode.FIND_UNUSED
        # gradient_as_bucket_view: .grad is the bucket slot.
        self.grad_as_view = gradient_as_bucket_view
        # Sizes in bytes, fixed for the module's life (the bucket assignment's input).
        self._sizes = [p.numel() * p.element_size() for p in self.params]
        # (dtype, device) keys: tensors of different keys never share a bucket.
        self._keys = [bucket_key(p) for p in self.params]
        # The recorded order, the caps' one owner, what the rebuild made ([Note: the rebuild]).
        self._rebuild = Rebuild(len(self.params), caps)
        # What static_graph's first iteration learnt (see [Note: static_graph's
        # first iteration]); unused in the other modes.
        self._static = StaticGraph(len(self.params))
        # find_unused_parameters' state (see [Note: used since the last
        # reduction] in unused.py); unused in the other modes.
        self._find_unused = UnusedTracker(len(self.params),
                                          skip_unused_buckets=skip_unused_buckets)
        # Ring buffer of timestamped events (overlap statistics, timelines).
        self.trace = Trace()
        # Launching and ending the buckets' collectives (and the comm hook).
        self._launcher = Launcher(comm, self.trace, self._bucket_failed)
        # The installed buckets and each parameter's route into them.
        self._set = BucketSet(self.params, comm, view_mode=gradient_as_bucket_view)
        # The fast paths in force: rank 0's, set with every bucket assignment (see
        # [Note: the core and its fast paths]). Ranks may pass different bucket
        # caps; torch's DDP then follows rank 0's assignment, and so does this one.
        limits = caps.initial(find_unused=mode is _FIND_UNUSED and not static_graph)
        groups, self.fast, _ = rank0_plan(comm, self._sizes, self._keys, limits,
                                          list(range(len(self.params))), caps)
        groups.reverse()
        self._set.install(groups, self.fast)
        # What _get_ddp_logging_data reports about the construction-time buckets.
        self.initial_bucket_sizes = [b.nbytes for b in self.buckets]
        # Optional per-bucket callback run after a bucket is reduced (fused optimizer).
        self.post_reduce: Callable[[Bucket], None] | None = None
        # The text of the last error the reducer raised (DDP's logging data shows it).
        self.error: str | None = None
        # Futures to wait for at the end of this backward (buffer comm hooks).
        self._post_backward_futures: list[torch.futures.Future] = []
        # Division factor for the default path; Join may change it per iteration.
        self.divide_factor = comm.world_size
        # What each gradient is multiplied by on its way in (see the scale property),
        # kept up to date by set_divide_factor and set_comm_hook: read per gradient.
        self._scale = 1.0 / self.divide_factor
        # --- per-iteration state ---
        # Where this iteration is (see [Note: the iteration's states]).
        self.state = _IDLE
        # Whether each parameter was marked ready in this backward.
        self._ready = [False] * len(self.params)
        # The first hook of a backward marks unused parameters ready.
        self._first_hook_done = False
        # Buckets reduced in the last backward (torch's logging key num_buckets_reduced).
        self.num_buckets_reduced = 0
        # The in-flight all-reduce of a usage map (find_unused, or static_graph's
        # first iteration), waited for by the finalize.
        self._used_future: Any = None
        # Whether a second backward after one forward was reported (once).
        self._warned_second_backward = False
        # STATIC: hook firings each parameter still expects in this backward.
        self._static_remaining = [0] * len(self.params)
        # True while delay_all_reduce marks everything ready (it finalizes itself).
        self._delayed = False
        # Backward passes that ran with sync on (static_graph's iteration counter).
        self.num_backward = 0
        # Forwards that prepared a synchronised backward (set_static_graph's check, error keys).
        self.num_forward = 0
        # What records each arrival in the backward that records the order
        # (for the rebuild), else None.
        self._note_arrival: Callable[[int], None] | None = None
        # One gradient hook per parameter (see [Note: where the hooks sit]).
        # The hooks live in C++ autograd metadata, where Python's cycle
        # collector cannot see them: a strong reference to the reducer would
        # keep it, its buckets and their shared memory alive as long as the
        # model. Each is a partial of the static _on_grad with a weak
        # reference and the parameter's index.
        self._hooks = GradHooks(self.params, functools.partial(Reducer._on_grad, weakref.ref(self)))
        # A reducer dropped without remove_hooks() takes its hooks with it.
        weakref.finalize(self, GradHooks.remove_all, self._hooks)
        # Which packed slots are counted by builtins (see [Note: counted slots]
        # in buckets/packed.py).
        self._counting = Counting(self._hooks, self._set)
        # Whether a newer reducer took these parameters over (see [Note: owners]).
        self._superseded = False
        self._claim()

    # ------------------------------------------------------------ configuration
    @property
    def comm(self) -> GroupComm:
        """Collectives over the DDP process group."""
        return self._comm

    @comm.setter
    def comm(self, comm: GroupComm) -> None:
        # The launcher issues the buckets' collectives: it must use the same one.
        self._comm = comm
        self._launcher.use(comm)

    @property
    def static_graph(self) -> bool:
        return self.mode is GraphMode.STATIC

    def set_static_graph(self) -> None:
        """Switch to GraphMode.STATIC; only before the first forward."""
        if self.num_forward > 0:
            raise self._fail(errors.static_graph_too_late())
        self.mode = GraphMode.STATIC
        self._counting.stale()

    @property
    def comm_hook(self) -> CommHook | None:
        """The communication hook set with ``set_comm_hook``, or None."""
        return self._launcher.comm_hook

    @property
    def comm_hook_state(self) -> Any:
        return self._launcher.comm_hook_state

    def set_comm_hook(self, hook: CommHook, state: Any) -> None:
        """Let ``hook(state, bucket)`` reduce each bucket instead of the built-in all-reduce."""
        self._launcher.comm_hook, self._launcher.comm_hook_state = hook, state
        self._set.set_hooked()
        self._counting.stale()
        self._refresh_scale()

    def set_divide_factor(self, factor: int) -> None:
        """What the default path divides gradients by (Join may lower it)."""
        self.divide_factor = factor
        self._refresh_scale()

    @property
    def scale(self) -> float:
        """What each gradient is multiplied by on its way into its bucket: 1
        with a comm hook (the hook averages), else 1/divide_factor."""
        return self._scale

    def _refresh_scale(self) -> None:
        self._scale = 1.0 if self._launcher.comm_hook is not None else 1.0 / self.divide_factor

    def install_post_backward_futures(self, futures: Sequence[torch.futures.Future]) -> None:
        """Wait for ``futures`` at the end of the coming backward (torch's buffer hooks)."""
        self._post_backward_futures.extend(futures)

    _install_post_backward_futures = install_post_backward_futures  # torch's name

    def set_post_reduce(self, fn: Callable[[Bucket], None] | None) -> None:
        """Run ``fn(bucket)`` right after each bucket's result is written (fused optimizer)."""
        self.post_reduce = fn

    # ------------------------------------------------------------ what it knows
    @property
    def buckets(self) -> list[Bucket]:
        """The installed buckets, in launch order."""
        return self._set.buckets

    @property
    def order_is_final(self) -> bool:
        """Whether the bucket order is settled: rebuilt once, or never to be
        rebuilt (find_unused_parameters); see [Note: the rebuild]."""
        return self._rebuild.has_rebuilt or self.mode is GraphMode.FIND_UNUSED

    @property
    def in_static_first_iteration(self) -> bool:
        """static_graph, before its first backward ended (see [Note:
        static_graph's first iteration])."""
        return self.mode is GraphMode.STATIC and self.num_backward == 0

    @property
    def require_finalize(self) -> bool:
        """Whether a backward marked gradients ready and its finalize has not run."""
        return self.state is IterationState.REDUCING

    @property
    def has_rebuilt(self) -> bool:
        return self._rebuild.has_rebuilt

    @property
    def rebuilt_bucket_sizes(self) -> list[int]:
        return self._rebuild.bucket_sizes

    @property
    def rebuilt_param_indices(self) -> list[list[int]]:
        return self._rebuild.param_indices

    @property
    def caps(self) -> BucketCaps:
        """The caps in force, read from their one owner (see [Note: the cap's walk])."""
        return self._rebuild.caps

    @property
    def bucket_cap_bytes(self) -> int:
        """The cap in force: bucket_cap_mb in bytes, or what "auto" chose at the rebuild."""
        return self._rebuild.caps.cap

    @property
    def auto_cap(self) -> Any:
        """bucket_cap_mb="auto": the decision and its predictions (None before the rebuild)."""
        return self._rebuild.auto_cap

    def bucket_of(self, param_index: int) -> int:
        """The index of the bucket parameter ``param_index`` is in."""
        return self._set.bucket_of(param_index)

    def index_of(self, param: torch.Tensor) -> int | None:
        """``param``'s index among this reducer's parameters, or None if not one of them."""
        return self._index_of.get(id(param))

    def arrival_order(self) -> list[int]:
        """The gradient arrival order recorded so far for the rebuild."""
        return self._rebuild.order()

    def unused_in_last_forward(self) -> list[int]:
        """find_unused_parameters: the parameters the last forward did not reach."""
        return list(self._find_unused.unused)

    def grad_bytes_outside_buckets(self) -> int:
        """Bytes of gradient memory that is not bucket memory (every ``.grad``
        outside the buckets' buffers)."""
        return self._set.grad_bytes_outside()

    # ------------------------------------------------------------------ buckets
    def rebuild_if_needed(self) -> bool:
        """At the start of a forward: rebuild buckets in gradient-arrival order,
        once (see [Note: the rebuild]). True if the installed buckets changed."""
        rebuild = self._rebuild
        if self.order_is_final or not rebuild.complete():
            return False
        order = rebuild.order()
        caps = rebuild.caps_to_assign(self.comm, self.names, self._sizes, self._keys)
        # Every rank must bucket identically: rank 0's plan wins, in one broadcast.
        with profiled(self._launcher.broadcast_event):  # torch broadcasts here too
            groups, self.fast, rank0_caps = rank0_plan(
                self.comm, self._sizes, self._keys, caps.rebuild(), order, caps)
        self._set.install(groups, self.fast)
        self._counting.stale()
        rebuild.done(groups, self._sizes, rank0_caps)
        return True

    # ---------------------------------------------------------------- ownership
    def _claim(self, *, again: bool = False) -> None:
        """Become the owner of this reducer's parameters (see [Note: owners]).
        ``again``: an older reducer takes them back, so two act on them."""
        self._superseded = False
        OWNERS.claim(self, self.params, again=again)

    @property
    def superseded(self) -> bool:
        """Whether a newer reducer took these parameters over (see [Note: owners])."""
        return self._superseded

    def share(self) -> None:
        """Another reducer reduces these gradients too: copy them, never keep
        them in place in .grad (homed)."""
        self._set.share()
        self._counting.stale()

    def step_aside(self) -> None:
        """A newer reducer owns the parameters now: this one's hooks go quiet
        (it forgets a half-done backward) until its own next forward."""
        self._superseded = True
        self._end_iteration(finalized=False)
        self._launcher.drain(self.buckets)
        self._set.reset()

    # ---------------------------------------------------------------- iteration
    def _end_iteration(self, *, finalized: bool) -> None:
        """Every way out of an iteration (see [Note: the iteration's states]):
        the finalize ran (FINALIZED), or the iteration is abandoned (IDLE)."""
        self.state = _FINALIZED if finalized else _IDLE

    def note_unsynced_forward(self) -> None:
        """A forward under no_sync() or no_grad: its backward (if any) only accumulates."""
        if self.state is _FINALIZED:
            self.state = _IDLE

    def check_prior_finished(self) -> None:
        """Any forward with grad enabled, under no_sync() too: the previous
        synchronised backward must have finished its reduction (torch checks
        this in every such forward)."""
        if self.state is _REDUCING or (self.state is _EXPECTING
                                       and self._counting.pending_arrivals()):
            self._raise_unfinished()
        # A backward after this forward is not "a second backward after one
        # forward", even when it runs before prepare_for_backward (Lightning's
        # manual optimization under no_sync): its hooks are then ignored.
        if self.state is _FINALIZED:
            self.state = _IDLE

    def prepare_for_forward(self) -> None:
        """Called by a forward that will be followed by a synchronised backward."""
        self.check_prior_finished()
        if self._superseded:
            self._claim(again=True)  # an old wrapper trains again: its hooks count again
        self.num_forward += 1
        self._rebuild.stamp_forward()

    def prepare_for_backward(self, outputs: Sequence[torch.Tensor] | None) -> None:
        """Reset per-iteration state after a forward; find unused parameters if asked."""
        if self.state is not _REDUCING:  # a reduction still owed stays owed
            self.state = _EXPECTING
        self._rebuild.stamp_backward()
        self._ready = [False] * len(self.params)
        self._first_hook_done = False
        # static_graph's first backward marks everything ready at once, in index
        # order; the real arrival order is only seen in the second backward.
        recording = not (self.order_is_final or self.in_static_first_iteration)
        self._note_arrival = self._rebuild.recorder() if recording else None
        self._set.reset()
        self._hooks.follow()
        if self.order_is_final or self.num_backward >= 2:
            self._hooks.settle()  # see [Note: where the hooks sit]
        self._counting.plan(self.mode is GraphMode.DEFAULT and self._rebuild.has_rebuilt
                            and not self._hooks.provisional)
        skipped: frozenset[int] = frozenset()
        if self.mode is GraphMode.STATIC:
            self._static_remaining = self._static.begin_backward()
        elif self.mode is GraphMode.FIND_UNUSED:
            skipped = self._find_unused.begin_backward(
                outputs, self._index_of, [b.param_indices for b in self.buckets])
        self._launcher.begin(skipped=skipped)
        self.num_buckets_reduced = 0

    @staticmethod
    def _on_grad(ref: weakref.ref, i: int, *_args: Any) -> None:
        """Parameter ``i``'s gradient hook, after its gradient is accumulated
        (see [Note: the per-gradient path]); what autograd passes is unused."""
        reducer = ref()
        if reducer is None:
            return
        state = reducer.state
        if state is not _REDUCING and state is not _EXPECTING:
            if reducer.mode is _FIND_UNUSED and reducer.params[i].grad is not None:
                # no_sync: the gradient stays local, but the parameter counts as
                # used at the next reduction (see [Note: used since the last
                # reduction] in unused.py).
                reducer._find_unused.local_used[i] = 1
            if reducer._counting.on:  # what no_sync counted is not to be reduced
                reducer._set.routes[i][0].forget_counted()
            if state is _FINALIZED:
                # As torch: this backward only accumulates locally. Unlike
                # torch, say so once (docs/ddp-differences.md), as gradring's
                # own notice (no warning filter makes it an exception).
                reducer.state = _IDLE
                if not reducer._warned_second_backward:
                    reducer._warned_second_backward = True
                    notice(errors.backward_twice())
            return  # no_sync, or a backward not preceded by a DDP forward
        mode = reducer.mode
        if mode is _STATIC:
            if reducer.num_backward == 0:  # in_static_first_iteration, without the property
                reducer._static.count(i)  # iteration 1: count only, reduce at the end
                return
            remaining = reducer._static_remaining
            left = remaining[i] - 1
            remaining[i] = left
            if left > 0:
                return
            if left < 0:
                # More gradients than in iteration 1 (none there, or a second
                # backward over part of the graph): torch's error. As in torch, the
                # reduction stays owed: the next forward raises "Expected to have
                # finished reduction", naming what never arrived.
                reducer.state = _REDUCING
                raise reducer._fail(errors.static_graph_newly_used(
                    i, reducer.names[i], first_count=reducer._static.first_count(i),
                    find_unused=reducer.find_unused_asked))
        if not reducer._first_hook_done:
            reducer._first_hook_done = True
            reducer.trace.mark("backward_start")
            if reducer._counting.on and not in_compiled_autograd():
                queue_engine_callback(reducer._end_counted)
            for j in reducer._unused_for_iteration():
                reducer._mark_ready(j)
        if mode is _FIND_UNUSED and reducer.params[i].grad is not None:
            # A hook can fire with no gradient (its output was not used in the
            # loss); such a parameter is not "used" and its .grad stays put.
            reducer._find_unused.local_used[i] = 1
        reducer._mark_ready(i)

    def _unused_for_iteration(self) -> list[int]:
        if self.mode is GraphMode.STATIC:
            return self._static.unused()
        return self._find_unused.unused if self.mode is GraphMode.FIND_UNUSED else []

    # [Note: the per-gradient path]
    # _on_grad and _mark_ready run once per parameter per backward, so they do
    # no more than they must: the hook is a partial of _on_grad (one Python
    # frame), the iteration's state is one attribute compared by identity, the
    # bucket, slot and put function come from one precomputed route (rebuilt
    # whenever slot kinds are decided), the bucket counts the gradient in with
    # one call (Bucket.arrive), what records the arrival order (a list's own
    # append, unless bucket_cap_mb="auto" stamps too) is decided once per
    # backward, grad mode is switched off only when it is on (it is off inside
    # an ordinary backward; on under create_graph), the scale is multiplied as
    # a cached 0-dim tensor (see packing.scale_tensor), and tracing marks
    # buckets, never parameters. A deferred slot (PACKED) has
    # no put function: its hook only counts, and its path's on_full does the
    # tensor work for the whole bucket once its last gradient has arrived;
    # once the order is final most such hooks are not this function at all
    # ([Note: counted slots] in buckets/packed.py).
    def _mark_ready(self, i: int) -> None:
        ready = self._ready
        if ready[i]:
            raise self._fail(errors.marked_twice(i, self.names[i],
                                                 static_graph=self.mode is _STATIC,
                                                 find_unused=self.find_unused_asked))
        ready[i] = True
        self.state = _REDUCING
        bucket, s, put = self._set.routes[i]
        full = bucket.arrive()
        if put is not None:
            grad_mode = torch.is_grad_enabled()
            if grad_mode:
                torch._C._set_grad_enabled(False)
            try:
                put(bucket, s, self._scale)
            finally:
                if grad_mode:
                    torch._C._set_grad_enabled(True)
        note = self._note_arrival
        if note is not None:
            note(i)
        if full:
            self._complete(bucket)
            self._launch_ready()
        elif bucket.n_counted and bucket.pending == 0:
            self._counting.missed(bucket)

    def _complete(self, bucket: Bucket) -> None:
        """Every gradient of ``bucket`` is in: the fast paths' bucket-wide puts, then READY."""
        for on_full in bucket.on_full:
            on_full(bucket, self._scale)
        bucket.mark_ready()
        self.trace.mark("ready", bucket.index)

    def _end_counted(self) -> None:
        """At the end of a backward with counted slots (see [Note: counted
        slots] in buckets/packed.py): a slot heard twice is torch's error; buckets
        whose last slot fired before their counted ones launch now."""
        if self.state is not _REDUCING:
            return  # finalized already, or abandoned
        twice = self._counting.heard_twice(self._index_of)
        if twice is not None:
            raise self._fail(errors.marked_twice(twice, self.names[twice]))
        if self._launcher.next_bucket < len(self.buckets):
            self._launch_ready()

    def _launch_ready(self) -> None:
        buckets = self.buckets
        launcher = self._launcher
        if self._counting.on:
            self._counting.catch_up(launcher.next_bucket, self._complete)
        self.num_buckets_reduced += len(launcher.launch_ready(buckets, self.scale))
        if launcher.next_bucket == len(buckets):
            if self.mode is GraphMode.FIND_UNUSED:
                self._used_future = self._find_unused.send(self.comm)
            if not self._delayed:
                queue_engine_callback(self._finalize)

    # ----------------------------------------------------------------- finalize
    def _finalize(self) -> None:
        self.trace.mark("backward_end")
        if self._note_arrival is not None:  # this backward recorded the order
            self._rebuild.stamp_end()
        used: list[int] | None = self._static.used()
        if self._used_future is not None:
            # Launched after every bucket, so waiting here waits for all of them.
            used_t = self._used_future.wait()
            used_t = used_t[0] if isinstance(used_t, (list, tuple)) else used_t
            if self.mode is GraphMode.FIND_UNUSED:
                self._find_unused.global_used = used_t
            used = used_t.tolist()
            self._used_future = None
            if self.mode is GraphMode.STATIC and len(used) == 2 * len(self.params):
                used = self._static.keep_used(used)
        launcher = self._launcher
        try:
            with torch.no_grad():
                for bucket in self.buckets:
                    # Bucket by bucket: the later ones may still be in flight meanwhile.
                    with profiled(f"gradring::bucket_wait#{bucket.index}"):
                        value = launcher.result(bucket)
                    with profiled(f"gradring::bucket_write_grads#{bucket.index}"):
                        if value is not bucket.buffer:
                            bucket.buffer.copy_(value.reshape(-1))
                        write_grads(bucket, used)
                        bucket.complete()  # no refs to old grads
                    if self.post_reduce is not None:
                        self.post_reduce(bucket)
                    self.trace.mark("written", bucket.index)
            futures, self._post_backward_futures = self._post_backward_futures, []
            for fut in futures:
                fut.wait()
        finally:
            launcher.close_events()
            self.trace.iteration += 1
            self._end_iteration(finalized=True)
            self.num_backward += 1

    # ------------------------------------------------------------- static_graph
    def delay_all_reduce(self) -> None:
        """static_graph, iteration 1: everything was counted; now reduce all
        buckets at once (see [Note: static_graph's first iteration])."""
        used = self._static.first_iteration_maps(self.params)
        self._delayed = True
        try:
            for i in range(len(self.params)):
                self._mark_ready(i)
        finally:
            self._delayed = False
        # Learn once which parameters no rank uses; their .grad is never written.
        self._used_future = self.comm.all_reduce(used, label="DDP unused-parameter map")
        self._finalize()

    def on_boundary_backward(self) -> None:
        """The output boundary's backward ran: in static_graph's first
        iteration, queue the delayed all-reduce for the end of this backward."""
        if self.in_static_first_iteration and self._static.queue_delay_once():
            queue_engine_callback(self.delay_all_reduce, needs_backward_end=True)

    # --------------------------------------------------------------------- Join
    def shadow_backward(self) -> None:
        """Join: issue this backward's collectives with zero gradients (see [Note: shadowing])."""
        kept = []
        launcher = self._launcher
        for bucket in self.buckets:
            # The zeros and the peers' sums are not this rank's gradients: where
            # .grad lives in the bucket (view mode), it is put back after.
            kept.append(bucket.buffer.clone() if self.grad_as_view else None)
            bucket.buffer.zero_()
            bucket.launch(launcher.reduce(bucket, self.scale,
                                          is_last=bucket.index == len(self.buckets) - 1))
        for bucket, saved in zip(self.buckets, kept):
            bucket.future.wait()
            if saved is not None:
                bucket.buffer.copy_(saved)
            bucket.reset()
        launcher.close_events()
        if self.mode is GraphMode.FIND_UNUSED:
            self._find_unused.shadow(self.comm)
        if not (self.order_is_final or self.in_static_first_iteration):
            self._rebuild.stand_in()  # rebuild in step with the others
        self.num_backward += 1

    # -------------------------------------------------------------------- errors
    def _bucket_failed(self, bucket: Bucket, exc: Exception) -> RuntimeError:
        """The error for a failed bucket collective, naming the bucket and its parameters."""
        self._end_iteration(finalized=False)
        where = errors.bucket_context(bucket.index, bucket.nbytes, bucket.param_indices,
                                      self.names, self.num_backward + 1)
        return self._fail(f"{exc}\n{where}")

    def _raise_unfinished(self) -> None:
        twice = self._counting.heard_twice(self._index_of)
        if twice is not None:  # a counted slot heard twice kept its bucket from filling
            self._launcher.drain(self.buckets)
            self._end_iteration(finalized=False)
            raise self._fail(errors.marked_twice(twice, self.names[twice]))
        counted = self._counting.arrived(self._index_of)
        missing = [i for i, r in enumerate(self._ready) if not r and i not in counted]
        per_rank = {self.comm.rank: missing}
        per_rank.update(self._peer_missing(missing))
        self._launcher.drain(self.buckets)
        self._end_iteration(finalized=False)
        raise self._fail(
            errors.unfinished_reduction(per_rank, self.names, static_graph=self.static_graph,
                                        find_unused=self.find_unused_asked,
                                        world_size=self.comm.world_size, rank=self.comm.rank,
                                        debug=_debug_on())
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
        return self.comm.exchange_lists(f"unused/{self._serial}/{self.num_forward}", missing)

    # torch's Reducer names, called on ``ddp.reducer`` by Lightning's manual
    # optimization (a backward that runs inside the wrapped module's forward).
    def _rebuild_buckets(self) -> bool:
        """torch's ``_rebuild_buckets``: check the prior reduction finished, then
        rebuild the buckets if this is the time; True if they were rebuilt."""
        self.check_prior_finished()
        return self.rebuild_if_needed()

    def _get_local_used_map(self) -> torch.Tensor:
        """torch's name: after a find_unused_parameters backward, how many ranks
        used each parameter since the map was last sent (int32, one per parameter)."""
        return self._find_unused.local_used_map()

    def _ddp_graph_static(self) -> bool:
        """torch's name: whether the set of parameters the forward left unused
        has been the same in every iteration so far (always, without
        find_unused_parameters)."""
        return self._find_unused.graph_static

    def _run_allreduce_hook(self, bucket: Any) -> torch.futures.Future:
        """torch's name, called by its mixed-precision and optimizer-in-backward
        comm hooks: sum ``bucket.buffer()`` over the group in place (not
        divided: the caller divides); the future resolves to that buffer."""
        buf = bucket.buffer()
        fut = self.comm.all_reduce(buf, label=f"DDP bucket {bucket.index()}")
        return fut.then(lambda f: f.value()[0])

    def _delay_all_reduce(self) -> None:
        """torch's ``_delay_all_reduce``: static_graph's first iteration, reduce all now."""
        self.delay_all_reduce()

    def remove_hooks(self) -> None:
        self._hooks.remove_all()


def _debug_on() -> bool:
    """Whether TORCH_DISTRIBUTED_DEBUG is INFO or DETAIL (torch's errors say more then)."""
    dist = torch.distributed
    return dist.is_available() and dist.get_debug_level() != dist.DebugLevel.OFF
