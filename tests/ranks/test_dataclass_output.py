"""A forward that returns a dataclass: torch's DDP leaves the gradients unaveraged
under static_graph and find_unused_parameters; gradring averages them.

torch's DDP passes a forward's outputs through its ``_DDPSink`` (static_graph's
first iteration, every find_unused_parameters iteration) after flattening them
with ``torch.utils._pytree``, which treats a dataclass as one opaque leaf. No
tensor goes through the sink, so under static_graph the first iteration's delayed
all-reduce is never queued and no later iteration is reduced either; under
find_unused_parameters an output field the loss leaves out never reports its
parameters, the bucket never completes, the iteration's gradients stay local and
the next forward raises. gradring's output boundary reaches tensors inside
dataclasses ([Note: container rules] in gradring/pytree.py). Each rank function
computes torch's result, gradring's result and the average by hand (each rank's
own gradient from the bare module, gathered and averaged), in the same processes;
docs/ddp-differences.md quotes the numbers this test measures.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradring

pytestmark = pytest.mark.timeout(180)

TORCH_DDP = torch.nn.parallel.DistributedDataParallel
BOTH = (("torch", TORCH_DDP), ("gradring", gradring.DistributedDataParallel))
DOC = Path(__file__).resolve().parents[2] / "docs" / "ddp-differences.md"
STEPS = 3
MODES = {
    # Every field of the output is in the loss.
    "static_graph": ({"static_graph": True}, ("y", "z")),
    # The loss leaves the field ``z`` out (the case find_unused_parameters is for).
    "find_unused_parameters": ({"find_unused_parameters": True}, ("y",)),
}


@dataclasses.dataclass
class Out:
    y: torch.Tensor
    z: torch.Tensor


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(3, 2)
        self.side = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> Out:
        return Out(self.fc(x), self.side(x))


def _input(step: int, rank: int) -> torch.Tensor:
    # Integers: every sum and average below is exact in float64.
    return torch.full((2, 3), float(rank + 1 + step), dtype=torch.float64)


def _loss(out: Out, fields: tuple[str, ...]) -> torch.Tensor:
    return sum(getattr(out, f).sum() for f in fields)


def _dataclass_output(rank: int, world: int, mode: str) -> dict:
    kw, fields = MODES[mode]
    res: dict = {}
    for name, cls in BOTH:
        model = Net().double()
        ddp = cls(model, **kw)
        grads, error = [], None
        for step in range(STEPS):
            model.zero_grad()
            try:
                _loss(ddp(_input(step, rank)), fields).backward()
            except RuntimeError as exc:
                error = str(exc)
                break
            grads.append(model.fc.weight.grad.clone())
        res[name] = {"grads": grads, "error": error,
                     "side_grad": model.side.weight.grad is not None}
    # The average by hand: each rank's own gradient from the bare module, gathered.
    local, average = [], []
    for step in range(STEPS):
        model = Net().double()
        _loss(model(_input(step, rank)), fields).backward()
        mine = model.fc.weight.grad.clone()
        every = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(every, mine)
        local.append(mine)
        average.append(sum(every) / world)
    return {
        "torch": [g[0, 0].item() for g in res["torch"]["grads"]],
        "torch_error": res["torch"]["error"],
        "torch_is_local": all(torch.equal(g, mine)
                              for g, mine in zip(res["torch"]["grads"], local)),
        "gradring": [g[0, 0].item() for g in res["gradring"]["grads"]],
        "gradring_error": res["gradring"]["error"],
        "gradring_is_average": len(res["gradring"]["grads"]) == STEPS and all(
            torch.equal(g, avg) for g, avg in zip(res["gradring"]["grads"], average)),
        "gradring_side_grad": res["gradring"]["side_grad"],
        "average": [a[0, 0].item() for a in average],
    }


def _numbers(values: list[float]) -> str:
    return ", ".join(f"{v:g}" for v in values)


def _documented(text: str) -> None:
    doc = re.sub(r"\s+", " ", DOC.read_text(encoding="utf-8"))
    assert text in doc, f"docs/ddp-differences.md should say: {text}"


def test_static_graph_dataclass_output_is_averaged(pools) -> None:
    results = pools.run(2, _dataclass_output, "static_graph")
    for r in results:
        assert r["gradring_error"] is None and r["gradring_is_average"], r
        # torch: every step keeps each rank's own gradient, without an error.
        assert r["torch_error"] is None and r["torch_is_local"] and len(r["torch"]) == STEPS, r
    r0 = results[0]
    _documented(f"static_graph: torch {_numbers(r0['torch'])}; gradring "
                f"{_numbers(r0['gradring'])}; by hand {_numbers(r0['average'])}")


def test_find_unused_dataclass_output_is_averaged(pools) -> None:
    results = pools.run(2, _dataclass_output, "find_unused_parameters")
    for r in results:
        assert r["gradring_error"] is None and r["gradring_is_average"], r
        assert not r["gradring_side_grad"], r  # the field left out: no gradient, as unused
        # torch: the first step keeps each rank's own gradient, the next forward raises.
        assert r["torch_is_local"] and len(r["torch"]) == 1, r
        assert "Expected to have finished reduction" in r["torch_error"], r
    r0 = results[0]
    _documented(f"find_unused_parameters: torch {_numbers(r0['torch'])}, then an error; "
                f"gradring {_numbers(r0['gradring'])}; by hand {_numbers(r0['average'])}")
