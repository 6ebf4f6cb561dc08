"""DDP-native mixed precision: torch's ``mixed_precision=_MixedPrecision(...)``.

[Note: mixed precision]
torch 2.13's semantics, which this class reproduces:

- at construction every parameter DDP manages (ignored ones excepted) gets
  ``_mp_param``, an empty (storage freed) tensor in ``param_dtype``, and
  ``_fp_param``, its full-precision data; buffers DDP manages are cast to
  ``buffer_dtype`` once, for good;
- a forward pre-hook on the wrapped module (so also when it is called
  directly) copies each parameter into its ``_mp_param`` and points
  ``.data`` at it; a ``.grad`` kept from the last step is cast down too,
  so gradients accumulate in ``param_dtype``; DDP's forward casts floating
  point inputs to ``param_dtype``;
- the buckets are reduced by a communication hook (torch registers its own;
  so does this one, so a user hook is refused as the second one): the
  bucket is cast to the reduce dtype (``reduce_dtype``, else
  ``param_dtype``), SUM all-reduced, divided by the group size in that
  dtype; then the bucket's parameters get their full-precision data back
  and their ``.grad`` is cast up, and the reducer writes the reduced values
  into that full-precision ``.grad``. So after a synchronised backward the
  user sees full-precision parameters and gradients; the optimizer steps
  in full precision;
- parameters that do not require a gradient are set back to full precision
  at the end of such a backward;
- under ``no_sync`` nothing is reduced, so parameters and gradients stay in
  ``param_dtype`` until the next synchronised backward (torch does the same).

gradring's buckets keep the parameters' own (full) dtype: the low-precision
gradients are copied into them exactly, so what is reduced is the same as
torch's ``param_dtype`` bucket. ``gradient_as_bucket_view`` is not applied
under mixed precision: torch's hook replaces ``.grad`` by a full-precision
copy anyway, so no gradient stays a view of a bucket there either.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.utils import _cast_forward_inputs

from gradring.group_comm import GroupComm
from gradring.reducer.engine_callback import queue_engine_callback


def _free_storage(t: torch.Tensor) -> None:
    """Drop ``t``'s memory, keeping the tensor (its shape and dtype) for the next forward."""
    storage = t.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)


def _alloc_storage(t: torch.Tensor) -> None:
    """Give ``t`` memory for its elements again (after _free_storage)."""
    storage = t.untyped_storage()
    need = t.numel() * t.element_size()
    if storage.size() != need:
        storage.resize_(need)


class MixedPrecision:
    """The low/full precision switches of one DDP's parameters (see [Note: mixed precision])."""

    def __init__(self, config: Any, module: nn.Module, ignored: set[str],
                 comm: GroupComm) -> None:
        # torch's _MixedPrecision as given (DDP's ``mixed_precision`` attribute).
        self.config = config
        # What forward runs in (None: the parameters' own dtype).
        self.param_dtype: torch.dtype | None = config.param_dtype
        # What the buckets are reduced in (None: the bucket's dtype).
        self.reduce_dtype: torch.dtype | None = config.reduce_dtype or config.param_dtype
        # The parameters that switch precision: every one DDP does not ignore.
        self._params = [p for n, p in module.named_parameters() if n not in ignored]
        # Those without a gradient: no bucket sets them back, the end of backward does.
        self._frozen = [p for p in self._params if not p.requires_grad]
        # The collectives the buckets are reduced with.
        self._comm = comm
        # Whether this backward's end-of-backward restore is queued already.
        self._restore_queued = False
        for p in self._params:
            if not hasattr(p, "_mp_param"):
                p._mp_param = torch.zeros_like(p, dtype=self.param_dtype,
                                               requires_grad=p.requires_grad)
                _free_storage(p._mp_param)
                p._fp_param = p.data
        if config.buffer_dtype is not None:
            for n, buf in module.named_buffers():
                if n not in ignored:
                    buf.data = buf.to(dtype=config.buffer_dtype)
        # The pre-hook that casts parameters down before the module runs.
        self._handle = module.register_forward_pre_hook(
            self._to_low_precision, prepend=False, with_kwargs=True)

    def cast_inputs(self, inputs: Any, kwargs: Any) -> tuple[Any, Any]:
        """The forward's floating point inputs, cast to ``param_dtype``."""
        return _cast_forward_inputs(self.param_dtype, *inputs, **kwargs)

    def _to_low_precision(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        with torch.no_grad():
            for p in self._params:
                _alloc_storage(p._mp_param)
                p._mp_param.copy_(p.data)
                if p.grad is not None:
                    p.grad.data = p.grad.to(p._mp_param.dtype)
                p.data = p._mp_param

    def reduce_bucket(self, state: Any, bucket: Any) -> torch.futures.Future:
        """The comm hook: reduce in the reduce dtype, then give the bucket's
        parameters their full-precision data and ``.grad`` back."""
        del state
        buf = bucket.buffer()
        if self.reduce_dtype is not None and buf.dtype != self.reduce_dtype:
            buf = buf.to(self.reduce_dtype)
        fut = self._comm.all_reduce(buf)
        world = self._comm.world_size

        def divide(f: torch.futures.Future) -> torch.Tensor:
            value = f.value()
            out = value[0] if isinstance(value, (list, tuple)) else value
            return out.div_(world)

        result = fut.then(divide)
        for p in bucket.parameters():
            if hasattr(p, "_fp_param"):
                p.data = p._fp_param
                _free_storage(p._mp_param)
                if p.grad is not None:  # torch's hook would fail here; None is left alone
                    p.grad.data = p.grad.to(p.data.dtype)
        if self._frozen and not self._restore_queued:
            self._restore_queued = True
            queue_engine_callback(self._restore_frozen)
        return result

    def _restore_frozen(self) -> None:
        self._restore_queued = False
        for p in self._frozen:
            p.data = p._fp_param
