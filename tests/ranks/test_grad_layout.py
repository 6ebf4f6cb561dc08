"""The gradient layout contract: ``.grad`` has the parameter's strides, as in torch's DDP.

torch's reducer gives a bucket view the strides of its parameter when the
parameter is dense and non-overlapping (channels_last convolutions, a
parameter made from a transposed tensor), and row-major strides otherwise.
Optimizers that pair parameter and gradient elements by memory position
(the fused and foreach implementations) read a gradient laid out otherwise
as a scrambled one, with no error. Each case runs torch's DDP and gradring's
on the same model and compares strides, gradients and parameters bit for bit.
"""

import pytest
import torch
from torch import nn

import gradring


class _Odd(nn.Module):
    """A channels_last convolution (small and large), a parameter that is the
    transpose of a contiguous tensor (dense, not contiguous), and a plain
    linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.small = nn.Conv2d(3, 8, 3, padding=1)
        self.large = nn.Conv2d(8, 96, 3, padding=1)  # 6,912 weights: beyond a packed slot
        self.t = nn.Parameter(torch.randn(300, 40).t())  # (40, 300), strides (1, 40)
        self.head = nn.Linear(40, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.large(torch.relu(self.small(x)))
        y = y.mean(dim=(2, 3))[:, :40]  # (n, 40)
        return self.head(torch.tanh(y @ self.t @ self.t.t()))


def _optimizer(params, which: str):
    kind, impl = which.split("-")
    flags = {"fused": {"fused": True}, "foreach": {"foreach": True}}[impl]
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, **flags)
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9, **flags)


def _train(rank, world_size, impl, view, optim, set_to_none):
    torch.manual_seed(0)
    model = _Odd().to(memory_format=torch.channels_last)
    wrap = gradring.DistributedDataParallel if impl == "gradring" else \
        nn.parallel.DistributedDataParallel
    ddp = wrap(model, gradient_as_bucket_view=view, bucket_cap_mb=0.01)
    opt = _optimizer(ddp.parameters(), optim)
    torch.manual_seed(100 + rank)
    steps = []
    for _ in range(4):
        opt.zero_grad(set_to_none=set_to_none)
        x = torch.randn(2, 3, 6, 6).to(memory_format=torch.channels_last)
        ddp(x).square().sum().backward()
        steps.append(([tuple(p.grad.stride()) for p in model.parameters()],
                      [p.grad.clone() for p in model.parameters()]))
        opt.step()
    return steps, [p.detach().clone() for p in model.parameters()], \
        [tuple(p.stride()) for p in model.parameters()]


CASES = [(view, optim, set_to_none)
         for view in (False, True)
         for optim in ("adamw-fused", "adamw-foreach", "sgd-fused", "sgd-foreach")
         for set_to_none in (True, False)]


@pytest.mark.parametrize("view,optim,set_to_none", CASES)
def test_grad_strides_follow_the_parameter_as_in_torch(pools, view, optim, set_to_none):
    theirs = pools.run(2, _train, "torch", view, optim, set_to_none)
    ours = pools.run(2, _train, "gradring", view, optim, set_to_none)
    for (steps_t, params_t, pstrides), (steps_g, params_g, _) in zip(theirs, ours):
        # The oracle itself follows the contract: the parameters' own strides.
        assert steps_t[0][0] == pstrides
        for (strides_t, grads_t), (strides_g, grads_g) in zip(steps_t, steps_g):
            assert strides_g == strides_t
            for a, b in zip(grads_t, grads_g):
                assert torch.equal(a, b)
        for a, b in zip(params_t, params_g):
            assert torch.equal(a, b)
