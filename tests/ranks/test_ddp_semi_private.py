"""torch DDP's semi-private methods on gradring's DDP, each against torch's own DDP:
ignored parameters and buffers, buffer comm hooks and _default_broadcast_coalesced,
_remove_autograd_hooks, the logging data's error and sample rate, a late
_set_static_graph, and optimizers applied in backward (with the rule that one
consumer takes the buckets).

Every rank function runs the same scenario twice in the same processes, once
with torch's DDP and once with gradring's (or a one-process oracle where torch
cannot run it on CPU), and the test compares the two.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel.distributed import _BufferCommHookLocation

import gradring
from tests.support.side_by_side import BOTH, Net, _batch, _equal, _state, _train

pytestmark = pytest.mark.timeout(180)


def _ignored(rank: int, world: int) -> dict:
    out = {}
    for name, cls in BOTH:
        model = Net(rank).double()
        cls._set_params_and_buffers_to_ignore_for_model(model, ["fc2.weight", "local"])
        ddp = cls(model)
        _train(ddp, rank)
        out[name] = {"state": _state(model), "ignore": sorted(ddp.parameters_to_ignore),
                     "dp": [n for n, _ in cls._get_data_parallel_params(model, True)],
                     "dp_plain": len(list(cls._get_data_parallel_params(model)))}
    return {"diff": _equal(out["ours"]["state"], out["theirs"]["state"], world),
            "same": {k: out["ours"][k] == out["theirs"][k] for k in ("ignore", "dp", "dp_plain")},
            "ignore": out["ours"]["ignore"]}


@pytest.mark.parametrize("world", [2, 3])
def test_ignored_parameters_and_buffers(pools, world) -> None:
    for r in pools.run(world, _ignored):
        assert r["diff"] == [] and all(r["same"].values()), r
        assert r["ignore"] == ["fc2.weight", "local"], r


def _sum_buffers(state, named_buffers):
    futures = [dist.all_reduce(b, async_op=True).get_future() for b in named_buffers.values()]
    if state == "wait":  # before forward: the forward writes the buffers next
        for f in futures:
            f.wait()
        return None
    return futures  # after forward: DDP waits for them at the end of backward


def _buffer_hooks(rank: int, world: int) -> dict:
    out = {}
    for loc in (_BufferCommHookLocation.PRE_FORWARD, _BufferCommHookLocation.POST_FORWARD):
        per = {}
        for name, cls in BOTH:
            model = Net(rank).double()
            ddp = cls(model)
            state = "wait" if loc is _BufferCommHookLocation.PRE_FORWARD else None
            ddp._register_buffer_comm_hook(state, _sum_buffers, loc)
            _train(ddp, rank)
            per[name] = _state(model)
        out[loc.name] = _equal(per["ours"], per["theirs"])
    per = {}
    for name, cls in BOTH:
        model = Net(rank).double()
        ddp = cls(model, init_sync=False)
        ddp._default_broadcast_coalesced(authoritative_rank=world - 1)
        bufs = [torch.full((3,), float(rank), dtype=torch.float64)]
        ddp._default_broadcast_coalesced(bufs=bufs, bucket_size=1 << 20, authoritative_rank=1)
        per[name] = {**_state(model), "extra": bufs[0]}
    out["broadcast_coalesced"] = _equal(per["ours"], per["theirs"])
    return out


def test_buffer_comm_hooks_and_broadcast(pools) -> None:
    for r in pools.run(2, _buffer_hooks):
        assert r == {"PRE_FORWARD": [], "POST_FORWARD": [], "broadcast_coalesced": []}, r


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("boom in backward")


def _rewrap_after_failure(rank: int, world: int) -> dict:
    out = {}
    for name, cls in BOTH:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 3)).double()
        ddp = cls(model)
        try:
            _Boom.apply(ddp(_batch(0, rank))).sum().backward()
        except RuntimeError:
            pass
        ddp._remove_autograd_hooks()
        for p in model.parameters():
            p.grad = None
        ddp2 = cls(model)
        _train(ddp2, rank)
        out[name] = _state(model)
    return {"diff": _equal(out["ours"], out["theirs"])}


def test_remove_autograd_hooks_then_new_ddp(pools) -> None:
    for r in pools.run(2, _rewrap_after_failure):
        assert r["diff"] == [], r


def _errors_and_logging(rank: int, world: int) -> dict:
    out = {}
    for name, cls in BOTH:
        res = {}
        ddp = cls(Net(rank).double())
        res["clean"] = ddp._get_ddp_logging_data().get("has_error", 0)
        try:
            ddp.register_comm_hook(None, 5)
        except Exception as exc:  # noqa: BLE001 - compared with torch's
            res["not_callable"] = (type(exc).__name__, "callable" in str(exc))
        data = ddp._get_ddp_logging_data()
        res["has_error"] = data.get("has_error", 0)
        res["error_text"] = "callable" in str(data.get("error", ""))
        try:
            ddp._set_ddp_runtime_logging_sample_rate(0)
        except Exception as exc:  # noqa: BLE001
            res["rate"] = type(exc).__name__
        ddp._set_ddp_runtime_logging_sample_rate(2)
        _train(ddp, rank, steps=1)
        try:
            ddp._set_static_graph()
        except Exception as exc:  # noqa: BLE001
            res["static_late"] = (type(exc).__name__,
                                  "should be called before training loop starts" in str(exc))
        out[name] = res
    out["syncbn"] = gradring.SyncBatchNorm is gradring.nn.SyncBatchNorm
    return out


def test_errors_logging_and_small_api(pools) -> None:
    for r in pools.run(2, _errors_and_logging):
        assert r["ours"] == r["theirs"], r
        assert r["ours"]["not_callable"] == ("TypeError", True), r
        assert r["ours"]["has_error"] == 1 and r["ours"]["error_text"], r
        assert r["syncbn"]


def _optim_in_backward(rank: int, world: int) -> dict:
    """torch's DDP runs in-backward optimizers only on an accelerator (its hook
    waits on a device stream), so the oracle is one process on the
    concatenated global batch, with torch's in-backward optimizer applied."""
    from torch.distributed.optim import _apply_optimizer_in_backward

    out = {}
    for name in ("ours", "oracle"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 3)).double()
        _apply_optimizer_in_backward(torch.optim.SGD, model[2].parameters(), {"lr": 0.1})
        net = gradring.DistributedDataParallel(model) if name == "ours" else model
        opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
        for s in range(3):
            opt.zero_grad()
            x = _batch(s, rank) if name == "ours" else \
                torch.cat([_batch(s, r) for r in range(world)])
            net(x).pow(2).mean().backward()
            opt.step()
        out[name] = {**{k: v.detach().clone() for k, v in model.state_dict().items()},
                     "none": [p.grad is None for p in model[2].parameters()]}
    diff = max((out["ours"][k] - out["oracle"][k]).abs().max().item()
               for k in out["ours"] if k != "none")
    return {"diff": diff, "none": out["ours"]["none"], "oracle_none": out["oracle"]["none"]}


def test_apply_optimizer_in_backward(pools) -> None:
    for r in pools.run(2, _optim_in_backward):
        assert r["diff"] < 1e-12 and r["none"] == r["oracle_none"] == [True, True], r


def _one_consumer(rank: int, world: int) -> dict:
    """A comm hook, a fused optimizer and in-backward optimizers: one per DDP
    ([Note: one consumer]); torch's DDP builds the last two from comm hooks."""
    from torch.distributed.optim import _apply_optimizer_in_backward

    from gradring.hooks import default as H

    def text(fn: object) -> str:
        try:
            fn()
        except RuntimeError as exc:
            return str(exc)
        return "no error"

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    _apply_optimizer_in_backward(torch.optim.SGD, model[1].parameters(), {"lr": 0.1})
    ddp = gradring.DistributedDataParallel(model)
    ddp(torch.randn(2, 4)).sum().backward()  # the first forward sets them up
    out = {"hook_after_in_backward": text(lambda: ddp.register_comm_hook(None, H.allreduce_hook)),
           "fused_after_in_backward": text(lambda: ddp._register_fused_optim(torch.optim.SGD,
                                                                             lr=0.1)),
           "logged": "in backward" in ddp._get_ddp_logging_data().get("error", "")}
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    _apply_optimizer_in_backward(torch.optim.SGD, model[1].parameters(), {"lr": 0.1})
    ddp = gradring.DistributedDataParallel(model)
    ddp.register_comm_hook(None, H.allreduce_hook)
    out["in_backward_after_hook"] = text(lambda: ddp(torch.randn(2, 4)))
    return out


def test_one_consumer_of_the_buckets(pools) -> None:
    for r in pools.run(2, _one_consumer):
        assert r.pop("logged"), r
        assert all("applied in backward" in v for v in r.values()), r
