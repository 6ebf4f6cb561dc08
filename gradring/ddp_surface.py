"""torch DDP's semi-private surface, as libraries and user code call it.

[Note: type identity]
``gradring.DistributedDataParallel`` subclasses torch's class, so
``isinstance(m, torch.nn.parallel.DistributedDataParallel)`` holds and
libraries take their DDP paths. On these terms:

- torch's ``__init__`` never runs, so no C++ ``Reducer``, ``Logger`` or
  ``_DDPSink`` is ever created;
- every callable attribute of torch 2.13's class is overridden, here or in
  ``ddp.py``: implemented with torch's meaning on top of gradring's own
  reducer, or, for torch-internal machinery gradring has no counterpart of,
  raising ``NotImplementedError`` that names it (``tests/test_ddp_identity.py``
  walks torch's class and checks it);
- nothing inherited from torch's class is ever called.

The mixin below holds that surface; ``ddp.py`` holds construction, forward,
hooks, Join and pickling. Everything here reads or sets the DDP object's own
state and reaches the reducer only through its methods.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import distributed as _torch_distributed

from gradring import errors
from gradring.buffer_sync import BufferWalk
from gradring.compile import never_traced
from gradring.join import global_flag, last_joiner_rank

#: torch's class, captured at import time (``gradring.install()`` may later
#: rebind the public names; this stays the original).
TorchDDP = _torch_distributed.DistributedDataParallel
#: Where a buffer comm hook runs, torch's enum itself.
BufferCommHookLocation = _torch_distributed._BufferCommHookLocation


def _not_supported(name: str) -> Any:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(errors.torch_internal(name))
    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"torch-internal ``{name}``: gradring has no counterpart (raises)."
    return method


class TorchSurface:
    """The part of torch's DDP class that code outside DDP calls (see [Note: type identity])."""

    # ------------------------------------------------------------ buffers flag
    @property
    def broadcast_buffers(self) -> bool:
        """torch 2.13's deprecated name for ``forward_sync_buffers``."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

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

    # ---------------------------------------------------------------- buffers
    def _assign_modules_buffers(self) -> None:
        """Read the module's buffers anew (a reassigned buffer is the one synced);
        the walk is skipped while the module tree is unchanged (see [Note:
        buffer sync per forward] in ``buffer_sync.py``)."""
        walk = self.__dict__.get("_buffer_walk")
        if walk is None or walk.root is not self.module:
            walk = self._buffer_walk = BufferWalk(self.module, self.parameters_to_ignore)
        if walk.read() or "modules_buffers" not in self.__dict__:
            self.modules_buffers = list(walk.buffers)
            self.named_module_buffers = dict(walk.named)

    def will_sync_module_buffers(self) -> bool:
        return bool(self.require_forward_param_sync and self.forward_sync_buffers
                    and len(self.modules_buffers) > 0)

    def _check_sync_bufs_pre_fwd(self) -> bool:
        hook = getattr(self, "buffer_hook", None)
        return self.will_sync_module_buffers() and (
            hook is None
            or hook.buffer_comm_hook_location is BufferCommHookLocation.PRE_FORWARD)

    def _check_sync_bufs_post_fwd(self) -> bool:
        hook = getattr(self, "buffer_hook", None)
        return self.will_sync_module_buffers() and hook is not None and \
            hook.buffer_comm_hook_location is BufferCommHookLocation.POST_FORWARD

    def _register_buffer_comm_hook(self, state: Any, hook: Any,
                                   comm_hook_location: Any = BufferCommHookLocation.POST_FORWARD,
                                   ) -> None:
        """Sync buffers with ``hook(state, {name: buffer})`` instead of a broadcast
        from rank 0. Futures the hook returns are waited for at the end of backward."""
        if not callable(hook):
            raise AssertionError(errors.buffer_hook_not_callable(hook))
        self.buffer_hook = _torch_distributed._BufferCommHook(
            buffer_comm_hook=hook, buffer_comm_hook_state=state,
            buffer_comm_hook_location=comm_hook_location)

    def _sync_module_buffers(self, authoritative_rank: int) -> None:
        hook = getattr(self, "buffer_hook", None)
        if hook is None:
            self._default_broadcast_coalesced(None, None, authoritative_rank)
            return
        futures = hook.buffer_comm_hook(hook.buffer_comm_hook_state, self.named_module_buffers)
        if futures is not None:
            self.reducer.install_post_backward_futures(list(futures))

    def _default_broadcast_coalesced(self, bufs: list[torch.Tensor] | None = None,
                                     bucket_size: int | None = None,
                                     authoritative_rank: int = 0) -> None:
        """Broadcast ``bufs`` (default: the module's buffers) from ``authoritative_rank``."""
        if bufs is None:
            bufs = self.modules_buffers
        if bufs is self.modules_buffers:
            # The per-forward sync: its layout is kept for the next forward.
            with torch.no_grad():
                self._comm.broadcast_coalesced(bufs, src=authoritative_rank, reuse=True)
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

    def _find_common_rank(self, input_rank: int, rank_cond: bool) -> int:
        """The highest rank for which ``rank_cond`` holds (Join's buffer source)."""
        rank = last_joiner_rank(self._comm, rank_cond, self.device)
        if rank < 0:
            raise ValueError("No rank satisfies the condition: every rank passed False.")
        return rank

    def _check_and_sync_module_buffers(self) -> None:
        """A joined rank's buffer sync, in step with the ranks still training."""
        if self._check_sync_bufs_pre_fwd():
            self._sync_buffers(active=False)

    # -------------------------------------------------------------------- join
    def _check_global_requires_backward_grad_sync(self, is_joined_rank: bool) -> Any:
        """Whether any rank reduces in this iteration (Join's sync flag)."""
        wants = (not is_joined_rank) and self.require_backward_grad_sync
        return torch.tensor(int(global_flag(self._comm, wants, self.device)))

    def _match_all_reduce_for_bwd_pass(self) -> None:
        """A joined rank's backward collectives, with zero gradients."""
        self.reducer.shadow_backward()

    def _sync_final_model(self, is_last_joiner: bool) -> None:
        self.sync_final_model(is_last_joiner=is_last_joiner)

    # ---------------------------------------------------------------- reducer
    def _remove_autograd_hooks(self) -> None:
        """Remove the reducer's gradient hooks (a new DDP on the same module then works)."""
        self.reducer.remove_hooks()

    def _check_reducer_finalized(self) -> None:
        """Raise if the last synchronised backward did not finish its reduction."""
        if self.reducer.require_finalize:
            raise RuntimeError(errors.reducer_not_finalized())

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        if sample_rate < 1:
            self._log_and_throw(ValueError, "DDP runtime logging sample rate should be equal "
                                "or greater than 1")
        # gradring's trace records every iteration; the rate is kept for the logging data.
        self._logging_sample_rate = sample_rate

    def _log_and_throw(self, err_type: type[BaseException], err_msg: str) -> None:
        """Record ``err_msg`` for the logging data, then raise it as ``err_type``."""
        self._error = err_msg
        raise err_type(err_msg)

    def _check_default_group(self) -> None:
        if self.process_group is not dist.group.WORLD:
            raise RuntimeError("DDP Pickling/Unpickling are only supported when using DDP "
                               "with the default process group. That is, when you have "
                               "called init_process_group and have not passed process_group "
                               "argument to DDP constructor")

    @property
    def _distributed_rank(self) -> int:
        return self._comm.rank

    # ------------------------------------------------------------- comm hooks
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

    def _passing_sync_batchnorm_handle(self, module: nn.Module) -> None:
        """torch refuses SyncBatchNorm on CPU; gradring's works there, so nothing to check."""

    # -------------------------------------------------------- lazy init, optim
    def _lazy_init(self) -> None:
        """Once, at the first forward: optimizers registered to run in backward."""
        self._lazy_init_ran = True
        self._setup_in_backward_optimizers()

    def _setup_in_backward_optimizers(self) -> None:
        """Step parameters that carry ``_in_backward_optimizers`` (torch's
        ``_apply_optimizer_in_backward``) as soon as their bucket is reduced,
        then set their ``.grad`` to None, as torch's DDP does."""
        params = [p for p in self._module_parameters if hasattr(p, "_in_backward_optimizers")]
        if not params:
            return
        from torch.distributed.optim import apply_optimizer_in_backward as aob

        for p in self._module_parameters:
            for handle in aob.param_to_optim_hook_handle_map.get(p, []):
                handle.remove()
        if self._has_comm_hook or self._fused_optim is not None:
            self._log_and_throw(RuntimeError, errors.in_backward_optim_with_hook())

        def step_bucket(bucket: Any) -> None:
            for p in bucket.params:
                optims = getattr(p, "_in_backward_optimizers", None)
                if optims and p.grad is not None:
                    for opt in optims:
                        opt.step()
                    p.grad = None
        self.reducer.set_post_reduce(step_bucket)

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

    @never_traced(recursive=False)
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
    _delayed_all_reduce_hook = _not_supported("_delayed_all_reduce_hook")
    _register_delay_all_reduce_hook = _not_supported("_register_delay_all_reduce_hook")
    _fire_reducer_autograd_hook = _not_supported("_fire_reducer_autograd_hook")
    _root_copy_hook = _not_supported("_root_copy_hook")
    _module_wait_for_copy_hook = _not_supported("_module_wait_for_copy_hook")
    _ddp_init_helper = _not_supported("_ddp_init_helper")
    _build_params_for_reducer = _not_supported("_build_params_for_reducer")
    _build_debug_param_to_name_mapping = _not_supported("_build_debug_param_to_name_mapping")
    _clear_grad_buffer = _not_supported("_clear_grad_buffer")
    _match_unused_params_allreduce = _not_supported("_match_unused_params_allreduce")
    _set_sparse_metadata = _not_supported("_set_sparse_metadata")
    _update_process_group = _not_supported("_update_process_group")
    _set_ddp_sink_clone = _not_supported("_set_ddp_sink_clone")
