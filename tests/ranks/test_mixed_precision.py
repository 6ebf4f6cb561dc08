"""Mixed precision and gradient clipping through gradring's DDP.

Oracles: torch's own DistributedDataParallel trained on the same seeds and
batches (GradScaler + bfloat16 autocast), and one process on the
concatenated global batch (clip_grad_norm_).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradring
from gradring import hooks as H
from tests.support.oracle import global_batch, make_batch, make_model

STEPS = 6
INJECT = 3  # the step at which the last rank's input holds an inf
TOL = 1e-6


def _params(m: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def _amp_loop(model: nn.Module, rank: int, world: int, *, inject: int | None,
              ) -> dict[str, list[Any]]:
    """Train with GradScaler + bf16 autocast; unscale, clip, step, update each iteration."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=2)
    rec: dict[str, list[Any]] = {"loss": [], "scale": [], "moved": [], "norm": [], "params": []}
    for step in range(STEPS):
        x, y = make_batch("mlp", step, rank, world)
        if step == inject and rank == world - 1:
            x[0, 0] = float("inf")
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        loss = nn.functional.cross_entropy(out.float(), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        before = _params(model)
        scaler.step(opt)
        scaler.update()
        rec["loss"].append(loss.item())
        rec["scale"].append(scaler.get_scale())
        rec["moved"].append(not torch.equal(before, _params(model)))
        rec["norm"].append(norm.item())
        rec["params"].append(_params(model))
    return rec


# ------------------------------------------------------------------ rank-side code
def _amp_vs_torch(rank: int, world: int, ddp_kwargs: dict[str, Any],
                  inject: int | None) -> dict[str, Any]:
    base = make_model("mlp")
    ours = gradring.DistributedDataParallel(copy.deepcopy(base), **ddp_kwargs)
    theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(base), **ddp_kwargs)
    out = {"ours": _amp_loop(ours, rank, world, inject=inject),
           "torch": _amp_loop(theirs, rank, world, inject=inject)}
    dist.barrier()
    return out


def _inf_through_hooks(rank: int, world: int) -> dict[str, dict[str, list[Any]]]:
    """An inf on one rank must survive every gradient-preserving hook's reduction."""
    hooks = {"allreduce": H.allreduce_hook, "fp16": H.fp16_compress_hook,
             "bf16": H.bf16_compress_hook, "quant_pertensor": H.quantization_pertensor_hook}
    out = {}
    for name, hook in hooks.items():
        ddp = gradring.DistributedDataParallel(make_model("mlp"))
        ddp.register_comm_hook(None, hook)
        rec = _amp_loop(ddp, rank, world, inject=INJECT)
        out[name] = {k: rec[k] for k in ("scale", "moved", "norm")}
    dist.barrier()
    return out


def _clip(rank: int, world: int, norm_type: float) -> dict[str, Any]:
    base = make_model("mlp").double()
    ours = gradring.DistributedDataParallel(copy.deepcopy(base))
    single = copy.deepcopy(base)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, single)]
    rec: dict[str, Any] = {"norm": [], "single_norm": [], "grad_diff": 0.0, "param_diff": 0.0}
    for step in range(4):
        for o in opts:
            o.zero_grad(set_to_none=True)
        x, y = make_batch("mlp", step, rank, world)
        nn.functional.cross_entropy(ours(x.double()), y).backward()
        gx, gy = global_batch("mlp", step, world)
        nn.functional.cross_entropy(single(gx.double()), gy).backward()
        # A small max_norm: clipping is active, so the clipped gradients are compared too.
        rec["norm"].append(nn.utils.clip_grad_norm_(ours.parameters(), 0.05, norm_type).item())
        rec["single_norm"].append(
            nn.utils.clip_grad_norm_(single.parameters(), 0.05, norm_type).item())
        for a, b in zip(ours.module.parameters(), single.parameters()):
            rec["grad_diff"] = max(rec["grad_diff"], (a.grad - b.grad).abs().max().item())
        for o in opts:
            o.step()
        rec["param_diff"] = max(rec["param_diff"],
                                (_params(ours) - _params(single)).abs().max().item())
    dist.barrier()
    return rec


# ------------------------------------------------------------------------ tests
def _assert_same_run(a: dict[str, list[Any]], b: dict[str, list[Any]]) -> None:
    assert a["scale"] == b["scale"]
    assert a["moved"] == b["moved"]
    for la, lb in zip(a["loss"], b["loss"]):
        assert la == pytest.approx(lb, rel=TOL, abs=TOL) or (math.isnan(la) and math.isnan(lb))
    for pa, pb in zip(a["params"], b["params"]):
        assert (pa - pb).abs().max().item() < TOL


@pytest.mark.parametrize("ddp_kwargs", [{}, {"gradient_as_bucket_view": True}],
                         ids=["default", "bucket_view"])
def test_grad_scaler_bf16_autocast_matches_torch_ddp(pools, ddp_kwargs):
    res = pools.run(2, _amp_vs_torch, ddp_kwargs, None)
    for r in res:
        _assert_same_run(r["ours"], r["torch"])
        assert all(r["ours"]["moved"])  # no inf: every step taken
        assert r["ours"]["scale"][-1] > 2.0 ** 12  # and the scale grew (growth_interval=2)
        assert torch.equal(r["ours"]["params"][-1], res[0]["ours"]["params"][-1])


def test_inf_on_one_rank_skips_the_step_everywhere(pools):
    res = pools.run(2, _amp_vs_torch, {}, INJECT)
    for r in res:
        ours = r["ours"]
        _assert_same_run(ours, r["torch"])
        # The bad rank's inf reached every rank through the sum: every rank skipped
        # the step (parameters unchanged) and halved its scale.
        assert ours["moved"] == [i != INJECT for i in range(STEPS)]
        assert ours["scale"][INJECT] == ours["scale"][INJECT - 1] * 0.5
        assert not math.isfinite(ours["norm"][INJECT])
        assert torch.equal(ours["params"][INJECT], ours["params"][INJECT - 1])
        assert torch.equal(ours["params"][-1], res[0]["ours"]["params"][-1])
    assert all(math.isfinite(r["ours"]["loss"][INJECT]) for r in res[:-1])


def test_inf_on_one_rank_survives_comm_hooks(pools):
    res = pools.run(2, _inf_through_hooks)
    for name in res[0]:
        for r in res:
            got = r[name]
            assert got["moved"] == [i != INJECT for i in range(STEPS)], name
            assert got["scale"][INJECT] == got["scale"][INJECT - 1] * 0.5, name
            assert got["scale"] == res[0][name]["scale"], name


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_clip_grad_norm_sees_the_global_gradient(pools, norm_type):
    res = pools.run(2, _clip, norm_type)
    for r in res:
        assert r["norm"] == res[0]["norm"]  # bitwise the same norm on every rank
        for got, want in zip(r["norm"], r["single_norm"]):
            assert got == pytest.approx(want, rel=1e-9)
            assert got > 0.05  # clipping was active
        assert r["grad_diff"] < 1e-9 and r["param_diff"] < 1e-9
