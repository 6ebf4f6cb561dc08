"""gradring.DistributedDataParallel: construction, forward pre/post, no_sync, hooks.

A plain ``nn.Module`` wrapping the user's module. The gradient averaging is
done by gradring's own Reducer (reducer.py); this file decides *when* the
reducer is told what, mirroring torch's DDP so a user switches by one import.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradring import autocap, errors
from gradring.buckets import DEFAULT_BUCKET_CAP_MB, DEFAULT_FIRST_BUCKET_BYTES, MIB
from gradring.graph import GraphMode, iter_tensors
from gradring.group_comm import GroupComm
from gradring.join import DDPJoinHook, Joinable, global_flag, last_joiner_rank
from gradring.output_boundary import wrap_outputs
from gradring.reducer import CommHook, Reducer

__all__ = ["DistributedDataParallel"]


def _move_to(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _move_to(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_move_to(v, device) for v in obj)
    return obj


def bucket_cap_bytes(bucket_cap_mb: Any, bucket_cap_mb_list: list[int] | None = None,
                     ) -> tuple[int, bool]:
    """The constructor's cap in bytes, and whether ``"auto"`` picks it at the rebuild."""
    if bucket_cap_mb_list:
        return int(max(bucket_cap_mb_list) * MIB), False
    auto = autocap.is_auto(bucket_cap_mb)
    if bucket_cap_mb is None or auto:
        bucket_cap_mb = DEFAULT_BUCKET_CAP_MB
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) \
            or bucket_cap_mb <= 0:
        raise ValueError(errors.bad_bucket_cap(bucket_cap_mb))
    return int(bucket_cap_mb * MIB), auto


class DistributedDataParallel(nn.Module, Joinable):
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
        broadcast_buffers: bool = True,
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
        nn.Module.__init__(self)
        Joinable.__init__(self)
        unsupported = {
            "delay_all_reduce_named_params": delay_all_reduce_named_params is not None,
            "param_to_hook_all_reduce": param_to_hook_all_reduce is not None,
            "mixed_precision": mixed_precision is not None,
            "device_mesh": device_mesh is not None,
            "skip_all_reduce_unused_params": bool(skip_all_reduce_unused_params),
            "batched_grad_copy": bool(batched_grad_copy),
        }
        for name, given in unsupported.items():
            if given:
                raise NotImplementedError(errors.unsupported_argument(name))
        if check_reduction:
            warnings.warn(errors.check_reduction_deprecated(), FutureWarning, stacklevel=2)
        if not dist.is_available() or not dist.is_initialized():
            raise errors.NotInitializedError(errors.not_initialized())
        if device_ids is not None and len(device_ids) > 1:
            raise ValueError(errors.too_many_device_ids())

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise RuntimeError(errors.no_trainable_params())
        devices = {str(p.device) for _, p in named}
        if len(devices) > 1:
            raise ValueError(errors.mixed_devices([str(p.device) for _, p in named]))
        # The wrapped module; state_dict keys get the usual "module." prefix.
        self.module = module
        # The single device every parameter lives on.
        self.device = named[0][1].device
        if device_ids is not None and self.device.type == "cpu":
            raise ValueError(errors.device_ids_on_cpu(device_ids, output_device, devices))
        # Where inputs are moved before forward (torch moves them for device_ids).
        self.device_ids = None if device_ids is None else [torch.device(self.device)]
        self.output_device = output_device
        self.dim = dim
        # Group the gradients are averaged over (default group when None).
        self.process_group = process_group if process_group is not None \
            else dist.group.WORLD
        self._comm = GroupComm(self.process_group)
        # Broadcast rank 0's buffers before each forward (torch's broadcast_buffers).
        self.broadcast_buffers = broadcast_buffers if forward_sync_buffers is None \
            else forward_sync_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        # Set by no_sync(): when False, backward only accumulates locally.
        self.require_backward_grad_sync = True
        # Whether the next forward syncs buffers (torch's require_forward_param_sync).
        self.require_forward_param_sync = True
        self.bucket_bytes_cap, auto_cap = bucket_cap_bytes(bucket_cap_mb, bucket_cap_mb_list)
        self._param_names = [n for n, _ in named]
        params = [p for _, p in named]
        self._module_buffers = [b for _, b in module.named_buffers()]

        if init_sync:
            self._verify_same_model(params)
            self._comm.broadcast_coalesced(
                [p.data for p in module.parameters()]
                + (self._module_buffers if broadcast_buffers is not False else [])
            )

        mode = GraphMode.of(find_unused=find_unused_parameters, static_graph=static_graph)
        # The first bucket is small (1 MiB) only when bucket_cap_mb is left at
        # its default; an explicit cap is every bucket's cap, as in torch 2.13.
        first_bucket_bytes = DEFAULT_FIRST_BUCKET_BYTES \
            if bucket_cap_mb is None or auto_cap else self.bucket_bytes_cap
        rebuild_caps = None
        if bucket_cap_mb_list:
            initial_caps = rebuild_caps = [int(c * MIB) for c in bucket_cap_mb_list]
        elif mode is GraphMode.FIND_UNUSED:
            initial_caps = [first_bucket_bytes, self.bucket_bytes_cap]
        else:
            initial_caps = [sys.maxsize]
        # static_graph=True is applied below through _set_static_graph(), as torch does.
        self.reducer = Reducer(
            params, self._param_names, self._comm,
            bucket_cap_bytes=self.bucket_bytes_cap, initial_caps=initial_caps,
            mode=GraphMode.of(find_unused=find_unused_parameters, static_graph=False),
            gradient_as_bucket_view=gradient_as_bucket_view, auto_cap=auto_cap,
            first_bucket_bytes=first_bucket_bytes, rebuild_caps=rebuild_caps,
        )
        if auto_cap and mode is GraphMode.FIND_UNUSED:
            warnings.warn(errors.auto_cap_without_rebuild(DEFAULT_BUCKET_CAP_MB), stacklevel=2)
        # Join: average over the initial world size, not over the ranks still training.
        self.divide_by_initial_world_size = True
        self._has_comm_hook = False
        self._fused_optim: Any = None
        if static_graph:
            self._set_static_graph()

    # ------------------------------------------------------------ construction
    def _verify_same_model(self, params: list[torch.Tensor]) -> None:
        """Every rank checks every rank against rank 0, so all of them raise together."""
        meta = [(tuple(p.shape), tuple(p.stride())) for p in params]
        everyone = self._comm.all_gather_object((meta, self._param_names))
        counts = [len(m) for m, _ in everyone]
        if any(c != counts[0] for c in counts):
            raise RuntimeError(errors.param_count_mismatch(counts))
        ref = everyone[0][0]
        for rank, (theirs, names) in enumerate(everyone):
            for i, ((shape, stride), (rshape, rstride)) in enumerate(zip(theirs, ref)):
                for what, mine, want in (("sizes", shape, rshape), ("strides", stride, rstride)):
                    if mine != want:
                        raise RuntimeError(errors.param_shape_mismatch(
                            i, names[i], what, mine, want, rank))

    @property
    def static_graph(self) -> bool:
        """Whether the graph is declared the same every iteration (stored by the reducer)."""
        return self.reducer.static_graph

    def _set_static_graph(self) -> None:
        """Declare that the graph is the same every iteration (docs/design.md)."""
        if self.static_graph:
            warnings.warn(errors.static_graph_twice(), stacklevel=2)
            return
        self.reducer.set_static_graph()

    # ----------------------------------------------------------------- forward
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        with torch.autograd.profiler.record_function("gradring::forward"):
            sync = torch.is_grad_enabled() and self.require_backward_grad_sync
            if self._join_config.enable:
                DDPJoinHook.notify(self)
                # Tells joined ranks whether this iteration reduces gradients.
                global_flag(self._comm, sync, self.device)
            if sync:
                self.reducer.prepare_for_forward()
                if self.reducer.rebuild_if_needed():
                    self.bucket_bytes_cap = self.reducer.bucket_cap_bytes  # "auto" decided
            else:
                if torch.is_grad_enabled():
                    self.reducer.check_prior_finished()
                self.reducer.note_unsynced_forward()
            self._sync_buffers(active=True)
            if self.device_ids:
                inputs = _move_to(inputs, self.device_ids[0])
                kwargs = _move_to(kwargs, self.device_ids[0])
            out = self.module(*inputs, **kwargs)
            return self._post_forward(out, sync)

    def _post_forward(self, out: Any, sync: bool) -> Any:
        # Read again: the wrapped forward may have turned sync off (Lightning's
        # manual optimization does, having reduced inside the forward).
        sync = sync and self.require_backward_grad_sync
        self.require_forward_param_sync = sync
        if not sync:
            return out
        find_unused = self.reducer.mode is GraphMode.FIND_UNUSED
        self.reducer.prepare_for_backward(list(iter_tensors(out)) if find_unused else None)
        if find_unused or self.reducer.static_first_backward():
            out = wrap_outputs(out, self.reducer)
        return out

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
        if not callable(hook):
            raise TypeError(errors.hook_not_callable(hook))
        if self._has_comm_hook:
            raise RuntimeError(errors.comm_hook_twice())
        if self._fused_optim is not None:
            raise RuntimeError(errors.comm_hook_with_fused_optim())
        self._has_comm_hook = True
        self.reducer.set_comm_hook(hook, state)

    def _register_fused_optim(self, optim_cls: type, *args: Any, **kwargs: Any) -> Any:
        """Step each parameter as soon as its bucket is reduced; returns the fused optimizer."""
        from gradring.fused_optim import attach_fused_optimizer

        if self._fused_optim is not None:
            raise RuntimeError(errors.fused_optim_twice())
        if self._has_comm_hook:
            raise RuntimeError(errors.fused_optim_with_comm_hook())
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
            if self.reducer.rebuild_if_needed():
                self.bucket_bytes_cap = self.reducer.bucket_cap_bytes
        self._sync_buffers(active=False)
        self.require_forward_param_sync = should_sync
        if should_sync:
            self.reducer.shadow_backward()

    def _sync_buffers(self, *, active: bool) -> None:
        """Broadcast buffers before a forward. Under Join the source is the highest
        rank still training (as torch does); otherwise rank 0."""
        if not (self.require_forward_param_sync and self.broadcast_buffers):
            return
        buffers = self._current_buffers()
        if not buffers:
            return
        src = 0
        if self._join_config.enable:
            src = last_joiner_rank(self._comm, active, self.device)
        self._comm.broadcast_coalesced(buffers, src=src)

    def _current_buffers(self) -> list[torch.Tensor]:
        """The module's buffers as they are now: a buffer reassigned since
        construction (``module.buf = module.buf + 1``) is the new tensor."""
        ignored = getattr(self, "parameters_to_ignore", None) or ()
        return [b for n, b in self.module.named_buffers() if n not in ignored]

    def sync_final_model(self, *, is_last_joiner: bool) -> None:
        """After everyone joined: the last joiner's parameters and buffers win."""
        src = last_joiner_rank(self._comm, is_last_joiner, self.device)
        self._comm.broadcast_coalesced(
            [p.data for p in self.module.parameters()] + self._current_buffers(), src=src)

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Any:
        from gradring.join import Join

        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    # -------------------------------------------------------------- introspection
    def _get_ddp_logging_data(self) -> dict[str, Any]:
        r = self.reducer
        return {
            "world_size": self._comm.world_size,
            "rank": self._comm.rank,
            "module_name": type(self.module).__name__,
            "device_ids": "" if not self.device_ids else str(self.device_ids[0]),
            "output_device": -1 if self.output_device is None else self.output_device,
            "broadcast_buffers": int(bool(self.broadcast_buffers)),
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
        }

    def overlap_stats(self, last_n: int = 10) -> dict[str, Any]:
        """Backward/communication overlap of the last ``last_n`` iterations (docs/overlap.md)."""
        from gradring.observe.overlap import ddp_overlap_stats

        return ddp_overlap_stats(self, last_n=last_n)

    # ---------------------------------------------------------------- pickling
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for key in ("process_group", "_comm", "reducer"):
            state.pop(key, None)
        state["_has_comm_hook"] = False
        state["_fused_optim"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.process_group = dist.group.WORLD if dist.is_initialized() else None
        self._comm = None
        self.reducer = None
