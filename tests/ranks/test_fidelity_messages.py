"""The same message for the same situation, against torch's DDP on gloo.

- static_graph=True, then a second backward over a head the first iteration
  did not use: torch's "Your training graph has changed in this iteration"
  error, with advice that fits static_graph (never "static_graph=True");
- a module on the meta device: torch fails by accident; gradring says to
  materialise it (``to_empty()``) before wrapping, with torch's error type.
"""

from __future__ import annotations

import warnings

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


# ------------------------------------------------------------------ warnings
# [Note: which channel a warning takes] in gradring/announce.py: under
# warnings.simplefilter("error") (what ``pytest -W error`` does), a training
# step raises under gradring exactly where it raises under torch's DDP.

def _step(ddp: nn.Module, twice: bool = False) -> None:
    loss = ddp(torch.randn(2, 4))[0].sum()
    loss.backward(retain_graph=twice)
    if twice:
        loss.backward()


def _strict_training(rank: int, world: int) -> dict[str, dict[str, str]]:
    torch.set_num_threads(1)
    cases = {
        # torch's C++ notice on stderr: no Python warning, in either.
        "nothing unused": ({"find_unused_parameters": True}, False),
        # torch is silent; gradring's notice goes to its logger.
        "backward twice": ({}, True),
        "static_graph": ({"static_graph": True}, False),
    }
    out: dict[str, dict[str, str]] = {}
    for case, (kwargs, twice) in cases.items():
        res = {}
        for name, cls in BOTH:
            model = _TwoHeads()
            model.b.requires_grad_(False)  # nothing unused
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("error")
                    ddp = cls(model, **kwargs)
                    for _ in range(3):
                        _step(ddp, twice)
                res[name] = "trained"
            except Exception as exc:  # noqa: BLE001 - the outcome is the result
                res[name] = f"{type(exc).__name__}: {exc}"
            torch.distributed.barrier()
        out[case] = res
    return out


def test_strict_warning_filters_train_where_torch_trains(pools) -> None:
    for out in pools.run(2, _strict_training, timeout=120):
        for case, res in out.items():
            assert res["torch"] == "trained", (case, res)
            assert res["ours"] == "trained", (case, res)


def _torch_python_warnings(rank: int, world: int) -> dict[str, dict[str, object]]:
    """The warnings torch's DDP gives as Python warnings: gradring gives the same
    category and text, at the user's line."""
    torch.set_num_threads(1)
    cases = {
        "check_reduction": lambda cls: cls(_TwoHeads(), check_reduction=True),
        "broadcast_buffers": lambda cls: cls(_TwoHeads(), broadcast_buffers=True),
        "both buffer flags": lambda cls: cls(_TwoHeads(), broadcast_buffers=True,
                                             forward_sync_buffers=True),
        "static_graph twice": lambda cls: cls(_TwoHeads(), static_graph=True)._set_static_graph(),
        "static_graph with find_unused": lambda cls: cls(_TwoHeads(), static_graph=True,
                                                         find_unused_parameters=True),
    }
    out: dict[str, dict[str, object]] = {}
    for case, make in cases.items():
        res: dict[str, object] = {}
        for name, cls in BOTH:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                make(cls)
            res[name] = sorted((w.category.__name__, str(w.message)) for w in seen)
            res[f"{name} files"] = sorted({w.filename for w in seen})
        out[case] = res
    return out


def test_torch_python_warnings_are_torch_s_at_the_user_line(pools) -> None:
    for out in pools.run(2, _torch_python_warnings, timeout=120):
        for case, res in out.items():
            assert res["torch"], (case, res)  # torch does warn here
            assert res["ours"] == res["torch"], (case, res)
            assert res["ours files"] == [__file__], (case, res["ours files"])
