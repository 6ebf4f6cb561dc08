"""The fused optimizer against DDP followed by a separate ``optimizer.step()``.

Oracle: the same model wrapped twice by gradring's DDP with the same options;
one copy registers ``_register_fused_optim``, the other calls ``step()`` on a
regular optimizer after backward. Per-parameter optimizers for element-wise
updates (SGD, Adam) compute exactly what one optimizer over all parameters
does, so parameters must agree to float64 round-off at every step.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradring
from gradring import hooks as H
from gradring.fused_optim import FusedOptimizer

TOL = 1e-6
WIDTH = 256  # float64 256x256 = 512 KiB per layer: several buckets after the rebuild
OPTIMS: dict[str, tuple[type, dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-2}),
    "adam": (torch.optim.Adam, {"lr": 1e-3, "weight_decay": 1e-2}),
}


class Net(nn.Module):
    """A deep MLP; with ``branchy`` some layers are used on rank 0 only, in the first
    two steps only, or never (find_unused_parameters territory)."""

    def __init__(self, *, branchy: bool) -> None:
        super().__init__()
        self.branchy = branchy
        self.inp = nn.Linear(8, WIDTH)
        self.hidden = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.rank0_only = nn.Linear(WIDTH, WIDTH)
        self.early = nn.Linear(WIDTH, WIDTH)
        self.never = nn.Linear(WIDTH, 4)
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor, rank: int = 0, step: int = 0) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for layer in self.hidden:
            h = torch.tanh(layer(h))
        if self.branchy:
            if rank == 0:
                h = h + torch.tanh(self.rank0_only(h))
            if step < 2:
                h = h + torch.tanh(self.early(h))
        else:
            h = h + torch.tanh(self.rank0_only(h)) + torch.tanh(self.early(h))
            return self.head(h) + self.never(h)
        return self.head(h)


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 8, generator=g, dtype=torch.float64), torch.randint(0, 4, (4,),
                                                                                generator=g)


def _flat_params(m: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


# ------------------------------------------------------------------ rank-side code
def _parity(rank: int, world: int, optim: str, branchy: bool, ddp_kwargs: dict[str, Any],
            steps: int, set_to_none: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    base = Net(branchy=branchy).double()
    cls, hyper = OPTIMS[optim]
    kw = dict(bucket_cap_mb=0.5, **ddp_kwargs)
    fused_ddp = gradring.DistributedDataParallel(copy.deepcopy(base), **kw)
    fused_ddp._register_fused_optim(cls, **hyper)
    plain_ddp = gradring.DistributedDataParallel(copy.deepcopy(base), **kw)
    opt = cls(plain_ddp.parameters(), **hyper)
    fused: FusedOptimizer = fused_ddp._fused_optim
    worst, early_after, buckets = 0.0, None, []
    for step in range(steps):
        x, y = _batch(step, rank)
        fused_ddp.zero_grad(set_to_none=set_to_none)
        opt.zero_grad(set_to_none=set_to_none)
        nn.functional.cross_entropy(fused_ddp(x, rank=rank, step=step), y).backward()
        nn.functional.cross_entropy(plain_ddp(x, rank=rank, step=step), y).backward()
        opt.step()
        worst = max(worst, (_flat_params(fused_ddp) - _flat_params(plain_ddp)).abs().max().item())
        buckets.append(len(fused_ddp.reducer.buckets))
        if step == 1:
            early_after = fused_ddp.module.early.weight.detach().clone()
    m = fused_ddp.module
    out = {
        "worst": worst,
        "params": _flat_params(fused_ddp),
        "buckets": buckets,
        "steps_taken": fused.param_steps,
        "has_grad": [p.grad is not None for p in m.parameters()],
        "never_moved": torch.equal(m.never.weight, base.never.weight),
        "never_state": len(fused.optimizer_for(m.never.weight).state),
        "early_frozen": early_after is not None and torch.equal(m.early.weight, early_after),
    }
    dist.barrier()
    return out


class _GatedComm:
    """Passes every collective through, but the last bucket's future completes only
    once the fused optimizer has stepped bucket 0 (or after a timeout, recorded)."""

    def __init__(self, real: Any, reducer: Any, opened: threading.Event) -> None:
        self._real, self._reducer, self._opened = real, reducer, opened
        self.timed_out = False

    def all_reduce(self, tensor: torch.Tensor, **kwargs: Any) -> torch.futures.Future:
        return self._gated(tensor, self._real.all_reduce(tensor, **kwargs))

    def all_reduce_homed(self, tensor: torch.Tensor, *args: Any,
                         **kwargs: Any) -> torch.futures.Future:
        # A bucket whose gradients stay in .grad takes this path: gated the same way.
        return self._gated(tensor, self._real.all_reduce_homed(tensor, *args, **kwargs))

    def _gated(self, tensor: torch.Tensor, fut: Any) -> Any:
        buckets = self._reducer.buckets
        if len(buckets) < 2 or tensor.data_ptr() != buckets[-1].buffer.data_ptr():
            return fut
        out: torch.futures.Future = torch.futures.Future()

        def release() -> None:
            value = fut.wait()
            if not self._opened.wait(timeout=10):
                self.timed_out = True
            out.set_result(value)

        threading.Thread(target=release, daemon=True).start()
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _steps_before_later_buckets(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    ddp = gradring.DistributedDataParallel(Net(branchy=False).double(), bucket_cap_mb=0.5)
    ddp._register_fused_optim(torch.optim.SGD, lr=0.01, momentum=0.9)
    reducer = ddp.reducer
    opened = threading.Event()
    gate = _GatedComm(reducer.comm, reducer, opened)
    reducer.comm = gate
    inner = reducer.post_reduce
    seen: list[tuple[int, int, bool, int]] = []

    def spy(bucket: Any) -> None:
        last = reducer.buckets[-1]
        seen.append((step, bucket.index, last.future.done(), len(reducer.buckets)))
        inner(bucket)
        if bucket.index == 0:
            opened.set()

    reducer.post_reduce = spy
    for step in range(3):
        opened.clear()
        x, y = _batch(step, rank)
        ddp.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(ddp(x), y).backward()
    dist.barrier()
    return {"seen": seen, "timed_out": gate.timed_out}


def _errors(rank: int, world: int) -> dict[str, str]:
    torch.manual_seed(0)
    out: dict[str, str] = {}

    def fresh() -> gradring.DistributedDataParallel:
        return gradring.DistributedDataParallel(nn.Linear(4, 2))

    def catch(key: str, fn: Any) -> None:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - the test inspects the type and text
            out[key] = f"{type(exc).__name__}: {exc}"
        else:
            out[key] = "no error"

    a = fresh()
    a._register_fused_optim(torch.optim.SGD, lr=0.1)
    catch("twice", lambda: a._register_fused_optim(torch.optim.SGD, lr=0.1))
    catch("hook_after", lambda: a.register_comm_hook(None, H.allreduce_hook))

    def enter_no_sync() -> None:
        with a.no_sync():
            pass
    catch("no_sync", enter_no_sync)

    b = fresh()
    b.register_comm_hook(None, H.allreduce_hook)
    catch("hook_before", lambda: b._register_fused_optim(torch.optim.SGD, lr=0.1))

    c = fresh()
    catch("not_a_class", lambda: c._register_fused_optim(torch.optim.SGD([c.module.weight], 0.1)))
    catch("not_an_optimizer", lambda: c._register_fused_optim(nn.Linear, 4, 2))
    catch("lbfgs", lambda: c._register_fused_optim(torch.optim.LBFGS))
    catch("stranger", lambda: c._register_fused_optim(
        torch.optim.SGD, lr=0.1, optim_params=[nn.Parameter(torch.zeros(2))]))
    catch("bad_hyper", lambda: c._register_fused_optim(torch.optim.SGD, lr=-1.0))
    # None of the failed attempts counted: a valid registration still works.
    catch("valid_after_failures", lambda: c._register_fused_optim(torch.optim.SGD, lr=0.1))
    dist.barrier()
    return out


def _subset_and_state(rank: int, world: int) -> dict[str, Any]:
    """optim_params: fused SGD on some parameters, a regular SGD on the rest, equals one
    SGD over all; then a state_dict round trip continues identically."""
    torch.manual_seed(0)
    base = Net(branchy=False).double()
    hyper = {"lr": 0.05, "momentum": 0.9}
    mixed = gradring.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.5)
    fused_part = [mixed.module.head.weight, mixed.module.inp.weight] + \
        list(mixed.module.hidden.parameters())
    mixed._register_fused_optim(torch.optim.SGD, optim_params=fused_part, **hyper)
    rest = [p for p in mixed.parameters() if all(p is not q for q in fused_part)]
    rest_opt = torch.optim.SGD(rest, **hyper)
    ref = gradring.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), **hyper)
    worst = 0.0

    def train(step: int) -> None:
        nonlocal worst
        x, y = _batch(step, rank)
        for m, o in ((mixed, rest_opt), (ref, ref_opt)):
            m.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(m(x), y).backward()
            o.step()
        worst = max(worst, (_flat_params(mixed) - _flat_params(ref)).abs().max().item())

    for step in range(3):
        train(step)
    fused: FusedOptimizer = mixed._fused_optim
    saved = copy.deepcopy(fused.state_dict())  # as if written to disk
    for opt in fused.optimizers:  # wreck the momentum, then restore it
        for st in opt.state.values():
            st["momentum_buffer"].mul_(-3.0)
    fused.load_state_dict(saved)
    for step in range(3, 5):
        train(step)
    try:
        fused.load_state_dict({"per_param": {"nope": {}}})
        mismatch = "no error"
    except KeyError as exc:
        mismatch = str(exc)
    dist.barrier()
    return {"worst": worst, "keys": sorted(saved["per_param"]), "names": fused.names,
            "mismatch": mismatch, "groups": len(fused.param_groups)}


# ------------------------------------------------------------------------ tests
CASES = [
    # (optimizer, branchy model, DDP options, world, set_to_none)
    ("sgd", False, {}, 2, True),
    ("adam", False, {"gradient_as_bucket_view": True}, 2, True),
    ("sgd", True, {"find_unused_parameters": True}, 2, True),
    ("adam", True, {"find_unused_parameters": True, "gradient_as_bucket_view": True}, 2, True),
    ("sgd", False, {"static_graph": True}, 2, False),
    ("adam", False, {"gradient_as_bucket_view": True}, 3, True),
]


@pytest.mark.parametrize("optim,branchy,ddp_kwargs,world,set_to_none", CASES,
                         ids=[f"{c[0]}-{'branchy' if c[1] else 'deep'}-"
                              f"{'+'.join(c[2]) or 'default'}-w{c[3]}" for c in CASES])
def test_fused_equals_ddp_then_step(pools, optim, branchy, ddp_kwargs, world, set_to_none):
    steps = 5
    res = pools.run(world, _parity, optim, branchy, ddp_kwargs, steps, set_to_none)
    for r in res:
        assert r["worst"] < TOL, r["worst"]
        assert torch.equal(r["params"], res[0]["params"])  # every rank holds the same model
    r0 = res[0]
    # The rebuild after iteration 1 happened and split the model into several buckets,
    # and the per-parameter optimizers kept stepping across it.
    assert r0["buckets"][-1] >= 2, r0["buckets"]
    if not branchy:
        assert r0["steps_taken"] == steps * len(r0["has_grad"])
        return
    # Parameters no rank used keep .grad None: never stepped, no optimizer state,
    # and `early` stops moving once it is no longer used.
    names = [n for n, _ in Net(branchy=True).named_parameters()]
    has_grad = dict(zip(names, r0["has_grad"]))
    assert not has_grad["never.weight"] and not has_grad["early.weight"]
    assert has_grad["rank0_only.weight"]  # used on one rank: averaged and stepped everywhere
    assert r0["never_moved"] and r0["never_state"] == 0
    assert r0["early_frozen"]


def test_each_bucket_steps_before_later_buckets_complete(pools):
    res = pools.run(2, _steps_before_later_buckets)
    for r in res:
        assert not r["timed_out"], "the last bucket's reduction was awaited before bucket 0 " \
                                   "was stepped"
        multi = [s for s in r["seen"] if s[3] >= 2]
        assert multi, r["seen"]
        for step in {s[0] for s in multi}:
            order = [s[1] for s in multi if s[0] == step]
            assert order == sorted(order) and order[0] == 0
            first = next(s for s in multi if s[0] == step and s[1] == 0)
            assert first[2] is False  # last bucket still in flight while bucket 0 stepped


def test_fused_restrictions_raise_clear_errors(pools):
    out = pools.run(2, _errors)[0]
    assert out["twice"].startswith("RuntimeError") and "once" in out["twice"]
    assert out["hook_after"].startswith("RuntimeError") and "fused" in out["hook_after"]
    assert out["hook_before"].startswith("RuntimeError") and "hook" in out["hook_before"]
    assert out["no_sync"].startswith("RuntimeError") and "no_sync" in out["no_sync"]
    assert out["not_a_class"].startswith("TypeError")
    assert out["not_an_optimizer"].startswith("TypeError")
    assert out["lbfgs"].startswith("ValueError") and "LBFGS" in out["lbfgs"]
    assert out["stranger"].startswith("ValueError") and "optim_params[0]" in out["stranger"]
    assert out["bad_hyper"].startswith("ValueError")
    assert out["valid_after_failures"] == "no error"


def test_optim_params_subset_and_state_dict_round_trip(pools):
    res = pools.run(2, _subset_and_state)
    for r in res:
        assert r["worst"] < TOL, r["worst"]
        assert r["keys"] == sorted(r["names"])
        assert "head.weight" in r["names"] and "head.bias" not in r["names"]
        assert "missing" in r["mismatch"] and "nope" in r["mismatch"]
        assert r["groups"] == len(r["names"])
