"""SyncBatchNorm against one torch BatchNorm over the concatenated global batch.

Everything runs in float64, so the comparisons are tight. Each rank rebuilds the
global batch from a seed, runs the reference on all of it and SyncBatchNorm on
its own slice, and returns the largest differences.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gradring.nn import SyncBatchNorm, SyncBatchNormAct

TOL = 1e-10
_BN = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}


def _global_batch(seed: int, sizes: list[int], channels: int, dims: int):
    g = torch.Generator().manual_seed(seed)
    spatial = [3, 4, 2][: dims - 2]
    x = torch.randn(sum(sizes), channels, *spatial, generator=g, dtype=torch.float64) * 2 + 1
    upstream = torch.randn(x.shape, generator=g, dtype=torch.float64)
    return x, upstream


def _max_diff(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    return (a - b).abs().max().item() if a.numel() else 0.0


def _compare(rank, world, sizes, dims, momentum, affine, steps=2):
    """Train ``steps`` steps of both; return max differences of everything observable."""
    channels = 3
    ref = _BN[dims](channels, momentum=momentum, affine=affine).double()
    sync = SyncBatchNorm(channels, momentum=momentum, affine=affine).double()
    if affine:
        with torch.no_grad():
            ref.weight.uniform_(0.5, 1.5)
            ref.bias.uniform_(-0.5, 0.5)
            sync.weight.copy_(ref.weight)
            sync.bias.copy_(ref.bias)
    lo = sum(sizes[:rank])
    hi = lo + sizes[rank]
    diffs: dict[str, float] = {}
    for step in range(steps):
        x, up = _global_batch(step, sizes, channels, dims)
        xr = x.clone().requires_grad_(True)
        ref_out = ref(xr)
        (ref_out * up).sum().backward()
        xl = x[lo:hi].clone().requires_grad_(True)
        out = sync(xl)
        (out * up[lo:hi]).sum().backward()
        diffs["out"] = max(diffs.get("out", 0), _max_diff(out, ref_out[lo:hi]))
        diffs["grad_input"] = max(diffs.get("grad_input", 0), _max_diff(xl.grad, xr.grad[lo:hi]))
        if affine:
            for name in ("weight", "bias"):
                local = getattr(sync, name).grad.clone()
                dist.all_reduce(local)  # what DDP does to every parameter's gradient
                diffs[name] = max(diffs.get(name, 0), _max_diff(local, getattr(ref, name).grad))
                getattr(sync, name).grad = None
                getattr(ref, name).grad = None
    diffs["running_mean"] = _max_diff(sync.running_mean, ref.running_mean)
    diffs["running_var"] = _max_diff(sync.running_var, ref.running_var)
    diffs["batches"] = int(sync.num_batches_tracked) - int(ref.num_batches_tracked)
    # Eval: running statistics only, no communication (each rank its own data).
    sync.eval()
    ref.eval()
    x, _ = _global_batch(10 + rank, [4], channels, dims)
    diffs["eval"] = _max_diff(sync(x), ref(x))
    return diffs


def _too_small(rank, world):
    layer = SyncBatchNorm(2).double()
    x = torch.randn(1 if rank == 0 else 0, 2, dtype=torch.float64)
    try:
        layer(x)
    except ValueError as exc:
        return str(exc)
    return None


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(4 * 5 * 5, 6), nn.BatchNorm1d(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.conv(x))))


def _converted_model(rank, world):
    torch.manual_seed(0)
    ref = _Net().double()
    model = SyncBatchNorm.convert_sync_batchnorm(_Net().double())
    model.load_state_dict(ref.state_dict())
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4 * world, 2, 5, 5, generator=g, dtype=torch.float64)
    ref_out = ref(x)
    ref_out.square().sum().backward()
    out = model(x[4 * rank:4 * (rank + 1)])
    out.square().sum().backward()
    grads = []
    for p, q in zip(model.parameters(), ref.parameters()):
        local = p.grad.clone()
        dist.all_reduce(local)
        grads.append(_max_diff(local, q.grad))
    return {
        "out": _max_diff(out, ref_out[4 * rank:4 * (rank + 1)]),
        "grads": max(grads),
        "running_var": _max_diff(model.head[2].running_var, ref.head[2].running_var),
    }


def _under_ddp(rank, world, steps):
    """convert_sync_batchnorm + gradring DDP == one process training on the global batch."""
    import gradring

    torch.manual_seed(0)
    ref = _Net().double()
    model = SyncBatchNorm.convert_sync_batchnorm(_Net().double())
    model.load_state_dict(ref.state_dict())
    ddp = gradring.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(2)
    worst = 0.0
    for _ in range(steps):
        x = torch.randn(3 * world, 2, 5, 5, generator=g, dtype=torch.float64)
        y = torch.randn(3 * world, 6, generator=g, dtype=torch.float64)
        opt.zero_grad()
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        sl = slice(3 * rank, 3 * (rank + 1))
        nn.functional.mse_loss(ddp(x[sl]), y[sl]).backward()
        opt.step()
        ref_opt.step()
        worst = max(worst, max(_max_diff(p, q) for p, q in zip(model.parameters(),
                                                               ref.parameters())))
    worst = max(worst, _max_diff(model.bn.running_var, ref.bn.running_var))
    return worst


# ------------------------------------------------------------------------- tests
CASES = [
    # (world, per-rank batch sizes, input dims, momentum, affine)
    (2, [4, 4], 2, 0.1, True),
    (2, [3, 5], 4, 0.1, True),
    (2, [2, 6], 3, None, True),
    (3, [2, 3, 4], 4, 0.1, True),
    (3, [5, 0, 3], 3, 0.3, True),
    (3, [1, 2, 2], 5, None, False),
]


@pytest.mark.parametrize("world,sizes,dims,momentum,affine", CASES,
                         ids=[f"w{c[0]}-{'_'.join(map(str, c[1]))}-{c[2]}d-m{c[3]}-a{int(c[4])}"
                              for c in CASES])
def test_matches_batchnorm_over_the_global_batch(pools, world, sizes, dims, momentum, affine):
    results = pools.run(world, _compare, sizes, dims, momentum, affine)
    for rank, diffs in enumerate(results):
        assert diffs.pop("batches") == 0
        for name, d in diffs.items():
            assert d <= TOL, f"rank {rank}: {name} differs by {d}"


def test_global_batch_of_one_is_rejected_on_every_rank(pools):
    messages = pools.run(2, _too_small)
    assert all(m is not None and "more than 1 value per channel" in m for m in messages)


def test_converted_nested_model_matches_single_process(pools):
    for diffs in pools.run(2, _converted_model):
        assert max(diffs.values()) <= TOL, diffs


def test_trains_under_gradring_ddp_like_one_process(pools):
    import gradring

    if not hasattr(gradring, "DistributedDataParallel"):
        pytest.skip("gradring.DistributedDataParallel not available")
    assert max(pools.run(2, _under_ddp, 3)) <= 1e-9


def test_convert_sync_batchnorm_takes_over_state():
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4),
                        nn.Sequential(nn.Conv2d(1, 2, 1), nn.BatchNorm2d(2, momentum=None)))
    net[2][1].eval()
    net[1].weight.requires_grad_(False)
    net[1].running_mean.fill_(0.25)
    old_bn, old_inner = net[1], net[2][1]
    converted = SyncBatchNorm.convert_sync_batchnorm(net, process_group="group")
    assert converted is net
    bn, inner = converted[1], converted[2][1]
    assert type(bn) is SyncBatchNorm and type(inner) is SyncBatchNorm
    assert bn.weight is old_bn.weight and not bn.weight.requires_grad
    assert bn.running_mean is old_bn.running_mean and float(bn.running_mean[0]) == 0.25
    assert bn.training and not inner.training and inner.momentum is None
    assert inner.running_var is old_inner.running_var
    assert bn.process_group == "group"
    assert isinstance(converted[0], nn.Linear)
    # A lone BatchNorm is returned converted; non-BN modules are returned as they are.
    lone = SyncBatchNorm.convert_sync_batchnorm(nn.BatchNorm3d(5, affine=False))
    assert type(lone) is SyncBatchNorm and lone.weight is None
    linear = nn.Linear(2, 2)
    assert SyncBatchNorm.convert_sync_batchnorm(linear) is linear


class _OwnForward(nn.BatchNorm2d):
    """A batch norm whose forward does more than batch norm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


class _NormAct(nn.BatchNorm2d):
    """Shaped like timm's BatchNormAct2d (and named like it below), without needing timm."""

    def __init__(self, channels: int) -> None:
        super().__init__(channels)
        self.drop = nn.Identity()
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.drop(super().forward(x)))


_NormAct.__module__, _NormAct.__qualname__ = "timm.layers.norm_act", "BatchNormAct2d"


def test_convert_keeps_a_fused_activation():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(2, 3, 1), _NormAct(3))
    x = torch.randn(4, 2, 3, 3)
    expected = net(x)
    act, weight, running_var = net[1].act, net[1].weight, net[1].running_var
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        converted = SyncBatchNorm.convert_sync_batchnorm(net)
    layer = converted[1]
    assert type(layer) is SyncBatchNormAct
    assert layer.act is act and layer.weight is weight and layer.running_var is running_var
    assert (expected >= 0).all() and (expected == 0).any()
    torch.testing.assert_close(converted(x), expected)  # one process: plain batch norm + ReLU


def test_convert_leaves_a_subclass_with_its_own_forward_and_names_it():
    net = nn.Sequential(nn.BatchNorm2d(2), nn.Sequential(_OwnForward(2)))
    named = re.escape(f"1.0 ({_OwnForward.__module__}._OwnForward)")
    with pytest.warns(UserWarning, match=named):
        converted = SyncBatchNorm.convert_sync_batchnorm(net)
    assert type(converted[0]) is SyncBatchNorm
    assert type(converted[1][0]) is _OwnForward
    lazy = nn.LazyBatchNorm1d()
    with pytest.warns(UserWarning, match="LazyBatchNorm1d"):
        assert SyncBatchNorm.convert_sync_batchnorm(lazy) is lazy


@pytest.mark.parametrize("momentum", [0.1, None])
def test_single_process_is_plain_batchnorm(momentum):
    """Without an initialised process group there is nobody to sync with."""
    assert not dist.is_initialized()
    ref = nn.BatchNorm2d(3, momentum=momentum).double()
    sync = SyncBatchNorm(3, momentum=momentum).double()
    for _ in range(3):
        x = torch.randn(4, 3, 2, 2, dtype=torch.float64)
        torch.testing.assert_close(sync(x), ref(x))
    torch.testing.assert_close(sync.running_var, ref.running_var)
    sync.eval()
    ref.eval()
    x = torch.randn(2, 3, 2, 2, dtype=torch.float64)
    torch.testing.assert_close(sync(x), ref(x))


def test_input_checks():
    layer = SyncBatchNorm(3)
    with pytest.raises(ValueError, match="expected 2D to 5D input"):
        layer(torch.randn(3))
    with pytest.raises(ValueError, match="expected 2D to 5D input"):
        layer(torch.randn(1, 3, 1, 1, 1, 1))
    with pytest.raises(ValueError, match="expected 3 channels"):
        layer(torch.randn(2, 4))
