"""Batch normalisation over the global batch of all ranks, on CPU or CUDA.

[Note: SyncBatchNorm statistics]
Forward (training): each rank reduces its input to three numbers per channel,
its element count n_i, mean m_i and sum of squared deviations S_i (not the raw
sum of squares, which cancels catastrophically), all-gathers them, and every rank
combines them the same way (Chan et al.'s parallel variance):

    n = sum n_i,   mean = sum n_i m_i / n,   S = sum (S_i + n_i (m_i - mean)^2)

giving the biased variance S / n for normalising and the unbiased S / (n - 1)
for the running estimate, exactly what one BatchNorm over the concatenated
batch computes. A rank may hold zero rows (n_i = 0): it contributes nothing.
The statistics are combined in float64, so large counts stay exact.

Backward: with x_hat = (x - mean) * invstd and y = w * x_hat + b,

    dL/dx = w * invstd * (dy - mean(dy) - (x - mean) * invstd^2 * mean(dy * (x - mean)))

where the two means run over the global batch: one all-reduce of
[sum dy, sum dy * (x - mean)] per channel. The weight and bias gradients are the
local sums, as for any parameter under DDP, whose all-reduce adds them up.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm

from gradring import comm
from gradring.nn.conversion import convert_batchnorms

__all__ = ["SyncBatchNorm", "SyncBatchNormAct"]


def _world_size(group: Any) -> int:
    """Ranks to synchronise with; 1 (plain batch norm) when no group is initialised."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 1
    getter = getattr(comm, "get_world_size", None)
    return int(getter(group)) if getter is not None else dist.get_world_size(group)


def _channel_shape(x: torch.Tensor) -> list[int]:
    """Shape that broadcasts a per-channel vector against ``x`` (N, C, *)."""
    return [1, x.shape[1]] + [1] * (x.dim() - 2)


def _stats_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float32 if x.device.type == "mps" else torch.float64


class _SyncBatchNormFunction(torch.autograd.Function):
    """Training-mode batch norm whose statistics span every rank of ``group``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None, running_mean: torch.Tensor | None,
                running_var: torch.Tensor | None, eps: float, momentum: float,
                group: Any, world: int) -> torch.Tensor:
        channels = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        compute = torch.promote_types(x.dtype, torch.float32)
        xc = x.to(compute)
        local_n = x.numel() // channels if channels else 0
        if local_n > 0:
            var, mean = torch.var_mean(xc, dim=dims, correction=0)
            local = torch.cat([mean, var * local_n])
        else:
            local = xc.new_zeros(2 * channels)
        stats_dtype = _stats_dtype(x)
        count = local.new_full((1,), local_n, dtype=stats_dtype)
        packed = torch.cat([local.to(stats_dtype), count])
        gathered = packed.new_empty(world * packed.numel())
        comm.all_gather_into_tensor(gathered, packed, group=group)
        rows = gathered.view(world, -1)
        means, sq_devs, counts = rows[:, :channels], rows[:, channels:-1], rows[:, -1:]
        n = counts.sum()
        total = int(n.item())
        if total <= 1:
            raise ValueError(
                f"Expected more than 1 value per channel when training, got {total} "
                f"in the global batch (per-rank counts {counts.view(-1).long().tolist()})")
        mean = (counts * means).sum(dim=0) / n
        sq_dev = (sq_devs + counts * (means - mean) ** 2).sum(dim=0)
        invstd = torch.rsqrt(sq_dev / n + eps)

        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
        if running_var is not None:
            with torch.no_grad():
                unbiased = (sq_dev / (n - 1)).to(running_var.dtype)
                running_var.mul_(1 - momentum).add_(unbiased, alpha=momentum)

        mean_c = mean.to(compute)
        invstd_c = invstd.to(compute)
        shape = _channel_shape(x)
        scale = invstd_c if weight is None else invstd_c * weight.to(compute)
        y = (xc - mean_c.view(shape)) * scale.view(shape)
        if bias is not None:
            y = y + bias.to(compute).view(shape)
        ctx.save_for_backward(x, weight, mean_c, invstd_c)
        ctx.global_count = total
        ctx.group = group
        return y.to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        x, weight, mean, invstd = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        channels = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        shape = _channel_shape(x)
        compute = mean.dtype
        dy = grad_out.to(compute)
        xmu = x.to(compute) - mean.view(shape)
        sum_dy = dy.sum(dim=dims)
        sum_dy_xmu = (dy * xmu).sum(dim=dims)

        grad_x = grad_w = grad_b = None
        if need_w and weight is not None:
            grad_w = (sum_dy_xmu * invstd).to(weight.dtype)
        if need_b:
            grad_b = sum_dy.to(weight.dtype if weight is not None else x.dtype)
        if need_x:
            sums = torch.cat([sum_dy, sum_dy_xmu])
            comm.all_reduce(sums, group=ctx.group)
            mean_dy = sums[:channels] / ctx.global_count
            mean_dy_xmu = sums[channels:] / ctx.global_count
            scale = invstd if weight is None else invstd * weight.to(compute)
            grad_x = (dy - mean_dy.view(shape)
                      - xmu * (invstd * invstd * mean_dy_xmu).view(shape)) * scale.view(shape)
            grad_x = grad_x.to(x.dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics cover the whole global batch.

    A drop-in for ``torch.nn.SyncBatchNorm`` that also runs on CPU. Inputs are
    (N, C), (N, C, L), (N, C, H, W) or (N, C, D, H, W). Per-rank batch sizes may
    differ, and may be zero on some ranks. Outside training (or with a world
    of one) it is plain batch norm and communicates nothing. Every rank of
    ``process_group`` must run the forward and backward of each layer together.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_group: Any = None, device: Any = None, dtype: Any = None,
                 *, bias: bool = True) -> None:
        # ``bias=False`` (a weight but no bias) needs a torch whose _BatchNorm has it.
        extra = {} if bias else {"bias": False}
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype, **extra)
        # Group whose ranks share statistics; None means the default group.
        self.process_group: Any = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if not 2 <= input.dim() <= 5:
            raise ValueError(f"expected 2D to 5D input (got {input.dim()}D input)")

    def _momentum_factor(self) -> float:
        """Weight of this batch in the running statistics (counts the batch when training)."""
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            tracked = self.num_batches_tracked
            tracked.add_(1)
            factor = 1.0 / float(tracked) if self.momentum is None else self.momentum
        return factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        if x.shape[1] != self.num_features:
            raise ValueError(f"expected {self.num_features} channels, got input of shape "
                             f"{tuple(x.shape)}")
        factor = self._momentum_factor()
        use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        # Running statistics are read in eval and updated in training when tracked.
        track = not self.training or self.track_running_stats
        running_mean = self.running_mean if track else None
        running_var = self.running_var if track else None
        world = _world_size(self.process_group) if self.training else 1
        if not self.training or world == 1:
            return F.batch_norm(x, running_mean, running_var, self.weight, self.bias,
                                use_batch_stats, factor, self.eps)
        return _SyncBatchNormFunction.apply(
            x, self.weight, self.bias, running_mean, running_var, self.eps, factor,
            self.process_group, world)

    @classmethod
    def from_batchnorm(cls, bn: _BatchNorm, process_group: Any = None) -> SyncBatchNorm:
        """A new layer of this class that takes over ``bn``'s state.

        It holds ``bn``'s parameters and buffers (the same tensors, so an
        optimizer built before keeps working), its training flag and, if
        present, its ``qconfig``. ``bn``'s children are not moved.
        """
        has_bias = getattr(bn, "bias", None) is not None or not bn.affine
        layer = cls(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats,
                    process_group, bias=has_bias)
        if bn.affine:
            layer.weight = bn.weight
            if has_bias:
                layer.bias = bn.bias
        layer.running_mean = bn.running_mean
        layer.running_var = bn.running_var
        layer.num_batches_tracked = bn.num_batches_tracked
        layer.train(bn.training)
        if getattr(bn, "qconfig", None) is not None:
            layer.qconfig = bn.qconfig
        return layer

    @classmethod
    def convert_sync_batchnorm(cls, module: nn.Module, process_group: Any = None) -> nn.Module:
        """Return ``module`` with its batch-norm layers replaced by synchronised ones.

        torch's BatchNorm1d/2d/3d and SyncBatchNorm become this class, timm's
        fused batch norm + activation layers a :class:`SyncBatchNormAct`; other
        ``_BatchNorm`` subclasses are left as they are, with a warning that names
        them (see [Note: which batch norms convert_sync_batchnorm converts] in
        gradring/nn/conversion.py). The new layers take over the old ones'
        state (see :meth:`from_batchnorm`). Convert before wrapping the model in
        DistributedDataParallel.
        """
        return convert_batchnorms(
            module, SyncBatchNorm,
            plain=lambda bn: cls.from_batchnorm(bn, process_group),
            fused=lambda bn: SyncBatchNormAct.from_batchnorm(bn, process_group))


class SyncBatchNormAct(SyncBatchNorm):
    """SyncBatchNorm followed by ``drop`` and then ``act``, like timm's ``BatchNormAct2d``.

    What ``convert_sync_batchnorm`` turns a fused batch norm + activation layer
    into: the statistics span the ranks, and the layer's own dropout and
    activation still run after them.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_group: Any = None, device: Any = None, dtype: Any = None,
                 *, bias: bool = True, act: nn.Module | None = None,
                 drop: nn.Module | None = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         process_group, device, dtype, bias=bias)
        # Applied to the normalised output before ``act`` (timm's drop_layer; identity if none).
        self.drop: nn.Module = drop if drop is not None else nn.Identity()
        # The fused activation, applied last.
        self.act: nn.Module = act if act is not None else nn.Identity()

    @classmethod
    def from_batchnorm(cls, bn: _BatchNorm, process_group: Any = None) -> SyncBatchNormAct:
        """As :meth:`SyncBatchNorm.from_batchnorm`, and takes over ``bn.drop`` and ``bn.act``."""
        layer = super().from_batchnorm(bn, process_group)
        for name in ("drop", "act"):
            child = getattr(bn, name, None)
            if child is not None:
                layer.add_module(name, child)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.drop(super().forward(x)))
