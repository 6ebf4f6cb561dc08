"""torch DDP's semi-private surface on gradring's DDP, each against torch's own DDP.

Every rank function runs the same scenario twice in the same processes, once
with torch's DDP and once with gradring's, and the test compares the two.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel.distributed import _BufferCommHookLocation

import gradring

pytestmark = pytest.mark.timeout(180)

TORCH_DDP = torch.nn.parallel.DistributedDataParallel
BOTH = (("theirs", TORCH_DDP), ("ours", gradring.DistributedDataParallel))


class Net(nn.Module):
    def __init__(self, rank: int = 0) -> None:
        super().__init__()
        torch.manual_seed(rank)  # rank-dependent: what init sync does shows
        self.fc1 = nn.Linear(5, 6)
        self.fc2 = nn.Linear(6, 3)
        self.register_buffer("count", torch.full((2,), float(rank)))
        self.register_buffer("local", torch.full((1,), float(rank)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count += 1
        return self.fc2(torch.relu(self.fc1(x)))


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(100 * step + rank),
                       dtype=torch.float64)


def _train(ddp: nn.Module, rank: int, steps: int = 3) -> None:
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for s in range(steps):
        opt.zero_grad()
        ddp(_batch(s, rank)).pow(2).mean().backward()
        opt.step()


def _state(m: nn.Module) -> dict[str, torch.Tensor]:
    out = {k: v.detach().clone() for k, v in m.state_dict().items()}
    out.update({f"grad:{n}": p.grad.clone() for n, p in m.named_parameters()
                if p.grad is not None})
    return out


def _equal(a: dict, b: dict, world: int = 2) -> list[str]:
    """Keys whose tensors differ: bit for bit at world 2; at world 3 and more
    the ring sums in another order than gloo, so float64 within 1e-12."""
    def same(x: torch.Tensor, y: torch.Tensor) -> bool:
        if world <= 2 or not x.is_floating_point():
            return torch.equal(x, y)
        return x.shape == y.shape and torch.allclose(x, y, rtol=0, atol=1e-12)
    return sorted(k for k in set(a) | set(b) if k not in a or k not in b or not same(a[k], b[k]))


# ------------------------------------------------------------ ignored params
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


# -------------------------------------------------------------- buffer hooks
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


# ------------------------------------------------------ remove autograd hooks
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


# --------------------------------------------------------------- attributes
def _attributes(rank: int, world: int) -> dict:
    out = {}
    for name, cls in BOTH:
        res = {}
        for kw in ({}, {"bucket_cap_mb": 5}, {"bucket_cap_mb_list": [1, 4]}):
            ddp = cls(Net(rank), **kw)
            res[str(kw)] = (ddp.bucket_bytes_cap, list(ddp.bucket_bytes_cap_list),
                            ddp.broadcast_bucket_size, ddp.process_group is dist.group.WORLD)
        for kw in ({}, {"broadcast_buffers": False}, {"forward_sync_buffers": False},
                   {"broadcast_buffers": True, "forward_sync_buffers": False}):
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                ddp = cls(Net(rank), **kw)
            res["buf" + str(kw)] = (ddp.broadcast_buffers, ddp.forward_sync_buffers,
                                    sorted({w.category.__name__ for w in seen
                                            if "buffers" in str(w.message)}))
        ddp.broadcast_buffers = True
        res["setter"] = ddp.forward_sync_buffers
        other = Net(rank + 7)
        ddp.module = other
        res["module"] = ddp.module is other
        out[name] = res
    return {"ours": out["ours"], "theirs": out["theirs"]}


def test_attributes_match_torch(pools) -> None:
    for r in pools.run(2, _attributes):
        assert r["ours"] == r["theirs"], r


# -------------------------------------------------------------- device mesh
def _device_mesh(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    out = {}
    mesh = init_device_mesh("cpu", (world,))
    for name, cls in BOTH:
        res = {}
        ddp = cls(Net(0).double(), device_mesh=mesh)
        res["group"] = ddp.process_group == mesh.get_group(0)
        _train(ddp, rank, steps=1)
        for label, kw in (("both", {"device_mesh": mesh, "process_group": dist.group.WORLD}),):
            try:
                cls(Net(0), **kw)
                res[label] = None
            except Exception as exc:  # noqa: BLE001 - compared with torch's
                res[label] = (type(exc).__name__, str(exc))
        out[name] = res
    return out


def test_device_mesh(pools) -> None:
    for r in pools.run(2, _device_mesh):
        assert r["ours"] == r["theirs"] and r["ours"]["group"], r


# ------------------------------------------------- errors, logging, misc API
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


# -------------------------------------------------- optimizer in backward
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


def _user_post_accumulate_hooks(rank: int, world: int) -> dict:
    """A post-accumulate-grad hook registered after wrapping changes what is
    reduced: torch's DDP hooks the accumulator, which runs after it."""
    def scale(q: torch.Tensor) -> None:  # rank-dependent: the reduction shows whether it ran
        q.grad.mul_(rank + 1)

    out = {}
    for name, impl in BOTH:
        model = Net().double()
        ddp = impl(model)
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(scale)
        _train(ddp, rank, steps=4)
        out[name] = _state(model)
    return {"diff": _equal(out["theirs"], out["ours"], world)}


def test_user_post_accumulate_hooks_run_before_the_reduction_as_torch(pools) -> None:
    for r in pools.run(2, _user_post_accumulate_hooks):
        assert r["diff"] == [], r


def _frozen_after_wrapping(rank: int, world: int) -> dict:
    """A parameter frozen after wrapping and unfrozen later (a backbone
    trained only from some epoch on), with find_unused_parameters."""
    out = {}
    for name, impl in BOTH:
        model = Net().double()
        ddp = impl(model, find_unused_parameters=True)
        model.fc1.weight.requires_grad_(False)
        _train(ddp, rank, steps=3)
        model.fc1.weight.requires_grad_(True)
        _train(ddp, rank, steps=2)
        out[name] = _state(model)
    return {"diff": _equal(out["theirs"], out["ours"], world),
            "grad": "grad:fc1.weight" in out["ours"]}


def test_parameter_frozen_after_wrapping_then_unfrozen_as_torch(pools) -> None:
    for r in pools.run(2, _frozen_after_wrapping):
        assert r["diff"] == [] and r["grad"], r


# ------------------------------------------------ containers in and out
class Pair(NamedTuple):
    x: torch.Tensor
    scale: torch.Tensor


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    extra: torch.Tensor


class ContainerNet(nn.Module):
    """Takes a namedtuple, a dataclass and a dict; returns a namedtuple and a dataclass."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(5, 3)
        self.side = nn.Linear(5, 3)

    def forward(self, pair: Pair, batch: Batch, opts: dict) -> tuple[Pair, Batch]:
        a = self.fc(pair.x) * pair.scale
        b = self.side(batch.x) + batch.extra
        return Pair(a, b), Batch(a + opts["bias"], b)


def _containers(rank: int, world: int) -> dict:
    out = {}
    for kw in ({}, {"find_unused_parameters": True}, {"static_graph": True}):
        per = {}
        for name, cls in BOTH:
            model = ContainerNet().double()
            ddp = cls(model, **kw)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
            types = []
            for s in range(3):
                opt.zero_grad()
                x = _batch(s, rank)
                res = ddp(Pair(x, torch.full((3,), 2.0, dtype=torch.float64)),
                          Batch(x * 2, torch.ones(3, dtype=torch.float64)),
                          {"bias": torch.zeros(3, dtype=torch.float64)})
                types.append((type(res).__name__, type(res[0]).__name__,
                              type(res[1]).__name__))
                (res[0].x.pow(2).sum() + res[1].x.sum() + res[1].extra.mean()).backward()
                opt.step()
            per[name] = {"state": _state(model), "types": types}
        out[str(kw)] = {"diff": _equal(per["ours"]["state"], per["theirs"]["state"], world),
                        "types": per["ours"]["types"] == per["theirs"]["types"]}
    return out


def test_namedtuple_and_dataclass_inputs_and_outputs(pools) -> None:
    for r in pools.run(2, _containers):
        for kw, res in r.items():
            assert res == {"diff": [], "types": True}, (kw, r)


def test_inputs_move_to_the_device_as_torch_moves_them() -> None:
    """gradring.pytree.to_device against torch's DDP input move (_to_kwargs),
    on the meta device (no accelerator needed): namedtuples, lists, tuples and
    dicts are rebuilt with every tensor moved; torch leaves dataclasses alone,
    gradring moves them too ([Note: container rules])."""
    from torch.distributed.utils import _to_kwargs
    from torch.nn.utils.rnn import pack_sequence

    from gradring import pytree

    meta = torch.device("meta")
    t = torch.ones(2)
    inputs = (Pair(t, t + 1), [t, (t, {"k": t})], {"a": Pair(t, t)})
    kwargs = {"pair": Pair(t, t), "n": 3, "packed": pack_sequence([torch.ones(3), torch.ones(2)])}
    theirs_in, theirs_kw = _to_kwargs(inputs, kwargs, meta, False)
    ours_in, ours_kw = pytree.to_device(inputs, meta), pytree.to_device(kwargs, meta)

    def shape(obj: object) -> object:
        if isinstance(obj, torch.Tensor):
            return ("tensor", obj.device.type)
        if pytree.is_namedtuple(obj):
            return (type(obj).__name__, *[shape(v) for v in obj])
        if isinstance(obj, (list, tuple)):
            return (type(obj).__name__, *[shape(v) for v in obj])
        if isinstance(obj, dict):
            return (type(obj).__name__, {k: shape(v) for k, v in obj.items()})
        return obj

    assert shape(ours_in) == shape(theirs_in[0])
    assert shape(ours_kw) == shape(theirs_kw[0])
    assert shape(ours_in[0]) == ("Pair", ("tensor", "meta"), ("tensor", "meta"))
    # A PackedSequence moves whole: its data goes, its batch_sizes stay on the CPU.
    assert ours_kw["packed"].data.is_meta and ours_kw["packed"].batch_sizes.device.type == "cpu"
    assert theirs_kw[0]["packed"].batch_sizes.device.type == "cpu"
    # torch leaves a dataclass where it was; gradring moves the tensors inside it.
    batch = Batch(t, t)
    assert pytree.to_device(batch, meta).x.is_meta and not _to_kwargs((batch,), {}, meta,
                                                                      False)[0][0][0].x.is_meta


# ------------------------------------------------- torch's SyncBatchNorm on CPU
def _torch_syncbn_on_cpu(rank: int, world: int) -> dict:
    out = {}
    for name, cls in BOTH:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.SyncBatchNorm(4))
        try:
            cls(model)
            out[name] = None
        except Exception as exc:  # noqa: BLE001 - compared with torch's
            out[name] = (type(exc).__name__, str(exc))
    converted = gradring.nn.SyncBatchNorm.convert_sync_batchnorm(
        nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    ddp = gradring.DistributedDataParallel(converted)
    ddp(torch.randn(3, 4)).sum().backward()
    return out


def test_torch_syncbatchnorm_on_cpu_refused_at_construction(pools) -> None:
    for r in pools.run(2, _torch_syncbn_on_cpu):
        assert r["theirs"][0] == r["ours"][0] == "ValueError", r
        assert r["theirs"][1] in r["ours"][1], r  # torch's words, then ours
        assert "gradring.nn.SyncBatchNorm.convert_sync_batchnorm" in r["ours"][1], r
        assert "'1'" in r["ours"][1], r  # the layer is named


# ------------------------------------------ one consumer of the buckets
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
