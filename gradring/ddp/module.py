"""gradring.DistributedDataParallel: the wrapper class.

[Note: type identity]
``gradring.DistributedDataParallel`` subclasses torch's class, so
``isinstance(m, torch.nn.parallel.DistributedDataParallel)`` holds and
libraries take their DDP paths (Lightning, Accelerate, Dynamo, distributed
checkpoint do). On these terms:

- torch's ``__init__`` never runs, so no C++ ``Reducer``, ``Logger`` or
  ``_DDPSink`` is created for the model (the ``logger`` attribute is a torch
  Logger over a stand-in, see [Note: a torch Logger for torch's helper
  functions] in ``logging_data.py``);
- every callable attribute of torch 2.13's class is overridden in the class
  below: implemented with torch's meaning on top of gradring's own reducer,
  or, for torch-internal machinery gradring has no counterpart of, raising
  ``NotImplementedError`` that names it (``tests/ranks/test_ddp_identity.py`` walks
  torch's class and checks it);
- nothing inherited from torch's class is ever called.

The class holds construction, forward, ``no_sync``, pickling and torch's
surface. A torch-named method whose concept lives elsewhere is a one-line
delegation to the collaborator that owns it: the buffers to ``BufferSync``
(``buffers.py``), Join to ``join.py``, the comm hook / fused optimizer /
in-backward optimizers to ``ConsumerSlot`` (``consumers.py``). The averaging
is done by gradring's own Reducer (``gradring/reducer/reducer.py``); this class
decides *when* the reducer is told what, mirroring torch's DDP so a user
switches by one import.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import distributed as _torch_distributed

from gradring import compile as compile_split
from gradring import errors, pytree
from gradring.announce import announce_first_forward, notice
from gradring.buckets import DEFAULT_BUCKET_CAP_MB, BucketCaps
from gradring.comm import peers
from gradring.ddp import join, logging_data, reducer_params
from gradring.ddp.buffers import BufferCommHookLocation, BufferSync
from gradring.ddp.consumers import ConsumerSlot
from gradring.ddp.delayed_all_reduce import DelayedAllReduce, check_given_together
from gradring.ddp.mixed_precision import MixedPrecision
from gradring.ddp.output_boundary import wrap_outputs
from gradring.fused_optim import FusedOptimizer
from gradring.graph import GraphMode
from gradring.group_comm import GroupComm
from gradring.observe.trace import profiled
from gradring.reducer import CommHook, Reducer

__all__ = ["DistributedDataParallel", "TorchDDP"]

#: torch's class, captured at import time (``gradring.install()`` may later
#: rebind the public names; this stays the original).
TorchDDP = _torch_distributed.DistributedDataParallel


def _group_of(process_group: Any, device_mesh: Any) -> Any:
    """The process group to average over, from ``process_group`` or a 1-D ``device_mesh``."""
    if process_group is not None and device_mesh is not None:
        raise RuntimeError("Cannot specify both process_group and device_mesh arguments.")
    if device_mesh is not None:
        if device_mesh.ndim != 1:
            raise RuntimeError(f"Only 1D device mesh is supported, but got {device_mesh}.")
        return device_mesh.get_group(mesh_dim=0)
    if process_group is not None:
        return process_group
    if not dist.is_available() or not dist.is_initialized():
        raise errors.NotInitializedError(errors.not_initialized())
    return dist.group.WORLD


def _not_supported(name: str) -> Any:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(errors.torch_internal(name))
    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"torch-internal ``{name}``: gradring has no counterpart (raises)."
    return method


def _check_supported(**given: bool) -> None:
    """Arguments of torch's that gradring does not implement: an error if set."""
    for name, value in given.items():
        if value:
            raise NotImplementedError(errors.unsupported_argument(name))


class DistributedDataParallel(TorchDDP):
    """Data-parallel wrapper with torch DDP's constructor and behaviour.

    Gradients are averaged across the process group when ``loss.backward()``
    returns. See the README for what differs from torch (better errors,
    shared-memory collectives on one host).
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: list[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        process_group: Any = None,
        bucket_cap_mb: float | str | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params: Any = None,
        param_to_hook_all_reduce: Any = None,
        mixed_precision: Any = None,
        device_mesh: Any = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: list[int] | None = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
    ) -> None:
        # torch's DDP.__init__ is never called (see [Note: type identity]).
        nn.Module.__init__(self)
        join.Joinable.__init__(self)
        # [Note: the constructor's steps]
        # Each step owns one concern and sets the attributes of that concern;
        # an error in a step is raised before any later step has run.
        _check_supported(batched_grad_copy=batched_grad_copy)
        self.batched_grad_copy = batched_grad_copy  # torch's flag (False is all gradring takes)
        self._init_records()
        self._check_argument_pairs(delay_all_reduce_named_params, param_to_hook_all_reduce)
        self._use_group(process_group, device_mesh, device_ids, check_reduction=check_reduction)
        named = self._choose_parameters(module, delay_all_reduce_named_params)
        self._place(module, named, device_ids, output_device, dim)
        init_sync_buffers = self._set_sync_options(
            broadcast_buffers, forward_sync_buffers, find_unused_parameters=find_unused_parameters,
            gradient_as_bucket_view=gradient_as_bucket_view,
            skip_all_reduce_unused_params=skip_all_reduce_unused_params)
        caps = self._set_caps(bucket_cap_mb, bucket_cap_mb_list)
        self._keep_parameters(module, named)
        if self._delay_all_reduce_params:
            self._register_delay_all_reduce_hook(bucket_cap_mb, param_to_hook_all_reduce,
                                                 device_ids)
            if self._delay_all_reduce_all_params:
                # Nothing for the buckets: no reducer, no other sync (as torch means
                # it to; docs/ddp-differences.md). The caps stay readable here.
                self._unowned_caps, self.mixed_precision = caps, mixed_precision
                return
        if init_sync:
            self._verify_same_model(self._module_parameters)
            self._sync_params_and_buffers(0, buffers=init_sync_buffers)
        self._set_up_reduction(static_graph, mixed_precision, caps)
        if static_graph:
            self._declare_static_graph(stacklevel=3)

    # ------------------------------------------------------ the constructor's steps
    def _init_records(self) -> None:
        """What DDP records about itself for the logging data and torch's helpers."""
        # The error DDP last raised, for _get_ddp_logging_data (as torch's logger keeps it).
        self._error: str | None = None
        # The sampled runtime statistics and the comm hook's name, for the logging data.
        self._runtime_stats = logging_data.RuntimeStats()
        self._comm_hook_name: str | None = None
        # Whether the output boundary hands out copies (torch's _set_ddp_sink_clone).
        self._ddp_sink_clone = True
        # The rank whose model every rank took at the end of the last Join (torch's
        # name), and whether a Join hook was ever made (logged as torch logs it).
        self._authoritative_rank = 0
        self._join_used = False
        # torch's C++ Logger, for torch's helpers that take DDP's logger (made on first use).
        self._torch_logger = logging_data.TorchLogger()

    def _check_argument_pairs(self, delay_all_reduce_named_params: Any,
                              param_to_hook_all_reduce: Any) -> None:
        """Arguments that only make sense together."""
        half_given = check_given_together(delay_all_reduce_named_params, param_to_hook_all_reduce)
        if half_given is not None:
            self._log_and_throw(ValueError, half_given)

    def _use_group(self, process_group: Any, device_mesh: Any, device_ids: Any, *,
                   check_reduction: bool) -> None:
        """The group the gradients are averaged over."""
        self.process_group = _group_of(process_group, device_mesh)
        if device_mesh is not None:
            # The 1-D mesh the group came from (torch keeps it too).
            self.device_mesh = device_mesh
        if check_reduction:  # pointed at the constructor's caller
            warnings.warn(errors.check_reduction_deprecated(), FutureWarning, stacklevel=3)
        if device_ids is not None and len(device_ids) > 1:
            self._log_and_throw(ValueError, errors.too_many_device_ids())

    def _choose_parameters(self, module: nn.Module,
                           delay_all_reduce_named_params: Any) -> list[tuple[str, Any]]:
        """The parameters the buckets average (named), the ones DDP leaves alone
        and the delayed ones; every parameter on one device."""
        # Names (module-relative) of parameters and buffers DDP leaves alone.
        self.parameters_to_ignore: set[str] = set(
            getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        # The parameters averaged by one all-reduce from param_to_hook_all_reduce's
        # hook, outside the buckets ([Note: the delayed all-reduce]).
        self._delay_all_reduce_params: list[torch.Tensor] = []
        for name, param in delay_all_reduce_named_params or ():
            self.parameters_to_ignore.add(name)
            self._delay_all_reduce_params.append(param)
        self._delayed: DelayedAllReduce | None = None
        named = [(n, p) for n, p in module.named_parameters()
                 if p.requires_grad and n not in self.parameters_to_ignore]
        # Every trainable parameter delayed: no reducer work at all (as torch).
        self._delay_all_reduce_all_params = not named and bool(self._delay_all_reduce_params)
        if not named and not self._delay_all_reduce_params:
            self._log_and_throw(RuntimeError, errors.no_trainable_params())
        devices = {str(p.device) for _, p in named or
                   [("", p) for p in self._delay_all_reduce_params]}
        if len(devices) > 1:
            self._log_and_throw(ValueError, errors.mixed_devices([str(p.device)
                                                                  for _, p in named]))
        if devices == {"meta"}:
            self._log_and_throw(RuntimeError, errors.meta_parameters(type(module).__name__))
        return named

    def _place(self, module: nn.Module, named: list[tuple[str, Any]], device_ids: Any,
               output_device: Any, dim: int) -> None:
        """The wrapped module, the device it lives on, and torch's device arguments."""
        # The wrapped module; state_dict keys get the usual "module." prefix.
        self.module = module
        # The single device every parameter lives on, and its type (torch's names).
        self.device = (named[0][1] if named else self._delay_all_reduce_params[0]).device
        self.device_type = self.device.type
        # torch's flags: one device per module here; copies of inputs on a side
        # stream (read from torch's variable; gradring moves no inputs on streams).
        self.is_multi_device_module = False
        self.use_side_stream_for_tensor_copies = (
            os.environ.get("PYTORCH_DDP_USE_SIDE_STREAM", "1") == "1")
        if device_ids is not None and self.device.type == "cpu":
            devices = {str(p.device) for _, p in named or
                       [("", p) for p in self._delay_all_reduce_params]}
            self._log_and_throw(ValueError,
                                errors.device_ids_on_cpu(device_ids, output_device, devices))
        self._passing_sync_batchnorm_handle(module)
        # Where inputs are moved before forward (torch moves them for device_ids).
        self.device_ids = None if device_ids is None else [torch.device(self.device)]
        # torch's arguments, kept as given (gradring never scatters or gathers).
        self.output_device = output_device
        self.dim = dim

    def _set_sync_options(self, broadcast_buffers: bool | None,
                          forward_sync_buffers: bool | None, *, find_unused_parameters: bool,
                          gradient_as_bucket_view: bool,
                          skip_all_reduce_unused_params: bool) -> bool:
        """The group's collectives, the buffers' sync and torch's flags; whether
        the constructor broadcasts the buffers too."""
        # The collectives of the group (reducer, buffers, Join, init and final sync).
        self._comm = GroupComm(self.process_group)
        # Buffers: broadcast rank 0's before each forward (forward_sync_buffers;
        # broadcast_buffers is torch 2.13's deprecated name for it).
        each_forward, init_sync_buffers = _buffer_flags(broadcast_buffers, forward_sync_buffers)
        self._buffer_sync = BufferSync(self.parameters_to_ignore, each_forward=each_forward)
        # torch's flags of the same names.
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        # (skip buckets no rank used in this forward: needs find_unused_parameters)
        self.skip_all_reduce_unused_params = bool(skip_all_reduce_unused_params)
        # Set by no_sync(): when False, backward only accumulates locally.
        self.require_backward_grad_sync = True
        # Whether the next forward syncs buffers (torch's require_forward_param_sync).
        self.require_forward_param_sync = True
        return init_sync_buffers

    def _set_caps(self, bucket_cap_mb: float | str | None,
                  bucket_cap_mb_list: list[int] | None) -> BucketCaps:
        """The bucket caps, as torch 2.13 derives them, for the reducer, which owns
        them (see [Note: the cap's walk] in gradring/reducer/rebuild.py)."""
        # Bucket size of the buffer and init broadcasts (torch's attribute; ours
        # coalesces per dtype).
        self.broadcast_bucket_size = 250 * 1024 * 1024
        return BucketCaps.parse(bucket_cap_mb, bucket_cap_mb_list)

    def _keep_parameters(self, module: nn.Module, named: list[tuple[str, Any]]) -> None:
        """The parameters the reducer averages and their names; the buffers to sync."""
        # The parameters the reducer averages, and their module-relative names.
        self._param_names = [n for n, _ in named]
        self._module_parameters = [p for _, p in named]
        self._buffer_sync.refresh(module)
        # Whether the first forward's one-time setup (_lazy_init) ran.
        self._lazy_init_ran = False

    def _set_up_reduction(self, static_graph: bool, mixed_precision: Any,
                          caps: BucketCaps) -> None:
        """The reducer, what consumes its buckets, and mixed precision."""
        # What the reducer is built with again after unpickling.
        self._static_at_init = static_graph
        # torch's _MixedPrecision as given (None: everything in the parameters' dtype).
        self.mixed_precision = mixed_precision
        # gradring's reducer: buckets, gradient hooks, the all-reduces.
        self.reducer = self._build_reducer(caps, static_graph=static_graph)
        if caps.auto and self.reducer.mode is GraphMode.FIND_UNUSED and not static_graph:
            notice(errors.auto_cap_without_rebuild(DEFAULT_BUCKET_CAP_MB))  # gradring's own
        # Join: average over the initial world size, not over the ranks still training.
        self.divide_by_initial_world_size = True
        # The comm hook, fused optimizer or in-backward optimizers (one of them).
        self._consumers = ConsumerSlot(self.reducer, self._log_and_throw)
        # The precision switches ([Note: mixed precision] in mixed_precision.py), or None.
        self._mixed = self._setup_mixed_precision()

    def _build_reducer(self, caps: BucketCaps, *, static_graph: bool) -> Reducer:
        return Reducer(
            self._module_parameters, self._param_names, self._comm, caps=caps,
            mode=GraphMode.of(find_unused=self.find_unused_parameters, static_graph=False),
            static_graph=static_graph,
            # Under mixed precision .grad is never a bucket view ([Note: mixed precision]).
            gradient_as_bucket_view=self.gradient_as_bucket_view and self.mixed_precision is None,
            skip_unused_buckets=bool(self.skip_all_reduce_unused_params),
        )

    def _setup_mixed_precision(self) -> MixedPrecision | None:
        """Set up mixed precision, whose comm hook reduces the buckets (as torch's does)."""
        if self.mixed_precision is None:
            return None
        mixed = MixedPrecision(self.mixed_precision, self.module, self.parameters_to_ignore,
                               self._comm)
        self._consumers.set_comm_hook(mixed.reduce_bucket, None)
        self._buffer_sync.refresh(self.module)
        return mixed

    # ------------------------------------------------------------ construction
    def _verify_same_model(self, params: list[torch.Tensor]) -> None:
        """Every rank checks every rank against rank 0, so all of them raise together."""
        meta = [(tuple(p.shape), tuple(p.stride())) for p in params]
        # gloo's own call: a peer that dies here is named (see comm/peers.py).
        everyone = peers.gather_objects(self._comm.group, (meta, self._param_names),
                                        "DDP's parameter verification")
        counts = [len(m) for m, _ in everyone]
        if any(c != counts[0] for c in counts):
            self._log_and_throw(RuntimeError, errors.param_count_mismatch(counts))
        ref, ref_names = everyone[0]
        me = self._comm.rank
        own = everyone[me][0]
        for rank, (theirs, names) in enumerate(everyone):
            for i, ((shape, stride), (rshape, rstride)) in enumerate(zip(theirs, ref)):
                for k, (what, value, want) in enumerate((("sizes", shape, rshape),
                                                         ("strides", stride, rstride))):
                    if value != want:
                        self._log_and_throw(RuntimeError, errors.param_shape_mismatch(
                            i, names[i], what, value, want, rank, this_rank=me,
                            mine=own[i][k]))
        # Same shapes in another order would average different parameters silently
        # (torch's DDP does not check): the names must agree too.
        for rank, (_, names) in enumerate(everyone):
            for i, (a, b) in enumerate(zip(ref_names, names)):
                if a != b:
                    self._log_and_throw(RuntimeError, errors.param_order_mismatch(
                        i, a, b, rank, this_rank=me))

    def _sync_params_and_buffers(self, src: int, *, buffers: bool = True) -> None:
        """Broadcast the parameters DDP manages (ignored ones excepted) and, with
        ``buffers``, the module's buffers from group rank ``src`` (at
        construction, and at the end of a Join)."""
        self._buffer_sync.refresh(self.module)
        self._comm.broadcast_coalesced(
            [p.data for n, p in self.module.named_parameters()
             if n not in self.parameters_to_ignore]
            + (self._buffer_sync.buffers if buffers else []), src=src)

    def _passing_sync_batchnorm_handle(self, module: nn.Module) -> None:
        """Refuse torch's own SyncBatchNorm on CPU, as torch's DDP does;
        gradring.nn.SyncBatchNorm is the one that works there."""
        if self.device_type != "cpu":
            return
        for name, layer in module.named_modules():
            if isinstance(layer, nn.SyncBatchNorm):
                self._log_and_throw(ValueError, errors.torch_sync_batchnorm_on_cpu(name))

    @property
    def comm(self) -> GroupComm:
        """The collectives of this DDP's process group (rank, world size, all-gather...)."""
        return self._comm

    @property
    def static_graph(self) -> bool:
        """Whether the graph is declared the same every iteration (stored by the reducer)."""
        reducer = self.__dict__.get("reducer")
        return reducer is not None and reducer.static_graph

    @property
    def _has_rebuilt_buckets(self) -> bool:
        """torch's flag: False until the forward that rebuilt the buckets in
        gradient-arrival order (the second forward; the third under static_graph;
        never with find_unused_parameters), True from then on. torch's ZeRO overlap
        hooks (``hook_with_zero_step``) read it in every bucket's hook to know the
        bucket layout is final (docs/torch-reads.md)."""
        reducer = self.__dict__.get("reducer")
        return reducer is not None and reducer.has_rebuilt

    @property
    def _caps(self) -> BucketCaps:
        """The caps in force: the reducer's; with every parameter delayed (no
        reducer), the constructor's."""
        reducer = self.__dict__.get("reducer")
        return self._unowned_caps if reducer is None else reducer.caps

    @property
    def bucket_bytes_cap(self) -> int:
        """The bucket cap in bytes (what bucket_cap_mb="auto" chose, once it has)."""
        return self._caps.cap

    @property
    def bucket_bytes_cap_list(self) -> list[int]:
        """bucket_cap_mb_list in bytes (torch's attribute; empty without it)."""
        return list(self._caps.per_bucket)

    @property
    def bucket_bytes_cap_default(self) -> bool:
        """torch's flag: whether the first bucket has a smaller cap than the rest
        (bucket_cap_mb left to its default)."""
        return self._caps.first < self._caps.cap

    def _set_static_graph(self) -> None:
        """Declare that the graph is the same every iteration (docs/design.md)."""
        self._declare_static_graph(stacklevel=3)

    def _declare_static_graph(self, *, stacklevel: int) -> None:
        """_set_static_graph, with its warnings (torch's) pointed ``stacklevel``
        frames up: at the user's call, or at the constructor's caller."""
        if self.static_graph:
            warnings.warn(errors.static_graph_twice(), stacklevel=stacklevel)
            return
        try:
            self.reducer.set_static_graph()
        except RuntimeError as exc:
            self._log_and_throw(RuntimeError, str(exc))
        if self.find_unused_parameters:
            warnings.warn(errors.static_graph_with_find_unused(), stacklevel=stacklevel)

    # ----------------------------------------------------------------- forward
    # Under torch.compile Dynamo never traces this frame (frames it calls still
    # may be compiled) nor the bookkeeping before and after; the wrapped module
    # is compiled as a frame of its own, split at the buckets (see [Note:
    # compile and the buckets] in compile.py).
    @compile_split.never_traced(recursive=False)
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self._delay_all_reduce_all_params:
            # Every trainable parameter is delayed: the module runs as it is (as torch).
            self._lazy_init_ran = True
            out = self.module(*inputs, **kwargs)
            self._clear_grad_buffer()
            return out
        compile_split.install()
        trace = self.reducer.trace  # forward marks for gradring.explain (tools/explain_record.py)
        with profiled("gradring::forward"):
            trace.mark("forward_start")
            inputs, kwargs = self._pre_forward(*inputs, **kwargs)
            trace.mark("module_start")
            out = self._run_ddp_forward(*inputs, **kwargs)
            trace.mark("module_end")
            out = self._post_forward(out)
            trace.mark("forward_end")
            return out

    @compile_split.never_traced(recursive=True)
    def _pre_forward(self, *inputs: Any, **kwargs: Any) -> tuple[Any, Any]:
        """Before the module runs: rebuild buckets once, sync buffers, move inputs."""
        if not self._lazy_init_ran:
            self._lazy_init()
            announce_first_forward(self)  # [Note: which DDP did I get] in announce.py
        sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        if self._join_config.enable:
            # Tells joined ranks whether this iteration reduces gradients.
            join.notify(self, sync)
        if sync:
            self._guarded(self.reducer.prepare_for_forward)
            self._runtime_stats.on_forward(self.reducer.trace, self.reducer.num_forward - 1)
            if self.reducer.rebuild_if_needed():
                compile_split.after_rebuild(self)
                self._consumers.warn_unordered_hook(self.process_group)
        else:
            if torch.is_grad_enabled():
                # Under no_sync too: the previous reducing backward must have finished.
                self._guarded(self.reducer.check_prior_finished)
            self.reducer.note_unsynced_forward()
        if self._buffer_sync.before_forward(self.require_forward_param_sync):
            self._sync_buffers(active=True)
        if self.device_ids:
            inputs = pytree.to_device(inputs, self.device_ids[0])
            kwargs = pytree.to_device(kwargs, self.device_ids[0])
        if self._mixed is not None:
            inputs, kwargs = self._mixed.cast_inputs(inputs, kwargs)
        return inputs, kwargs

    @compile_split.never_traced(recursive=True)
    def _post_forward(self, output: Any) -> Any:
        """After the module ran: prepare the reducer for the backward to come.
        The sync flag is read again, as torch does: code inside the module's
        forward may have entered no_sync() (Lightning's manual optimization)."""
        sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        if self._buffer_sync.after_forward(self.require_forward_param_sync):
            self._sync_buffers(active=True)
        self.require_forward_param_sync = sync
        if sync:
            find_unused = self.reducer.mode is GraphMode.FIND_UNUSED
            self.reducer.prepare_for_backward(list(pytree.tensors(output)) if find_unused
                                              else None)
            if find_unused or self.reducer.in_static_first_iteration:
                output = wrap_outputs(output, self.reducer, clone=self._ddp_sink_clone)
        # After every forward, as torch: the delayed parameters' .grad in the buffer.
        self._clear_grad_buffer()
        return output

    def _guarded(self, fn: Any, *args: Any) -> Any:
        """Run a reducer step; an error it raises is recorded for the logging data."""
        try:
            return fn(*args)
        except Exception as exc:
            self._error = str(exc)
            raise

    def _lazy_init(self) -> None:
        """Once, at the first forward: optimizers registered to run in backward."""
        self._lazy_init_ran = True
        self._setup_in_backward_optimizers()

    # ------------------------------------------------------------------- sync
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first backward after leaving reduces the sum."""
        if not self._delay_all_reduce_all_params and self._consumers.fused_optim is not None:
            raise RuntimeError(errors.no_sync_with_fused_optim())
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    # ------------------------------------------------- consumers of the buckets
    def register_comm_hook(self, state: object, hook: CommHook) -> None:
        """Replace the bucket all-reduce by ``hook(state, bucket) -> Future[Tensor]``."""
        self._check_comm_hook(hook)
        self._consumers.set_comm_hook(hook, state)
        self._consumers.warn_unordered_hook(self.process_group)
        self._comm_hook_name = getattr(hook, "__qualname__", repr(hook))  # as torch logs it

    def _register_fused_optim(self, optim_cls: type, *args: Any, **kwargs: Any) -> Any:
        """Step each parameter as soon as its bucket is reduced; returns the fused optimizer."""
        return self._consumers.set_fused_optim(optim_cls, *args, **kwargs)

    @property
    def _fused_optim(self) -> FusedOptimizer | None:
        """The fused optimizer, once registered (docs/hooks.md reads it here)."""
        return self._consumers.fused_optim

    def _setup_in_backward_optimizers(self) -> None:
        """Step parameters that carry ``_in_backward_optimizers`` (torch's
        ``_apply_optimizer_in_backward``) as soon as their bucket is reduced."""
        params = self._module_parameters
        stepped_in_backward = [p for p in params if hasattr(p, "_in_backward_optimizers")]
        if stepped_in_backward:
            self._consumers.set_in_backward(params)

    def _check_comm_hook(self, hook: Any) -> None:
        if not callable(hook):
            self._log_and_throw(TypeError, errors.hook_not_callable(hook))
        try:
            sig = inspect.signature(hook)
        except (TypeError, ValueError):
            return
        bucket = sig.parameters.get("bucket")
        if bucket is not None and bucket.annotation not in (inspect._empty, dist.GradBucket) \
                and not isinstance(bucket.annotation, str):
            from gradring.buckets.grad_bucket import GradBucket

            if bucket.annotation is not GradBucket:
                self._log_and_throw(ValueError, "Communication hook: bucket annotation "
                                    "should be dist.GradBucket.")

    def _register_builtin_comm_hook(self, comm_hook_type: Any) -> None:
        """torch's built-in hook types, mapped to gradring's hooks of the same meaning."""
        from gradring.hooks import default

        hooks = {dist.BuiltinCommHookType.ALLREDUCE: default.allreduce_hook,
                 dist.BuiltinCommHookType.FP16_COMPRESS: default.fp16_compress_hook}
        if comm_hook_type not in hooks:
            raise NotImplementedError(f"built-in comm hook {comm_hook_type} is not supported")
        self.register_comm_hook(self.process_group, hooks[comm_hook_type])
        self._comm_hook_name = str(comm_hook_type)  # as torch logs a built-in hook

    # ---------------------------------------------------------------- buffers
    @property
    def forward_sync_buffers(self) -> bool:
        """Whether each forward syncs the module's buffers (torch 2.13's name)."""
        return self._buffer_sync.each_forward

    @forward_sync_buffers.setter
    def forward_sync_buffers(self, value: bool) -> None:
        self._buffer_sync.each_forward = value

    @property
    def broadcast_buffers(self) -> bool:
        """torch 2.13's deprecated name for ``forward_sync_buffers``."""
        return self._buffer_sync.each_forward

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self._buffer_sync.each_forward = value

    @property
    def modules_buffers(self) -> list[torch.Tensor]:
        """The buffers synced, as last read (torch's attribute)."""
        return self._buffer_sync.buffers

    @property
    def named_module_buffers(self) -> dict[str, torch.Tensor]:
        """The same by name (torch's attribute; what a buffer comm hook gets)."""
        return self._buffer_sync.named

    @property
    def buffer_hook(self) -> Any:
        """torch's ``_BufferCommHook`` registered by _register_buffer_comm_hook, or None."""
        return self._buffer_sync.hook

    def _assign_modules_buffers(self) -> None:
        """Read the module's buffers anew (a reassigned buffer is the one synced)."""
        self._buffer_sync.refresh(self.module)

    def will_sync_module_buffers(self) -> bool:
        return self._buffer_sync.will_sync(self.require_forward_param_sync)

    def _check_sync_bufs_pre_fwd(self) -> bool:
        return self._buffer_sync.before_forward(self.require_forward_param_sync)

    def _check_sync_bufs_post_fwd(self) -> bool:
        return self._buffer_sync.after_forward(self.require_forward_param_sync)

    def _register_buffer_comm_hook(self, state: Any, hook: Any,
                                   comm_hook_location: Any = BufferCommHookLocation.POST_FORWARD,
                                   ) -> None:
        """Sync buffers with ``hook(state, {name: buffer})`` instead of a broadcast
        from rank 0. Futures the hook returns are waited for at the end of backward."""
        self._buffer_sync.register_hook(state, hook, comm_hook_location)

    def _sync_buffers(self, *, active: bool = True) -> None:
        """Sync buffers before (or after) a forward. Under Join the source is the
        highest rank still training (as torch does); otherwise rank 0. Buffers
        are read from the module each time: a reassigned one is the one sent."""
        if not self._buffer_sync.will_sync(self.require_forward_param_sync):
            return
        src = join.buffer_source(self, active) if self._join_config.enable else 0
        self._buffer_sync.refresh(self.module)
        self._sync_module_buffers(src)

    def _sync_module_buffers(self, authoritative_rank: int) -> None:
        futures = self._buffer_sync.sync(self._comm, authoritative_rank)
        if futures is not None:
            self.reducer.install_post_backward_futures(futures)

    def _default_broadcast_coalesced(self, bufs: list[torch.Tensor] | None = None,
                                     bucket_size: int | None = None,
                                     authoritative_rank: int = 0) -> None:
        """Broadcast ``bufs`` (default: the module's buffers) from ``authoritative_rank``."""
        if bufs is None or bufs is self._buffer_sync.buffers:
            self._buffer_sync.broadcast(self._comm, authoritative_rank)
            return
        self._distributed_broadcast_coalesced(
            bufs, self.broadcast_bucket_size if bucket_size is None else bucket_size,
            authoritative_rank)

    def _distributed_broadcast_coalesced(self, tensors: list[torch.Tensor], buffer_size: int,
                                         authoritative_rank: int = 0) -> None:
        """Broadcast ``tensors`` in place from a group rank (one collective per dtype)."""
        del buffer_size  # gradring coalesces per dtype, whatever the size
        with torch.no_grad():
            self._comm.broadcast_coalesced(list(tensors), src=authoritative_rank)

    # -------------------------------------------------------------------- join
    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Any:
        return join.Join([self], enable, throw_on_early_termination,
                         divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs: Any) -> join.DDPJoinHook:
        self._join_used = True
        return join.DDPJoinHook(self, **kwargs)

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self) -> Any:
        return self.process_group

    def _check_global_requires_backward_grad_sync(self, is_joined_rank: bool) -> Any:
        """Whether any rank reduces in this iteration (Join's sync flag)."""
        wants = (not is_joined_rank) and self.require_backward_grad_sync
        return torch.tensor(int(join.any_rank(self._comm, wants, self.device)))

    def _find_common_rank(self, input_rank: int, rank_cond: bool) -> int:
        """The highest rank for which ``rank_cond`` holds (Join's buffer source)."""
        rank = join.highest_rank(self._comm, rank_cond, self.device)
        if rank < 0:
            raise ValueError("No rank satisfies the condition: every rank passed False.")
        return rank

    def _check_and_sync_module_buffers(self) -> None:
        """A joined rank's buffer sync, in step with the ranks still training."""
        if self._check_sync_bufs_pre_fwd():
            self._sync_buffers(active=False)

    def _match_all_reduce_for_bwd_pass(self) -> None:
        """A joined rank's backward collectives, with zero gradients."""
        self.reducer.shadow_backward()

    def _sync_final_model(self, is_last_joiner: bool) -> None:
        self._authoritative_rank = join.sync_final_model(self, is_last_joiner=is_last_joiner)

    # ------------------------------------------------- ignored params and buffers
    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module: nn.Module,
                                                    params_and_buffers_to_ignore: Any) -> None:
        """Mark parameters and buffers (by module-relative name) that DDP must leave alone."""
        given = params_and_buffers_to_ignore
        names = set(given)
        # The attribute torch's DDP constructor (and ours) reads, as given.
        module._ddp_params_and_buffers_to_ignore = given
        for name, param in module.named_parameters():
            if name in names:
                param._ddp_ignored = True
        for name, buf in module.named_buffers():
            if name in names:
                buf._ddp_ignored = True

    @staticmethod
    def _get_data_parallel_params(module: nn.Module, named_params: bool = False) -> Iterator[Any]:
        """The parameters DDP manages: not the ignored ones.

        With ``named_params=True`` torch 2.13 checks the mark on the (name,
        parameter) pair rather than on the parameter, so it yields every pair,
        ignored ones included; callers rely on torch's result, so it is kept."""
        if named_params:
            yield from module.named_parameters()
            return
        for param in module.parameters():
            if not hasattr(param, "_ddp_ignored"):
                yield param

    def _get_parameters(self, m: nn.Module, recurse: bool = True) -> Iterator[torch.Tensor]:
        """Parameters of ``m`` that DDP manages."""
        for name, param in m.named_parameters(recurse=recurse):
            if name not in self.parameters_to_ignore:
                yield param

    # ------------------------------------------------------ delayed all-reduce
    def _register_delay_all_reduce_hook(self, bucket_cap_mb: Any, param_to_hook_all_reduce: Any,
                                        device_ids: Any) -> None:
        """Set up the delayed parameters' gradient buffer, broadcast them from
        rank 0 and hook their all-reduce onto ``param_to_hook_all_reduce``
        ([Note: the delayed all-reduce]); ``bucket_cap_mb`` is not needed."""
        del bucket_cap_mb
        device = torch.device("cpu") if device_ids is None else self.device
        delayed = DelayedAllReduce(self._delay_all_reduce_params, self._comm, device)
        delayed.broadcast_params()
        delayed.hook_onto(param_to_hook_all_reduce)
        self._delayed = delayed

    def _delayed_all_reduce_hook(self, grad: torch.Tensor) -> torch.Tensor:
        """The hook on ``param_to_hook_all_reduce``: average the delayed gradients."""
        if self._delayed is not None:
            self._delayed.launch()
        return grad

    def _clear_grad_buffer(self) -> None:
        """A delayed parameter whose ``.grad`` is None gets its view of the
        buffer (zeroed) as ``.grad``, so the backward accumulates there."""
        if self._delayed is not None:
            self._delayed.clear_grads()

    # ---------------------------------------------------------------- reducer
    def _remove_autograd_hooks(self) -> None:
        """Remove the reducer's gradient hooks (a new DDP on the same module then works)."""
        self.reducer.remove_hooks()

    def _check_reducer_finalized(self) -> None:
        """Raise if the last synchronised backward did not finish its reduction."""
        if self.reducer.require_finalize:
            raise RuntimeError(errors.reducer_not_finalized())

    # -------------------------------------------------------------- introspection
    def _get_ddp_logging_data(self) -> dict[str, Any]:
        """torch's logging data: its keys, with its types (see [Note: logging data as
        torch gives it] in logging_data.py), plus gradring's static_graph."""
        r = self.reducer
        backend = dist.get_backend(self.process_group)
        data: dict[str, Any] = {
            "world_size": self._comm.world_size,
            "rank": self._comm.rank,
            "module_name": type(self.module).__name__,
            "device_ids": "" if not self.device_ids else str(self.device_ids[0]),
            "output_device": -1 if self.output_device is None else self.output_device,
            "broadcast_buffers": int(bool(self.forward_sync_buffers)),
            "bucket_cap_bytes": r.bucket_cap_bytes,
            "find_unused_parameters": int(self.find_unused_parameters),
            "gradient_as_bucket_view": int(self.gradient_as_bucket_view),
            "static_graph": int(self.static_graph),
            "has_sync_bn": int(any(isinstance(m, nn.SyncBatchNorm)
                                   for m in self.module.modules())),
            "is_multi_device_module": 0,
            "has_rebuilt_buckets": int(r.has_rebuilt),
            "bucket_sizes": logging_data.joined(r.initial_bucket_sizes),
            "rebuilt_bucket_sizes": logging_data.joined(r.rebuilt_bucket_sizes),
            "rebuilt_per_bucket_param_indices": logging_data.joined(
                [logging_data.joined(idx, " ") for idx in r.rebuilt_param_indices]),
            "num_parameter_tensors": len(r.params),
            "total_parameter_size_bytes": sum(p.numel() * p.element_size() for p in r.params),
            "dtypes": logging_data.dtype_names([p.dtype for p in r.params]),
            "backend_name": backend,
            "iteration": 0,
            "has_error": int(self._error is not None or r.error is not None),
            **logging_data.environment(backend),
        }
        if self._comm_hook_name is not None:
            data["comm_hook"] = self._comm_hook_name
        if self._join_used:
            data["join_uneven_inputs"] = 1
        if r.num_backward:
            data["num_buckets_reduced"] = r.num_buckets_reduced
            data["unused_parameter_size"] = sum(
                r.params[i].numel() * r.params[i].element_size()
                for i in r.unused_in_last_forward())
            # The arrival order recorded for the rebuild (gradring records it once).
            rebuilt_order = [i for idx in r.rebuilt_param_indices for i in idx]
            data["prev_iteration_grad_ready_order_indices"] = logging_data.joined(
                rebuilt_order if r.has_rebuilt else r.arrival_order())
        data.update(self._runtime_stats.fields())
        error = self._error or r.error or self._torch_logger.error()
        if error is not None:
            data["has_error"], data["error"] = 1, error
        return data

    @property
    def logger(self) -> Any:
        """A torch ``dist.Logger`` that torch's helper functions record errors in
        (see [Note: a torch Logger for torch's helper functions] in logging_data.py)."""
        return self._torch_logger.get(self.process_group)

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        if sample_rate < 1:
            self._log_and_throw(ValueError, "DDP runtime logging sample rate should be equal "
                                "or greater than 1")
        self._runtime_stats.set_sample_rate(sample_rate)

    def _set_ddp_sink_clone(self, val: bool) -> None:
        """Whether the outputs are handed out as copies (the default: a loss
        modified in place then works) or as they are (no copy)."""
        self._ddp_sink_clone = val

    def _build_params_for_reducer(self) -> tuple[list[torch.Tensor], list[bool]]:
        """The parameters DDP reduces, each once, and whether each gets sparse gradients."""
        self._assign_modules_buffers()  # as torch's does
        return reducer_params.params_for_reducer(self.module, self.parameters_to_ignore)

    def _build_debug_param_to_name_mapping(self, parameters: list[torch.Tensor],
                                           ) -> dict[int, str]:
        """Index in ``parameters`` -> qualified name, for every parameter DDP reduces."""
        try:
            return reducer_params.index_to_name(self.module, self.parameters_to_ignore,
                                                parameters)
        except ValueError as exc:
            self._log_and_throw(ValueError, str(exc))
            raise  # not reached: _log_and_throw raises

    def _log_and_throw(self, err_type: type[BaseException], err_msg: str) -> None:
        """Record ``err_msg`` for the logging data, then raise it as ``err_type``."""
        self._error = err_msg
        raise err_type(err_msg)

    @property
    def _distributed_rank(self) -> int:
        return self._comm.rank

    def overlap_stats(self, last_n: int = 0) -> dict[str, Any]:
        """Backward/communication overlap over the steady iterations, the newest ``last_n``
        (0: every one recorded; docs/overlap.md)."""
        from gradring.observe.overlap import ddp_overlap_stats

        return ddp_overlap_stats(self, last_n=last_n)

    # ---------------------------------------------------------------- pickling
    def _check_default_group(self) -> None:
        if self.process_group is not dist.group.WORLD:
            raise RuntimeError("DDP Pickling/Unpickling are only supported when using DDP "
                               "with the default process group. That is, when you have "
                               "called init_process_group and have not passed process_group "
                               "argument to DDP constructor")

    def __getstate__(self) -> dict[str, Any]:
        self._check_default_group()
        state = self.__dict__.copy()
        # What holds the group or the reducer is built anew; hooks and fused
        # optimizers, like torch's, are not pickled.
        for key in ("process_group", "_comm", "reducer", "_consumers", "_torch_logger",
                    "_delayed"):
            state.pop(key, None)
        # What the reducer knew and a new one needs.
        state["_static_at_init"] = self.static_graph
        state["_caps_in_force"] = self._caps
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        nn.Module.__setstate__(self, state)
        # As in torch: an unpickled DDP runs over the default group, with a new reducer.
        self.process_group = _group_of(None, None)
        self._comm = GroupComm(self.process_group)
        self._module_parameters = [p for n, p in self.module.named_parameters()
                                   if p.requires_grad and n not in self.parameters_to_ignore]
        self._buffer_sync.refresh(self.module)
        static = self.__dict__.pop("_static_at_init", False)
        self._static_at_init = static
        self._delayed = None  # as torch's: the delayed all-reduce's hook is not pickled
        self._torch_logger = logging_data.TorchLogger()
        caps = self.__dict__.pop("_caps_in_force")
        if self._delay_all_reduce_all_params:
            return  # no reducer, as at construction
        self.reducer = self._build_reducer(caps, static_graph=static)
        self._consumers = ConsumerSlot(self.reducer, self._log_and_throw)
        if static:
            self.reducer.set_static_graph()

    # ---------------------------------------------------------------- dynamo
    @classmethod
    def _get_active_ddp_module(cls) -> Any:
        """The DDP whose forward is running (Dynamo reads it from torch's class)."""
        return TorchDDP._active_ddp_module

    @contextlib.contextmanager
    def _inside_ddp_forward(self) -> Iterator[None]:
        """Announce this DDP as the active one while its module runs, the way
        torch's does, so Dynamo's DDP support sees it."""
        old = TorchDDP._active_ddp_module
        TorchDDP._active_ddp_module = self
        try:
            yield
        finally:
            TorchDDP._active_ddp_module = old

    @compile_split.never_traced(recursive=False)
    def _run_ddp_forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the wrapped module as the active DDP: a frame Dynamo compiles in
        it is split at this DDP's buckets ([Note: compile and the buckets]).
        What _inside_ddp_forward does, written out: contextlib's frames would
        be compiled by Dynamo at the first call (this frame's callees are)."""
        old = TorchDDP._active_ddp_module
        TorchDDP._active_ddp_module = self
        try:
            return self.module(*inputs, **kwargs)
        finally:
            TorchDDP._active_ddp_module = old

    # ------------------------------------------------- data-parallel helpers
    def scatter(self, inputs: Any, kwargs: Any, device_ids: Any) -> Any:
        from torch.nn.parallel.scatter_gather import scatter_kwargs

        return scatter_kwargs(inputs, kwargs, device_ids, self.dim)

    def to_kwargs(self, inputs: Any, kwargs: Any, device_id: Any) -> Any:
        from torch.nn.parallel.scatter_gather import scatter_kwargs

        return scatter_kwargs(inputs, kwargs, [device_id], dim=self.dim)

    def gather(self, outputs: Any, output_device: Any) -> Any:
        from torch.nn.parallel.scatter_gather import gather

        return gather(outputs, output_device, dim=self.dim)

    def train(self, mode: bool = True) -> Any:
        nn.Module.train(self, mode)
        return self

    # ------------------------------------ torch-internal: no gradring counterpart
    _register_accum_grad_hook = _not_supported("_register_accum_grad_hook")
    _fire_reducer_autograd_hook = _not_supported("_fire_reducer_autograd_hook")
    _root_copy_hook = _not_supported("_root_copy_hook")
    _module_wait_for_copy_hook = _not_supported("_module_wait_for_copy_hook")
    _ddp_init_helper = _not_supported("_ddp_init_helper")
    _match_unused_params_allreduce = _not_supported("_match_unused_params_allreduce")
    _set_sparse_metadata = _not_supported("_set_sparse_metadata")
    _update_process_group = _not_supported("_update_process_group")


def _buffer_flags(broadcast_buffers: bool | None,
                  forward_sync_buffers: bool | None) -> tuple[bool, bool]:
    """(forward_sync_buffers, whether the construction syncs buffers), the way
    torch 2.13 derives them from its two arguments."""
    if broadcast_buffers is not None:
        warnings.warn(errors.broadcast_buffers_deprecated(
            both=forward_sync_buffers is not None), FutureWarning, stacklevel=4)
    if forward_sync_buffers is not None:
        return forward_sync_buffers, True
    effective = True if broadcast_buffers is None else bool(broadcast_buffers)
    return effective, effective
