"""Type identity with torch's DDP, coverage of its class surface, and pickling.

See [Note: type identity] in gradring/ddp/module.py: gradring's class
subclasses torch's but never runs torch's code.
"""

from __future__ import annotations

import inspect
import io
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradring
from gradring.ddp import TorchDDP

pytestmark = pytest.mark.timeout(180)

TORCH_DDP = torch.nn.parallel.DistributedDataParallel


def _torch_callables() -> dict[str, object]:
    """Every callable attribute torch's class defines itself (methods, properties, ...)."""
    out = {}
    for name, value in vars(TorchDDP).items():
        if isinstance(value, (staticmethod, classmethod, property)) or callable(value):
            if name in ("__class_getitem__",) or isinstance(value, type):
                continue
            out[name] = value
    return out


# Surface table: (name, how gradring covers it). "impl" means implemented with
# torch's meaning; "raises" means NotImplementedError naming the method.
RAISES = {
    "_register_accum_grad_hook",
    "_fire_reducer_autograd_hook", "_root_copy_hook", "_module_wait_for_copy_hook",
    "_ddp_init_helper", "_match_unused_params_allreduce",
    "_set_sparse_metadata", "_update_process_group",
}


def test_every_torch_callable_is_overridden() -> None:
    assert issubclass(gradring.DistributedDataParallel, TORCH_DDP)
    theirs = _torch_callables()
    assert len(theirs) > 50, sorted(theirs)  # the walk really sees torch 2.13's class
    not_ours = []
    for name, value in theirs.items():
        ours = inspect.getattr_static(gradring.DistributedDataParallel, name)
        if ours is value:
            not_ours.append(name)
            continue
        target = ours.fget if isinstance(ours, property) else ours
        target = getattr(target, "__func__", target)
        module = getattr(target, "__module__", "") or ""
        if not module.startswith("gradring"):
            not_ours.append(f"{name} ({module})")
    assert not_ours == [], f"inherited from torch's DDP: {not_ours}"


def test_unsupported_internals_raise_naming_themselves() -> None:
    for name in sorted(RAISES):
        assert name in _torch_callables(), name  # still part of torch's surface
        method = getattr(gradring.DistributedDataParallel, name)
        with pytest.raises(NotImplementedError, match=name):
            method(object())
    # Everything else torch defines is implemented: calling it never hits the stub.
    implemented = set(_torch_callables()) - RAISES
    for name in implemented:
        ours = inspect.getattr_static(gradring.DistributedDataParallel, name)
        assert "gradring has no counterpart" not in (getattr(ours, "__doc__", "") or ""), name


def _no_torch_machinery(rank: int, world: int) -> dict:
    """Build and train with torch's C++ Reducer, Logger and _DDPSink made unusable."""
    import torch.nn.parallel.distributed as tdist

    saved = (dist.Reducer, dist.Logger, tdist._DDPSink)

    class Forbidden:
        def __init__(self, *a, **k):
            raise AssertionError("torch machinery was used")

        @staticmethod
        def apply(*a, **k):
            raise AssertionError("torch's _DDPSink was used")

    dist.Reducer, dist.Logger, tdist._DDPSink = Forbidden, Forbidden, Forbidden
    try:
        results = {}
        for kw in ({}, {"find_unused_parameters": True}, {"static_graph": True},
                   {"gradient_as_bucket_view": True}):
            torch.manual_seed(0)
            ddp = gradring.DistributedDataParallel(nn.Linear(4, 4), **kw)
            for _ in range(3):
                ddp(torch.randn(2, 4)).sum().backward()
            results[str(kw)] = isinstance(ddp, TORCH_DDP)
        return results
    finally:
        dist.Reducer, dist.Logger, tdist._DDPSink = saved


def test_isinstance_without_torch_machinery(pools) -> None:
    for r in pools.run(2, _no_torch_machinery):
        assert all(r.values()) and len(r) == 4, r


def _pickle_and_train_on(rank: int, world: int) -> dict:
    """Pickle a whole DDP after some steps, load it, train on: as torch's DDP does."""
    out = {}
    for name, cls in (("ours", gradring.DistributedDataParallel), ("theirs", TORCH_DDP)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).double()
        ddp = cls(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(rank)
        losses = []

        def step(m, o, g=g, losses=losses):
            o.zero_grad()
            loss = m(torch.randn(4, 6, generator=g, dtype=torch.float64)).pow(2).mean()
            loss.backward()
            o.step()
            losses.append(loss.item())
        for _ in range(2):
            step(ddp, opt)
        buf = io.BytesIO()
        torch.save(ddp, buf)
        buf.seek(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loaded = torch.load(buf, weights_only=False)
        assert type(loaded) is cls
        opt2 = torch.optim.SGD(loaded.parameters(), lr=0.1)
        for _ in range(3):
            step(loaded, opt2)
        out[name] = (losses, [p.detach().clone() for p in loaded.parameters()])
    ours, theirs = out["ours"], out["theirs"]
    return {"losses_equal": ours[0] == theirs[0],
            "params_equal": all(torch.equal(a, b) for a, b in zip(ours[1], theirs[1])),
            "losses": ours[0]}


def test_pickle_whole_ddp_then_train(pools) -> None:
    for r in pools.run(2, _pickle_and_train_on):
        assert r["losses_equal"] and r["params_equal"], r
