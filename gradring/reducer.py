"""The Reducer: per-iteration state machine that averages gradients across ranks.

[Note: one backward, as the reducer sees it]
1. ``prepare_for_backward`` (after forward) resets pending counts and, in
   ``GraphMode.FIND_UNUSED``, records which parameters the forward never
   reached (``graph.py``).
2. Each parameter's post-accumulate-grad hook calls ``_on_grad``, and the
   bucket's pending count drops. Where the gradient goes is what its slot's
   kind says (decided once per bucket, see [Note: slot kinds] in
   ``buckets.py``; the puts are in ``slot_io.py``), scaled by 1/world_size:
   left in ``.grad`` with only the part the peers read copied into the
   bucket (HOMED), copied into the slot with ``.grad`` pointed at it (LENT),
   plainly copied (COPIED), or copied a bucket's small slots at a time
   (PACKED, [Note: packed slots] in ``packing.py``). COPIED slots and large
   HOMED and LENT ones are put in by the hook itself; the others are
   deferred: when the bucket's last gradient arrives, they are put in
   together ([Note: held slots] in ``buckets.py``). The first hook of a
   backward also marks the unused parameters ready (their slots are zeroed).
3. A bucket whose count reaches 0 is READY. Buckets launch strictly in index
   order: a ready bucket waits until every lower bucket has launched, then all
   ready ones go together. Launching is asynchronous, so bucket k's collective
   overlaps the backward of earlier layers -- where a core is free for it;
   otherwise every bucket is left to the finalize, as the last one is (see
   [Note: overlap needs a free core] in ``overlap_policy.py``). Each launch is labelled
   ``DDP bucket <k>`` for errors, desync checks and the flight recorder.
4. When the last bucket launches, a callback is queued on the autograd engine.
   (On the default path the last bucket is reduced by that callback itself,
   see [Note: the last bucket].)
   At the end of the backward it waits for every future bucket by bucket and
   writes the results where ``.grad`` needs them (nothing to write for HOMED,
   LENT and VIEW slots; one batched copy for a bucket's PACKED slots). When
   ``loss.backward()`` returns, gradients are reduced.
If a backward ends with a bucket that never became ready (an unused parameter
without find_unused_parameters), the callback is never queued, the reduction
stays unfinished, and the next forward raises, naming the parameters.
"""

from __future__ import annotations

import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from gradring import errors
from gradring.buckets import (
    Bucket,
    BucketCaps,
    BucketState,
    SlotKind,
    assign_buckets,
    bucket_key,
)
from gradring.grad_bucket import GradBucket
from gradring.graph import GraphMode, reachable_params
from gradring.group_comm import GroupComm
from gradring.observe.trace import Trace, profiled
from gradring.reducer_offpath import ReducerOffPath, _queue_engine_callback
from gradring.slot_io import SlotIO

CommHook = Callable[[Any, GradBucket], torch.futures.Future]


class Reducer(ReducerOffPath, SlotIO):
    """Owns the buckets and drives their reduction during backward."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str],
        comm: GroupComm,
        *,
        caps: BucketCaps,
        initial_caps: Sequence[int],
        mode: GraphMode,
        gradient_as_bucket_view: bool,
        auto_cap: bool = False,
    ) -> None:
        # Parameters that require grad, in the module's definition order.
        self.params = list(params)
        # Their qualified names, for errors that name names.
        self.names = list(names)
        # id(param) -> index, for the graph walk.
        self._index_of = {id(p): i for i, p in enumerate(self.params)}
        # Collectives over the DDP process group.
        self.comm = comm
        # The caps the constructor arguments imply (see BucketCaps).
        self.caps = caps
        # The cap in force: bucket_cap_mb in bytes, or what "auto" chose at the rebuild.
        self.bucket_cap_bytes = caps.cap
        # How parameters' participation is learnt (see GraphMode); the one
        # place static_graph is stored.
        self.mode = mode
        self.grad_as_view = gradient_as_bucket_view
        # Optional communication hook and its state (set_comm_hook).
        self.comm_hook: CommHook | None = None
        self.comm_hook_state: Any = None
        # Sizes in bytes and (dtype, device) keys, fixed for the module's life.
        self._sizes = [p.numel() * p.element_size() for p in self.params]
        self._keys = [bucket_key(p) for p in self.params]
        # Ranks may pass different bucket caps; torch's DDP then follows rank
        # 0's assignment, and so does this one. It also sets self.overlap and
        # self.overlap_why: whether ready buckets launch at once or wait for the
        # end of the backward, and why (rank 0's choice, see [Note: overlap
        # needs a free core] in overlap_policy.py).
        groups = self._rank0_groups(assign_buckets(self._sizes, initial_caps, keys=self._keys),
                                    list(range(len(self.params))))
        groups.reverse()
        self.buckets: list[Bucket] = []
        # Per lent parameter, the private gradient it last gave up (see [Note: lent
        # gradients]), freed only when the next one replaces it. Freeing each in
        # the middle of backward let glibc hand heap pages back to the kernel and
        # fault them in again: 2-4 thousand page faults per step were measured.
        # Memory stays what torch's non-view mode uses (one .grad-sized tensor
        # plus the bucket per parameter).
        self._recycled: dict[int, torch.Tensor] = {}
        # param index -> (bucket index, slot index)
        self._locator: list[tuple[int, int]] = []
        # Per slot kind, how a gradient goes in when its hook runs (see [Note:
        # slot kinds]); deferred kinds (None) are put in when the bucket is ready.
        self._put_in = {SlotKind.VIEW: None, SlotKind.PACKED: None,
                        SlotKind.LENT: self._put_lent, SlotKind.HOMED: self._put_homed,
                        SlotKind.COPIED: self._put_copied}
        # param index -> (its bucket, its slot, the _put_* method of the slot's
        # kind or None), looked up once per gradient (see [Note: the per-gradient path]).
        self._route: list[tuple[Bucket, int, Callable[..., None] | None]] = []
        # True once another live reducer acts on these parameters too (nested
        # DDP): both then copy gradients, never keep or lend .grad.
        self._shared = False
        self._install(groups)
        # What _get_ddp_logging_data reports about the construction-time buckets.
        self.initial_bucket_sizes = [b.nbytes for b in self.buckets]
        self.rebuilt_bucket_sizes: list[int] = []
        self.rebuilt_param_indices: list[list[int]] = []
        self.has_rebuilt = False
        # Order in which gradients arrived, recorded once for the rebuild.
        self._arrival: list[int] = []
        # bucket_cap_mb="auto": timings of the recorded backward, then the decision
        # (see [Note: automatic bucket cap] in autocap.py).
        self.auto_stamps: Any = None
        self.auto_cap: Any = None
        if auto_cap:
            from gradring import autocap  # only for bucket_cap_mb="auto"

            self.auto_stamps = autocap.Stamps(len(self.params))
        # Optional per-bucket callback run after a bucket is reduced (fused optimizer).
        self.post_reduce: Callable[[Bucket], None] | None = None
        # The text of the last error the reducer raised (DDP's logging data shows it).
        self.error: str | None = None
        # Futures to wait for at the end of this backward (buffer comm hooks).
        self._post_backward_futures: list[torch.futures.Future] = []
        # Ring buffer of timestamped events (overlap statistics, timelines).
        self.trace = Trace()
        # Division factor for the default path; Join may change it per iteration.
        self.divide_factor = comm.world_size
        # --- per-iteration state ---
        # Hooks count only between prepare_for_backward and finalize.
        self.expect_hooks = False
        # True once a backward marked anything ready and until finalize ran.
        self.require_finalize = False
        # True between finalize and the next forward: a new backward is a user error.
        self._finalized_since_forward = False
        # Whether each parameter was marked ready in this backward.
        self._ready = [False] * len(self.params)
        # Next bucket index to launch.
        self._next_bucket = 0
        # The first hook of a backward marks unused parameters ready.
        self._first_hook_done = False
        # FIND_UNUSED: parameters the forward did not reach.
        self._unused: list[int] = []
        # FIND_UNUSED: 1 where this rank produced a gradient (a bytearray: setting
        # an item of a tensor in every hook cost microseconds).
        self._local_used = bytearray(len(self.params))
        self._used_future: Any = None
        self._warned_nothing_unused = False
        # Whether a second backward after one forward was reported (once).
        self._warned_second_backward = False
        # STATIC: hook firings per parameter counted in iteration 1.
        self._static_counts = [0] * len(self.params)
        self._static_remaining = [0] * len(self.params)
        self._static_unused: list[int] = []
        # STATIC: 0 for parameters no rank used in iteration 1 (their .grad stays put).
        self._static_used: list[int] | None = None
        # True while delay_all_reduce marks everything ready (it finalizes itself).
        self._delayed = False
        # STATIC: the delayed all-reduce is queued once per first backward.
        self._delay_queued = False
        # Backward passes that ran with sync on (static_graph's iteration counter).
        self.num_backward = 0
        self.num_forward = 0
        # Whether this backward records the gradients' arrival order (for the rebuild).
        self._record_arrival = False
        self._hook_handles = [
            p.register_post_accumulate_grad_hook(self._make_hook(i))
            for i, p in enumerate(self.params)
        ]
        # A reducer dropped without remove_hooks() takes its hooks with it.
        weakref.finalize(self, _remove_handles, self._hook_handles)
        # Whether a newer reducer took these parameters over (see [Note: owners]).
        self._superseded = False
        self._claim()

    # ------------------------------------------------------------ configuration
    @property
    def static_graph(self) -> bool:
        return self.mode is GraphMode.STATIC

    def set_static_graph(self) -> None:
        """Switch to GraphMode.STATIC; only before the first forward."""
        if self.num_forward > 0:
            raise self._fail(errors.static_graph_too_late())
        self.mode = GraphMode.STATIC

    def set_comm_hook(self, hook: CommHook, state: Any) -> None:
        """Let ``hook(state, bucket)`` reduce each bucket instead of the built-in all-reduce."""
        self.comm_hook, self.comm_hook_state = hook, state
        for bucket in self.buckets:
            bucket.decide_kinds(view_mode=self.grad_as_view, hooked=True)
        self._build_routes()

    def set_divide_factor(self, factor: int) -> None:
        """What the default path divides gradients by (Join may lower it)."""
        self.divide_factor = factor

    def install_post_backward_futures(self, futures: Sequence[torch.futures.Future]) -> None:
        """Wait for ``futures`` at the end of the coming backward (torch's buffer hooks)."""
        self._post_backward_futures.extend(futures)

    _install_post_backward_futures = install_post_backward_futures  # torch's name

    def set_post_reduce(self, fn: Callable[[Bucket], None] | None) -> None:
        """Run ``fn(bucket)`` right after each bucket's result is written (fused optimizer)."""
        self.post_reduce = fn

    # ------------------------------------------------------------------ buckets
    def _install(self, groups: list[list[int]]) -> None:
        comm = self.comm
        hooked = self.comm_hook is not None
        buckets = []
        locator: list[tuple[int, int]] = [(0, 0)] * len(self.params)
        for bi, idxs in enumerate(groups):
            bucket = Bucket(bi, idxs, [self.params[i] for i in idxs], comm.empty)
            homable = (comm.world_size > 1 and not self.grad_as_view and not self._shared
                       and bucket.buffer.dtype.is_floating_point
                       and bucket.buffer.device.type == "cpu")
            bucket.place(comm.own_range(bucket.buffer.numel()), homable=homable,
                         view_mode=self.grad_as_view, hooked=hooked)
            for slot, i in enumerate(idxs):
                locator[i] = (bi, slot)
            buckets.append(bucket)
        self.buckets, self._locator = buckets, locator
        self._build_routes()
        self._recycled.clear()
        if self.grad_as_view:
            # Keep accumulated values (e.g. from no_sync) and point .grad at the
            # new views; a sparse .grad is never a view (as in torch's DDP).
            with torch.no_grad():
                for i, p in enumerate(self.params):
                    if p.grad is not None and p.grad.layout is torch.strided:
                        b, s = locator[i]
                        view = buckets[b].views[s]
                        view.copy_(p.grad)
                        p.grad = view
        self._next_bucket = 0

    def _build_routes(self) -> None:
        """Each parameter's bucket, slot and put method, from the stored slot kinds
        (none for a held slot, see [Note: held slots] in buckets.py)."""
        route = []
        held = {(b.index, s) for b in self.buckets for s in b.held}
        for b, s in self._locator:
            bucket = self.buckets[b]
            put = None if (b, s) in held else self._put_in[bucket.kinds[s]]
            route.append((bucket, s, put))
        self._route = route

    def _recording_arrival(self) -> bool:
        if self.has_rebuilt or self.mode is GraphMode.FIND_UNUSED:
            return False
        # static_graph's first backward marks everything ready at once, in index
        # order; the real arrival order is only seen in the second backward.
        return not (self.mode is GraphMode.STATIC and self.num_backward == 0)

    # ---------------------------------------------------------------- iteration
    def note_unsynced_forward(self) -> None:
        """A forward under no_sync() or no_grad: its backward (if any) only accumulates."""
        self._finalized_since_forward = False

    def prepare_for_forward(self) -> None:
        """Called by a forward that will be followed by a synchronised backward."""
        self.check_prior_finished()
        if self._superseded:
            self._claim(again=True)  # an old wrapper trains again: its hooks count again
        self.num_forward += 1
        if self.auto_stamps is not None and not self._arrival:
            self.auto_stamps.t_forward = time.perf_counter()  # the backward to record is next

    def prepare_for_backward(self, outputs: Sequence[torch.Tensor] | None) -> None:
        """Reset per-iteration state after a forward; find unused parameters if asked."""
        self.expect_hooks = True
        self._finalized_since_forward = False
        if self.auto_stamps is not None and not self._arrival:
            self.auto_stamps.t_backward = time.perf_counter()
        self._ready = [False] * len(self.params)
        self._first_hook_done = False
        self._delay_queued = False
        self._record_arrival = self._recording_arrival()
        self._next_bucket = 0
        for b in self.buckets:
            b.reset()
        if not self.overlap and not self.comm.on_shared_memory():
            # Shared memory was given up since (every rank at once): overlap again.
            self.overlap, self.overlap_why = True, "shared memory was given up"
        if self.mode is GraphMode.STATIC:
            self._static_remaining = list(self._static_counts)
        elif self.mode is GraphMode.FIND_UNUSED:
            self._local_used = bytearray(len(self.params))
            reached = reachable_params(outputs or [], self._index_of)
            self._unused = [i for i in range(len(self.params)) if i not in reached]
            if not self._unused and not self._warned_nothing_unused:
                self._warned_nothing_unused = True
                warnings.warn(errors.nothing_unused(), stacklevel=3)

    def _make_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        # The hook lives in the parameter's C++ autograd metadata, where Python's
        # cycle collector cannot see it: a strong reference to the reducer would
        # keep it, its buckets and their shared memory alive as long as the model.
        ref = weakref.ref(self)

        def hook(_param: torch.Tensor) -> None:
            reducer = ref()
            if reducer is not None:
                reducer._on_grad(index)
        return hook

    def _on_grad(self, i: int) -> None:
        if not self.expect_hooks:
            if self._finalized_since_forward:
                # As torch: this backward only accumulates locally. Unlike
                # torch, say so once (docs/ddp-differences.md).
                self._finalized_since_forward = False
                if not self._warned_second_backward:
                    self._warned_second_backward = True
                    warnings.warn(errors.backward_twice(), RuntimeWarning, stacklevel=2)
            return  # no_sync, or a backward not preceded by a DDP forward
        mode = self.mode
        if mode is GraphMode.STATIC:
            if self.num_backward == 0:
                self._static_counts[i] += 1  # iteration 1: count only, reduce at the end
                return
            if self._static_counts[i] == 0:
                raise self._fail(errors.static_graph_newly_used(i, self.names[i]))
            self._static_remaining[i] -= 1
            if self._static_remaining[i] > 0:
                return
        if not self._first_hook_done:
            self._first_hook_done = True
            self.trace.mark("backward_start")
            for j in self._unused_for_iteration():
                self._mark_ready(j)
        if mode is GraphMode.FIND_UNUSED and self.params[i].grad is not None:
            # A hook can fire with no gradient (its output was not used in the
            # loss); such a parameter is not "used" and its .grad stays put.
            self._local_used[i] = 1
        self._mark_ready(i)

    def _unused_for_iteration(self) -> list[int]:
        if self.mode is GraphMode.STATIC:
            return self._static_unused
        return self._unused if self.mode is GraphMode.FIND_UNUSED else []

    # [Note: the per-gradient path]
    # _mark_ready runs once per parameter per backward, so it does no more than
    # it must: the bucket, slot and put method come from one precomputed route
    # (rebuilt whenever slot kinds are decided), the arrival flag is decided
    # once per backward, grad mode is switched off only when it is on (it is
    # off inside an ordinary backward; on under create_graph), the scale is
    # multiplied as a cached 0-dim tensor (see packing.scale_tensor), and
    # tracing marks buckets, never parameters. A deferred slot (VIEW, PACKED,
    # or a held HOMED or LENT one) has no put method: its hook only counts, and
    # _put_deferred does the tensor work for the whole bucket once its last
    # gradient has arrived.
    def _mark_ready(self, i: int) -> None:
        ready = self._ready
        if ready[i]:
            raise self._fail(errors.marked_twice(i, self.names[i]))
        ready[i] = True
        self.require_finalize = True
        bucket, s, put = self._route[i]
        if bucket.pending == bucket.size:
            bucket.lending.claim()  # the backward's first write into this bucket
        if put is not None:
            scale = 1.0 if self.comm_hook is not None else 1.0 / self.divide_factor
            grad_mode = torch.is_grad_enabled()
            if grad_mode:
                torch._C._set_grad_enabled(False)
            try:
                if self.params[i].grad is None:
                    bucket.views[s].zero_()
                    bucket.to_write.append(s)
                else:
                    # No local reference to the gradient here: lending counts them.
                    put(bucket, s, i, scale)
            finally:
                if grad_mode:
                    torch._C._set_grad_enabled(True)
        if self._record_arrival:
            self._arrival.append(i)
            if self.auto_stamps is not None:
                self.auto_stamps.mark(i)
        bucket.pending -= 1
        if bucket.pending == 0:
            if bucket.deferred:
                self._put_deferred(bucket, i)
            bucket.state = BucketState.READY
            self.trace.mark("ready", bucket.index)
            self._launch_ready()

    def _finalize_may_reduce(self) -> bool:
        """Whether the finalize may reduce buckets itself (see [Note: the last bucket]):
        not with a comm hook, a fused optimizer (post_reduce) or find_unused's map."""
        return self.comm_hook is None and self.post_reduce is None \
            and self.mode is not GraphMode.FIND_UNUSED

    @property
    def launches_when_ready(self) -> bool:
        """Whether this backward's buckets (all but the last) launch as they become
        ready, rather than all at the end of the backward (see _launch_ready)."""
        return self.overlap or not self._finalize_may_reduce()

    def _launch_ready(self) -> None:
        buckets = self.buckets
        last = len(buckets) - 1
        while self._next_bucket <= last and \
                buckets[self._next_bucket].state is BucketState.READY:
            bucket = buckets[self._next_bucket]
            # The last bucket, or every bucket without a free core for the comm thread.
            if (self._next_bucket == last or not self.overlap) and self._finalize_may_reduce():
                bucket.state = BucketState.LAUNCHED
                bucket.inline = True  # the finalize reduces it (see [Note: the last bucket])
            else:
                self._launch(bucket)
            self._next_bucket += 1
        if self._next_bucket == len(buckets):
            if self.mode is GraphMode.FIND_UNUSED:
                used = torch.frombuffer(self._local_used, dtype=torch.uint8)
                self._used_future = self.comm.all_reduce(used.to(torch.int32),
                                                         label="DDP unused-parameter map")
            if not self._delayed:
                _queue_engine_callback(self._finalize)

    def _launch(self, bucket: Bucket) -> None:
        bucket.state = BucketState.LAUNCHED
        index, trace = bucket.index, self.trace
        trace.mark("launch", index)
        label = f"DDP bucket {index}"
        it = trace.iteration  # the callback may run after finalize moved on
        on_done = lambda _f: trace.mark("comm_done", index, it)  # noqa: E731
        with profiled(f"gradring::bucket_all_reduce#{index}"):
            if bucket.homes:
                bucket.future = self.comm.all_reduce_homed(
                    bucket.buffer, sorted(bucket.homes, key=_offset), 1.0 / self.divide_factor,
                    label=label, on_done=on_done)
            elif self.comm_hook is None:
                bucket.future = self.comm.all_reduce(bucket.buffer, label=label, on_done=on_done)
            else:
                gb = GradBucket(bucket, is_last=index == len(self.buckets) - 1)
                with self.comm.labelled(label):
                    bucket.future = self.comm_hook(self.comm_hook_state, gb)
                bucket.future.add_done_callback(on_done)

    # [Note: the last bucket]
    # The last bucket becomes ready with the backward's last gradient, and the
    # finalize, queued for the very end of the backward, waits for it at once:
    # nothing is left to overlap it with. Handing it to the comm thread only
    # added two thread wake-ups to the critical path (measured on a
    # ResNet-shaped model, 2 ranks: about 0.35 ms from the launch until the
    # comm thread ran it, and 0.1-0.4 ms from its end until the waiting
    # thread ran again). So, on the default path (no comm hook; no fused
    # optimizer, which steps the earlier buckets while the last one is still
    # in flight; not find_unused_parameters, whose usage map follows the last
    # bucket), it is only marked launched, and the finalize reduces it on its
    # own thread, in order after the others (a synchronous call runs inline
    # once the comm thread's queue is empty). Every rank does the same, so collectives still
    # pair up in the same order. Without overlap (no core free for the comm
    # thread, see [Note: overlap needs a free core] in overlap_policy.py) every
    # bucket takes this path, in bucket order; all ranks follow rank 0's choice.
    def _reduce_now(self, bucket: Bucket) -> torch.Tensor:
        """Reduce the bucket left to the finalize (see [Note: the last bucket])."""
        bucket.inline = False
        index, trace = bucket.index, self.trace
        trace.mark("launch", index)
        label = f"DDP bucket {index}"
        try:
            if bucket.homes:
                self.comm.all_reduce_homed(
                    bucket.buffer, sorted(bucket.homes, key=_offset), 1.0 / self.divide_factor,
                    label=label, async_op=False)
            else:
                self.comm.all_reduce(bucket.buffer, label=label, async_op=False)
        except Exception as exc:
            raise self._bucket_failed(bucket, exc) from exc
        trace.mark("comm_done", index)
        return bucket.buffer

    # ----------------------------------------------------------------- finalize
    def _finalize(self) -> None:
        self.trace.mark("backward_end")
        if self.auto_stamps is not None and self._recording_arrival():
            self.auto_stamps.t_end = time.perf_counter()
        used: list[int] | None = self._static_used
        if self._used_future is not None:
            # Launched after every bucket, so waiting here waits for all of them.
            used_t = self._used_future.wait()
            used = (used_t[0] if isinstance(used_t, (list, tuple)) else used_t).tolist()
            self._used_future = None
            if self.mode is GraphMode.STATIC and len(used) == 2 * len(self.params):
                self._static_used, used = used[:len(self.params)], used[len(self.params):]
        try:
            with torch.no_grad():
                for bucket in self.buckets:
                    # Bucket by bucket: the later ones may still be in flight meanwhile.
                    with profiled(f"gradring::bucket_wait#{bucket.index}"):
                        if bucket.inline:  # the wait is its reduction, on this thread
                            with profiled(f"gradring::bucket_all_reduce#{bucket.index}"):
                                value = self._reduce_now(bucket)
                        else:
                            value = self._wait_bucket(bucket)
                    if isinstance(value, (list, tuple)):
                        value = value[0]
                    with profiled(f"gradring::bucket_write_grads#{bucket.index}"):
                        if value is not bucket.buffer:
                            bucket.buffer.copy_(value.reshape(-1))
                        self._write_grads(bucket, used)
                        bucket.homes, bucket.homed_slots = [], set()  # no refs to old grads
                        bucket.to_write = []
                    if self.post_reduce is not None:
                        self.post_reduce(bucket)
                    self.trace.mark("written", bucket.index)
            futures, self._post_backward_futures = self._post_backward_futures, []
            for fut in futures:
                fut.wait()
        finally:
            self.trace.iteration += 1
            self.expect_hooks = False
            self.require_finalize = False
            self._finalized_since_forward = True
            self.num_backward += 1

    # -------------------------------------------------------------------- errors
    def remove_hooks(self) -> None:
        _remove_handles(self._hook_handles)


def _offset(piece: tuple[int, torch.Tensor]) -> int:
    return piece[0]


def _remove_handles(handles: list[Any]) -> None:
    for h in handles:
        h.remove()
    handles.clear()
