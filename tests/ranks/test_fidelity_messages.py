"""The same message for the same situation, against torch's DDP on gloo.

- static_graph=True, then a second backward over a head the first iteration
  did not use: torch's "Your training graph has changed in this iteration"
  error, with advice that fits static_graph (never "static_graph=True");
- a module on the meta device: torch fails by accident; gradring says to
  materialise it (``to_empty()``) before wrapping, with torch's error type.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradring

pytestmark = pytest.mark.timeout(300)

BOTH = (("ours", gradring.DistributedDataParallel),
        ("torch", nn.parallel.DistributedDataParallel))


class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(4, 4)
        self.a = nn.Linear(4, 1)
        self.b = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(x)
        return self.a(h), self.b(h)


def _second_backward_over_new_head(rank: int, world: int) -> dict[str, str]:
    torch.set_num_threads(1)
    out = {}
    for name, cls in BOTH:
        ddp = cls(_TwoHeads(), static_graph=True)
        try:
            for it in range(2):
                a, b = ddp(torch.randn(2, 4))
                a.sum().backward(retain_graph=it > 0)
                if it > 0:
                    b.sum().backward()
            out[name] = "trained"
        except RuntimeError as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
        torch.distributed.barrier()
    return out


def test_static_graph_second_backward_says_what_torch_says(pools) -> None:
    for out in pools.run(2, _second_backward_over_new_head, timeout=120):
        theirs, ours = out["torch"], out["ours"]
        assert theirs.startswith("RuntimeError: Your training graph has changed in this "
                                 "iteration"), theirs
        assert "not compatible with static_graph set to True" in theirs
        assert ours.startswith(theirs.rstrip(".")), ours
        assert "static_graph=True" not in ours and "mark a variable ready" not in ours


def _meta(rank: int, world: int) -> dict[str, str]:
    torch.set_num_threads(1)
    out = {}
    for name, cls in BOTH:
        try:
            cls(nn.Linear(4, 4, device="meta"))
            out[name] = "constructed"
        except Exception as exc:  # noqa: BLE001 - the error is the result
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


def test_meta_module_is_refused_with_what_to_do(pools) -> None:
    for out in pools.run(2, _meta, timeout=120):
        assert out["torch"].startswith("RuntimeError"), out["torch"]
        assert out["ours"].startswith("RuntimeError"), out["ours"]
        assert "meta" in out["ours"] and "to_empty(" in out["ours"]
