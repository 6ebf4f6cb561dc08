"""``skip_all_reduce_unused_params``, against torch's own DDP on the same scenario.

With find_unused_parameters, a bucket all of whose parameters the forward
did not reach is not reduced ([Note: skipped buckets] in
gradring/reducer/unused.py). Compared with torch's DDP: the number of
buckets reduced (torch's logging key ``num_buckets_reduced``), and the
parameters and gradients after a few SGD steps, bit for bit (world 2).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradring

pytestmark = pytest.mark.timeout(180)

TORCH_DDP = torch.nn.parallel.DistributedDataParallel
BOTH = (("theirs", TORCH_DDP), ("ours", gradring.DistributedDataParallel))


class Net(nn.Module):
    """fc1 (2 MB: a bucket of its own at bucket_cap_mb=1.5) is used, fc2 never
    is (torch's test's model); with ``mixed``, the used fc3 and the unused fc4
    share fc2's bucket, which then is reduced."""

    def __init__(self, mixed: bool) -> None:
        super().__init__()
        torch.manual_seed(31415)
        self.fc1 = nn.Linear(100, 5000, bias=False)
        self.fc2 = nn.Linear(100, 100, bias=False)
        # Whether fc3 and fc4 exist.
        self.mixed = mixed
        if mixed:
            self.fc3 = nn.Linear(100, 3)
            self.fc4 = nn.Linear(100, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc1(x).sum(1, keepdim=True)
        return y + self.fc3(x) if self.mixed else y


def _run(rank: int, world: int, skip: bool, mixed: bool) -> dict:
    out = {}
    for name, cls in BOTH:
        model = Net(mixed)
        ddp = cls(model, find_unused_parameters=True, bucket_cap_mb=1.5,
                  skip_all_reduce_unused_params=skip)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        for s in range(4):
            x = torch.randn(6, 100, generator=torch.Generator().manual_seed(10 * s + rank))
            opt.zero_grad()
            ddp(x).pow(2).mean().backward()
            opt.step()
        out[name] = {
            "reduced": ddp._get_ddp_logging_data().get("num_buckets_reduced"),
            "attr": ddp.skip_all_reduce_unused_params,
            "state": {n: p.detach().clone() for n, p in model.named_parameters()},
            "grads": {n: None if p.grad is None else p.grad.clone()
                      for n, p in model.named_parameters()},
        }
    return out


def _same(a: dict, b: dict) -> list[str]:
    return sorted(k for k in a if (a[k] is None) != (b[k] is None)
                  or (a[k] is not None and not torch.equal(a[k], b[k])))


@pytest.mark.parametrize("skip,mixed,reduced", [
    (False, False, 2), (True, False, 1), (False, True, 2), (True, True, 2)])
def test_matches_torch(pools, skip, mixed, reduced):
    for r in pools.run(2, _run, skip, mixed):
        theirs, ours = r["theirs"], r["ours"]
        assert ours["reduced"] == theirs["reduced"] == reduced, (ours["reduced"],
                                                                  theirs["reduced"])
        assert ours["attr"] == theirs["attr"] == skip
        assert _same(theirs["state"], ours["state"]) == []
        assert _same(theirs["grads"], ours["grads"]) == []
