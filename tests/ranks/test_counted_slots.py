"""Packed slots counted without a Python hook, against torch's DDP.

After the rebuild, every packed slot but its bucket's last is counted by a
builtin (``list.append``) instead of the reducer's hook ([Note: counted slots]
in gradring/buckets/packed.py). These scenarios are the ones where that could
go wrong: several buckets, the arrival order changing after the rebuild (a
bucket's last slot then fires before its counted ones), no_sync
accumulation, and a backward in which only counted slots fire. Each runs
gradring's and torch's DDP on the same model and inputs in the same rank and
compares every gradient bit for bit, or the errors.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gradring

pytestmark = pytest.mark.timeout(300)


class _Vectors(nn.Module):
    """Small vectors (packed slots) and one large layer (a slot with a Python
    hook); ``order`` chooses the order the forward uses the vectors in, which
    decides their gradients' arrival order; ``use`` which vectors it uses."""

    def __init__(self, n: int = 24) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.vecs = nn.ParameterList([nn.Parameter(torch.randn(20) * 0.1) for _ in range(n)])
        self.big = nn.Linear(64, 80)  # 5120 elements: above the packed size
        self.order: list[int] = list(range(n))
        self.use_big = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        acc = torch.zeros((), dtype=x.dtype)
        for i in self.order:
            acc = acc + (self.vecs[i] * x[:20]).tanh().sum()
        if self.use_big:
            acc = acc + self.big(x[:64]).tanh().sum()
        return acc


def _train(rank: int, world_size: int, scenario: str) -> dict:
    torch.manual_seed(0)
    base = _Vectors()
    out: dict = {"counted": []}
    for name, cls in (("gradring", gradring.DistributedDataParallel),
                      ("torch", nn.parallel.DistributedDataParallel)):
        model = copy.deepcopy(base)
        ddp = cls(model, bucket_cap_mb=0.001)  # about 13 vectors a bucket
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        grads = []
        for step in range(7):
            gen = torch.Generator().manual_seed(100 * step + rank)
            x = torch.randn(64, generator=gen)
            n = len(model.vecs)
            if scenario == "reordered" and step >= 3:
                # after the rebuild: reversed, then shuffled, arrival orders
                model.order = (list(range(n))[::-1] if step % 2 else
                               torch.randperm(n, generator=gen).tolist())
            if scenario == "no_sync" and step in (2, 3, 5):
                with ddp.no_sync():
                    ddp(x).backward()
                continue
            opt.zero_grad(set_to_none=step % 2 == 0)
            ddp(x).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            opt.step()
            if name == "gradring":
                r = ddp.reducer
                out["counted"].append(sum(b.n_counted for b in r.buckets)
                                      if r._counting.on else 0)
                # the backward's first gradient keeps its hook: it marks backward_start
                out.setdefault("first_counted", []).append(
                    any(0 in path.counted for path in r.buckets[0].counting))
        out[name] = grads
    return out


@pytest.mark.parametrize("scenario", ["steady", "reordered", "no_sync"])
def test_counted_slots_match_torch(pools, scenario: str) -> None:
    for r in pools.run(2, _train, scenario):
        assert len(r["gradring"]) == len(r["torch"])
        for step, (g, t) in enumerate(zip(r["gradring"], r["torch"])):
            for i, (a, b) in enumerate(zip(g, t)):
                assert torch.equal(a, b), (scenario, step, i, (a - b).abs().max().item())
        assert not any(r["first_counted"]), r["first_counted"]
        # Counting starts with the rebuilt buckets, and most slots are counted.
        assert r["counted"][0] == 0, r["counted"]
        assert r["counted"][2] >= 20, r["counted"]
        if scenario == "reordered":
            # A bucket whose last slot fired before its counted ones keeps
            # the reducer's hooks from then on.
            assert r["counted"][-1] < r["counted"][2], r["counted"]
        else:
            assert min(r["counted"][2:]) == r["counted"][2], r["counted"]


def _only_counted_fire(rank: int, world_size: int) -> dict:
    """Steps 0-3 use everything; step 4 leaves out the large layer and the
    vector whose gradient arrives last (its bucket's closer), so only
    counted slots fire; step 5's forward must then fail as torch's does."""
    torch.manual_seed(0)
    base = _Vectors(6)
    out = {}
    for name, cls in (("gradring", gradring.DistributedDataParallel),
                      ("torch", nn.parallel.DistributedDataParallel)):
        model = copy.deepcopy(base)
        ddp = cls(model)  # one bucket
        error = None
        try:
            for step in range(6):
                if step == 4:
                    model.use_big = False
                    model.order = [1, 2, 3, 4, 5]  # vecs.0 arrives last otherwise
                ddp(torch.randn(64)).backward()
        except RuntimeError as exc:
            error = (step, str(exc))
        out[name] = error
        if name == "gradring":
            out["counted"] = sum(b.n_counted for b in ddp.reducer.buckets)
            out["closer"] = ddp.reducer.buckets[0].param_indices[-1]
            out["first"] = ddp.reducer.buckets[0].param_indices[0]
    return out


def test_a_backward_of_counted_slots_alone_is_an_unfinished_reduction(pools) -> None:
    for r in pools.run(2, _only_counted_fire):
        # vecs.1-5; vecs.0 (arrives last), big.bias (arrives first: it marks the
        # backward's start) and big.weight (large) keep their hooks
        assert r["counted"] == 5, r
        assert r["first"] == 7, r  # big.bias
        assert r["closer"] == 0, r
        assert r["torch"] is not None and r["torch"][0] == 5, r["torch"]
        assert r["gradring"] is not None and r["gradring"][0] == 5, r["gradring"]
        for msg in (r["torch"][1], r["gradring"][1]):
            assert "Expected to have finished reduction in the prior iteration" in msg
        assert "vecs.0" in r["gradring"][1] and "big.weight" in r["gradring"][1]
