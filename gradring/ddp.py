"""gradring.DistributedDataParallel: construction, forward pre/post, no_sync, hooks.

The class is a subclass of ``torch.nn.parallel.DistributedDataParallel`` so
that code checking ``isinstance(m, DistributedDataParallel)`` takes its DDP
path (Lightning, Accelerate, Dynamo, distributed checkpoint do). See [Note:
type identity] in ``ddp_surface.py``: torch's ``__init__`` never runs and every
method torch's class defines is overridden here or there. The averaging is
done by gradring's own Reducer (reducer.py); this file decides *when* the
reducer is told what, mirroring torch's DDP so a user switches by one import.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradring import compile as compile_split
from gradring import errors
from gradring.buckets import DEFAULT_BUCKET_CAP_MB, BucketCaps
from gradring.ddp_surface import TorchDDP, TorchSurface
from gradring.graph import GraphMode, iter_tensors
from gradring.group_comm import GroupComm
from gradring.join import DDPJoinHook, Joinable, global_flag, last_joiner_rank
from gradring.observe.trace import profiled
from gradring.output_boundary import wrap_outputs
from gradring.reducer import CommHook, Reducer, autocap

__all__ = ["DistributedDataParallel"]


def _move_to(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _move_to(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_move_to(v, device) for v in obj)
    return obj


def bucket_caps(bucket_cap_mb: Any, bucket_cap_mb_list: list[int] | None = None,
                ) -> tuple[BucketCaps, bool]:
    """The constructor's caps, and whether ``"auto"`` picks the cap at the rebuild."""
    auto = autocap.is_auto(bucket_cap_mb) and not bucket_cap_mb_list
    if autocap.is_auto(bucket_cap_mb):
        bucket_cap_mb = None
    if bucket_cap_mb is not None and (
            isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float))
            or bucket_cap_mb <= 0):
        raise ValueError(errors.bad_bucket_cap(bucket_cap_mb))
    return BucketCaps.from_args(bucket_cap_mb, bucket_cap_mb_list), auto


def bucket_cap_bytes(bucket_cap_mb: Any, bucket_cap_mb_list: list[int] | None = None,
                     ) -> tuple[int, bool]:
    """The constructor's cap in bytes, and whether ``"auto"`` picks it at the rebuild."""
    caps, auto = bucket_caps(bucket_cap_mb, bucket_cap_mb_list)
    return caps.cap, auto


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


class DistributedDataParallel(TorchSurface, TorchDDP):
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
        Joinable.__init__(self)
        unsupported = {
            "delay_all_reduce_named_params": delay_all_reduce_named_params is not None,
            "param_to_hook_all_reduce": param_to_hook_all_reduce is not None,
            "mixed_precision": mixed_precision is not None,
            "skip_all_reduce_unused_params": bool(skip_all_reduce_unused_params),
            "batched_grad_copy": bool(batched_grad_copy),
        }
        for name, given in unsupported.items():
            if given:
                raise NotImplementedError(errors.unsupported_argument(name))
        # The error DDP last raised, for _get_ddp_logging_data (as torch's logger keeps it).
        self._error: str | None = None
        # Group the gradients are averaged over.
        self.process_group = _group_of(process_group, device_mesh)
        if device_mesh is not None:
            self.device_mesh = device_mesh
        if check_reduction:
            warnings.warn(errors.check_reduction_deprecated(), FutureWarning, stacklevel=2)
        if device_ids is not None and len(device_ids) > 1:
            self._log_and_throw(ValueError, errors.too_many_device_ids())
        # Names (module-relative) of parameters and buffers DDP leaves alone.
        self.parameters_to_ignore: set[str] = set(
            getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        named = [(n, p) for n, p in module.named_parameters()
                 if p.requires_grad and n not in self.parameters_to_ignore]
        if not named:
            self._log_and_throw(RuntimeError, errors.no_trainable_params())
        devices = {str(p.device) for _, p in named}
        if len(devices) > 1:
            self._log_and_throw(ValueError, errors.mixed_devices([str(p.device)
                                                                  for _, p in named]))
        # The wrapped module; state_dict keys get the usual "module." prefix.
        self.module = module
        # The single device every parameter lives on.
        self.device = named[0][1].device
        self.device_type = self.device.type
        if device_ids is not None and self.device.type == "cpu":
            self._log_and_throw(ValueError,
                                errors.device_ids_on_cpu(device_ids, output_device, devices))
        # Where inputs are moved before forward (torch moves them for device_ids).
        self.device_ids = None if device_ids is None else [torch.device(self.device)]
        self.output_device = output_device
        self.dim = dim
        self._comm = GroupComm(self.process_group)
        self._warned_unordered_hook = False
        # Buffers: broadcast rank 0's before each forward (forward_sync_buffers;
        # broadcast_buffers is torch 2.13's deprecated name for it).
        init_sync_buffers = self._buffer_flags(broadcast_buffers, forward_sync_buffers)
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        # Set by no_sync(): when False, backward only accumulates locally.
        self.require_backward_grad_sync = True
        # Whether the next forward syncs buffers (torch's require_forward_param_sync).
        self.require_forward_param_sync = True
        # Bucket caps as torch 2.13 derives them; the byte cap is reported by the reducer.
        self._caps, self._auto_cap = bucket_caps(bucket_cap_mb, bucket_cap_mb_list)
        self.bucket_bytes_cap_list = list(self._caps.per_bucket)
        # Bucket size of the buffer and init broadcasts (torch's attribute; ours
        # coalesces per dtype).
        self.broadcast_bucket_size = 250 * 1024 * 1024
        self._param_names = [n for n, _ in named]
        self._module_parameters = [p for _, p in named]
        self._assign_modules_buffers()
        if init_sync:
            self._verify_same_model(self._module_parameters)
            self._comm.broadcast_coalesced(
                [p.data for n, p in module.named_parameters()
                 if n not in self.parameters_to_ignore]
                + (self.modules_buffers if init_sync_buffers else []))
        self._static_at_init = static_graph
        self.reducer = self._build_reducer(static_graph=static_graph)
        if self._auto_cap and self.reducer.mode is GraphMode.FIND_UNUSED and not static_graph:
            warnings.warn(errors.auto_cap_without_rebuild(DEFAULT_BUCKET_CAP_MB), stacklevel=2)
        # Join: average over the initial world size, not over the ranks still training.
        self.divide_by_initial_world_size = True
        self._has_comm_hook = False
        self._fused_optim: Any = None
        self._lazy_init_ran = False
        if static_graph:
            self._set_static_graph()

    def _build_reducer(self, *, static_graph: bool) -> Reducer:
        find_unused = self.find_unused_parameters and not static_graph
        return Reducer(
            self._module_parameters, self._param_names, self._comm, caps=self._caps,
            initial_caps=self._caps.initial(find_unused=find_unused),
            mode=GraphMode.of(find_unused=self.find_unused_parameters, static_graph=False),
            gradient_as_bucket_view=self.gradient_as_bucket_view, auto_cap=self._auto_cap,
        )

    def _buffer_flags(self, broadcast_buffers: bool | None,
                      forward_sync_buffers: bool | None) -> bool:
        """Set forward_sync_buffers the way torch 2.13 does; returns whether to sync at init."""
        if broadcast_buffers is not None:
            warnings.warn(errors.broadcast_buffers_deprecated(
                both=forward_sync_buffers is not None), FutureWarning, stacklevel=3)
        if forward_sync_buffers is not None:
            self.forward_sync_buffers = forward_sync_buffers
            return True
        effective = True if broadcast_buffers is None else bool(broadcast_buffers)
        self.forward_sync_buffers = effective
        return effective

    # ------------------------------------------------------------ construction
    def _verify_same_model(self, params: list[torch.Tensor]) -> None:
        """Every rank checks every rank against rank 0, so all of them raise together."""
        meta = [(tuple(p.shape), tuple(p.stride())) for p in params]
        everyone = self._comm.all_gather_object((meta, self._param_names))
        counts = [len(m) for m, _ in everyone]
        if any(c != counts[0] for c in counts):
            self._log_and_throw(RuntimeError, errors.param_count_mismatch(counts))
        ref = everyone[0][0]
        for rank, (theirs, names) in enumerate(everyone):
            for i, ((shape, stride), (rshape, rstride)) in enumerate(zip(theirs, ref)):
                for what, mine, want in (("sizes", shape, rshape), ("strides", stride, rstride)):
                    if mine != want:
                        self._log_and_throw(RuntimeError, errors.param_shape_mismatch(
                            i, names[i], what, mine, want, rank))

    @property
    def static_graph(self) -> bool:
        """Whether the graph is declared the same every iteration (stored by the reducer)."""
        return self.reducer.static_graph

    @property
    def bucket_bytes_cap(self) -> int:
        """The bucket cap in bytes (what bucket_cap_mb="auto" chose, once it has)."""
        return self.reducer.bucket_cap_bytes

    def _set_static_graph(self) -> None:
        """Declare that the graph is the same every iteration (docs/design.md)."""
        if self.static_graph:
            warnings.warn(errors.static_graph_twice(), stacklevel=2)
            return
        try:
            self.reducer.set_static_graph()
        except RuntimeError as exc:
            self._log_and_throw(RuntimeError, str(exc))

    # ----------------------------------------------------------------- forward
    # Under torch.compile Dynamo never traces this frame (frames it calls still
    # may be compiled) nor the bookkeeping before and after; the wrapped module
    # is compiled as a frame of its own, split at the buckets (see [Note:
    # compile and the buckets] in compile.py).
    @compile_split.never_traced(recursive=False)
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        compile_split.install()
        trace = self.reducer.trace  # forward marks for gradring.explain (observe/explain.py)
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
        sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        if self._join_config.enable:
            DDPJoinHook.notify(self)
            # Tells joined ranks whether this iteration reduces gradients.
            global_flag(self._comm, sync, self.device)
        if sync:
            self._guarded(self.reducer.prepare_for_forward)
            if self.reducer.rebuild_if_needed():
                compile_split.after_rebuild(self)
                self._warn_unordered_hook()
        else:
            if torch.is_grad_enabled():
                # Under no_sync too: the previous reducing backward must have finished.
                self._guarded(self.reducer.check_prior_finished)
            self.reducer.note_unsynced_forward()
        if self._check_sync_bufs_pre_fwd():
            self._sync_buffers(active=True)
        if self.device_ids:
            inputs = _move_to(inputs, self.device_ids[0])
            kwargs = _move_to(kwargs, self.device_ids[0])
        return inputs, kwargs

    @compile_split.never_traced(recursive=True)
    def _post_forward(self, output: Any) -> Any:
        """After the module ran: prepare the reducer for the backward to come.
        The sync flag is read again, as torch does: code inside the module's
        forward may have entered no_sync() (Lightning's manual optimization)."""
        sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        if self._check_sync_bufs_post_fwd():
            self._sync_buffers(active=True)
        self.require_forward_param_sync = sync
        if not sync:
            return output
        find_unused = self.reducer.mode is GraphMode.FIND_UNUSED
        self.reducer.prepare_for_backward(list(iter_tensors(output)) if find_unused else None)
        if find_unused or self.reducer.static_first_backward():
            output = wrap_outputs(output, self.reducer)
        return output

    def _guarded(self, fn: Any, *args: Any) -> Any:
        """Run a reducer step; an error it raises is recorded for the logging data."""
        try:
            return fn(*args)
        except Exception as exc:
            self._error = str(exc)
            raise

    # ------------------------------------------------------------------- sync
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first backward after leaving reduces the sum."""
        if self._fused_optim is not None:
            raise RuntimeError(errors.no_sync_with_fused_optim())
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    # ------------------------------------------------------------------ hooks
    def register_comm_hook(self, state: object, hook: CommHook) -> None:
        """Replace the bucket all-reduce by ``hook(state, bucket) -> Future[Tensor]``."""
        self._check_comm_hook(hook)
        if self._has_comm_hook:
            self._log_and_throw(RuntimeError, errors.comm_hook_twice())
        if self._fused_optim is not None:
            self._log_and_throw(RuntimeError, errors.comm_hook_with_fused_optim())
        self._has_comm_hook = True
        self.reducer.set_comm_hook(hook, state)
        self._warn_unordered_hook()

    def _warn_unordered_hook(self) -> None:
        """Once, when torch's PowerSGD hook meets several buckets on gloo (see
        docs/hooks.md); checked at registration and after the bucket rebuild."""
        hook = self.reducer.comm_hook
        if hook is None or self._warned_unordered_hook or not _unordered_torch_hook(hook) \
                or len(self.reducer.buckets) < 2 \
                or dist.get_backend(self.process_group) != "gloo":
            return
        self._warned_unordered_hook = True
        warnings.warn(errors.torch_power_sgd_on_gloo(hook.__name__), stacklevel=3)

    def _register_fused_optim(self, optim_cls: type, *args: Any, **kwargs: Any) -> Any:
        """Step each parameter as soon as its bucket is reduced; returns the fused optimizer."""
        from gradring.fused_optim import attach_fused_optimizer

        if self._fused_optim is not None:
            self._log_and_throw(RuntimeError, errors.fused_optim_twice())
        if self._has_comm_hook:
            self._log_and_throw(RuntimeError, errors.fused_optim_with_comm_hook())
        self._fused_optim = attach_fused_optimizer(self.reducer, optim_cls, *args, **kwargs)
        return self._fused_optim

    # ------------------------------------------------------------------- join
    def join_hook(self, **kwargs: Any) -> DDPJoinHook:
        return DDPJoinHook(self, **kwargs)

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self) -> Any:
        return self.process_group

    def set_join_division(self, *, initial: bool) -> None:
        self.divide_by_initial_world_size = initial
        if initial:
            self.reducer.set_divide_factor(self._comm.world_size)

    def shadow_iteration(self) -> None:
        """A joined rank mirrors one training iteration of the others ([Note: shadowing])."""
        should_sync = global_flag(self._comm, False, self.device)
        if should_sync:
            self.reducer.rebuild_if_needed()
        if self.will_sync_module_buffers():
            self._sync_buffers(active=False)
        self.require_forward_param_sync = should_sync
        if should_sync:
            self.reducer.shadow_backward()

    def _sync_buffers(self, *, active: bool = True) -> None:
        """Sync buffers before (or after) a forward. Under Join the source is the
        highest rank still training (as torch does); otherwise rank 0. Buffers
        are read from the module each time: a reassigned one is the one sent."""
        if not self.will_sync_module_buffers():
            return
        src = 0
        if self._join_config.enable:
            src = last_joiner_rank(self._comm, active, self.device)
        self._assign_modules_buffers()
        self._sync_module_buffers(src)

    def sync_final_model(self, *, is_last_joiner: bool) -> None:
        """After everyone joined: the last joiner's parameters and buffers win."""
        src = last_joiner_rank(self._comm, is_last_joiner, self.device)
        self._assign_modules_buffers()
        self._comm.broadcast_coalesced(
            [p.data for n, p in self.module.named_parameters()
             if n not in self.parameters_to_ignore] + self.modules_buffers, src=src)

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Any:
        from gradring.join import Join

        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    # -------------------------------------------------------------- introspection
    def _get_ddp_logging_data(self) -> dict[str, Any]:
        r = self.reducer
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
            "has_rebuilt_buckets": int(r.has_rebuilt),
            "bucket_sizes": list(r.initial_bucket_sizes),
            "rebuilt_bucket_sizes": list(r.rebuilt_bucket_sizes),
            "rebuilt_per_bucket_param_indices": [list(x) for x in r.rebuilt_param_indices],
            "num_parameter_tensors": len(r.params),
            "total_parameter_size_bytes": sum(p.numel() * p.element_size() for p in r.params),
            "dtypes": sorted({str(p.dtype).replace("torch.", "") for p in r.params}),
            "comm_hook": "" if r.comm_hook is None else getattr(r.comm_hook, "__qualname__", ""),
            "backend_name": dist.get_backend(self.process_group),
            "iteration": r.num_backward,
            "has_error": int(self._error is not None or r.error is not None),
        }
        error = self._error or r.error
        if error is not None:
            data["error"] = error
        return data

    def overlap_stats(self, last_n: int = 10) -> dict[str, Any]:
        """Backward/communication overlap of the last ``last_n`` iterations (docs/overlap.md)."""
        from gradring.observe.overlap import ddp_overlap_stats

        return ddp_overlap_stats(self, last_n=last_n)

    # ---------------------------------------------------------------- pickling
    def __getstate__(self) -> dict[str, Any]:
        self._check_default_group()
        state = self.__dict__.copy()
        for key in ("process_group", "_comm", "reducer", "_buffer_walk"):
            state.pop(key, None)
        # What the reducer knew and a new one needs; hooks and fused optimizers,
        # like torch's, are not pickled.
        state["_static_at_init"] = self.static_graph
        state["_has_comm_hook"] = False
        state["_fused_optim"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        nn.Module.__setstate__(self, state)
        # As in torch: an unpickled DDP runs over the default group, with a new reducer.
        self.process_group = _group_of(None, None)
        self._comm = GroupComm(self.process_group)
        self._warned_unordered_hook = False
        self._module_parameters = [p for n, p in self.module.named_parameters()
                                   if p.requires_grad and n not in self.parameters_to_ignore]
        self._assign_modules_buffers()
        static = self.__dict__.pop("_static_at_init", False)
        self._static_at_init = static
        self.reducer = self._build_reducer(static_graph=static)
        if static:
            self.reducer.set_static_graph()


def _unordered_torch_hook(hook: Any) -> bool:
    """Torch's PowerSGD hooks, which issue a second all-reduce from inside the
    first one's callback and wait for it there (see docs/hooks.md)."""
    return (getattr(hook, "__module__", "")
            == "torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook"
            and getattr(hook, "__name__", "") in ("powerSGD_hook", "batched_powerSGD_hook"))
