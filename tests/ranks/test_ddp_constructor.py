"""Constructing gradring's DDP, against torch's where torch runs: no process group
yet, a subgroup, a device mesh; bad arguments and torch's SyncBatchNorm on the CPU
refused; the attributes the arguments set; the init sync from rank 0; and models
that differ across ranks refused with a text naming the difference.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradring
from tests.support.side_by_side import BOTH, IMPLS, Net, _train


def _init_sync(rank, world_size):
    torch.manual_seed(rank)  # every rank starts different
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model[1].running_mean.fill_(float(rank))
    ddp = gradring.DistributedDataParallel(model)
    flat = torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()]
                     + [model[1].running_mean])
    out = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(out, flat)
    return all(torch.equal(out[0], o) for o in out) and model[1].running_mean[0].item() == 0.0


def test_init_sync_broadcasts_rank0_params_and_buffers(pools):
    assert pools.run(3, _init_sync) == [True, True, True]


def test_errors_without_process_group():
    assert not dist.is_initialized()
    # The exception type torch's DDP raises, with a message naming the fix.
    with pytest.raises(Exception) as theirs:
        torch.nn.parallel.DistributedDataParallel(nn.Linear(2, 2))
    with pytest.raises(type(theirs.value), match="init_process_group"):
        gradring.DistributedDataParallel(nn.Linear(2, 2))


def test_before_init_process_group_raises_torchs_type():
    assert not dist.is_initialized()
    caught = {}
    for name, cls in IMPLS.items():
        with pytest.raises(Exception) as info:
            cls(nn.Linear(2, 2))
        caught[name] = info.value
    assert isinstance(caught["torch"], ValueError)
    assert isinstance(caught["gradring"], type(caught["torch"]))
    assert isinstance(caught["gradring"], RuntimeError)  # what gradring raised before
    assert "init_process_group" in str(caught["gradring"])


def _subgroup(rank, world_size):
    sub = dist.new_group([0, 1])
    if rank > 1:
        return None
    torch.manual_seed(rank)
    ddp = gradring.DistributedDataParallel(nn.Linear(2, 1, bias=False), process_group=sub)
    ddp(torch.full((1, 2), float(rank + 1))).sum().backward()
    return ddp.module.weight.grad.tolist()


def test_subgroup(pools):
    res = pools.run(3, _subgroup)
    assert res[2] is None
    assert res[0] == res[1] == [[1.5, 1.5]]


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


@pytest.mark.timeout(180)
def test_device_mesh(pools) -> None:
    for r in pools.run(2, _device_mesh):
        assert r["ours"] == r["theirs"] and r["ours"]["group"], r


def _bad_args(rank, world_size):
    out = {}
    cases = {
        "frozen": lambda: gradring.DistributedDataParallel(nn.Linear(2, 2).requires_grad_(False)),
        "device_ids": lambda: gradring.DistributedDataParallel(nn.Linear(2, 2), device_ids=[0, 1]),
        "mixed": lambda: gradring.DistributedDataParallel(
            nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.Linear(2, 2, device="meta")})),
        "unsupported": lambda: gradring.DistributedDataParallel(
            nn.Linear(2, 2), batched_grad_copy=True),
        "cap": lambda: gradring.DistributedDataParallel(nn.Linear(2, 2),
                                                       bucket_cap_mb=float("nan")),
    }
    for name, fn in cases.items():
        try:
            fn()
            out[name] = "no error"
        except Exception as e:  # noqa: BLE001
            out[name] = f"{type(e).__name__}: {e}"
    return out


def test_bad_arguments(pools):
    out = pools.run(2, _bad_args)[0]
    assert out["frozen"].startswith("RuntimeError") and "requires a gradient" in out["frozen"]
    assert out["device_ids"] == ("ValueError: device_ids can only be None or contain a single "
                                 "element.")
    assert out["mixed"].startswith("ValueError") and "meta" in out["mixed"]
    assert out["unsupported"].startswith("NotImplementedError")
    assert "batched_grad_copy" in out["unsupported"]
    assert out["cap"].startswith("ValueError")


def _attributes(rank: int, world: int) -> dict:
    out = {}
    for name, cls in BOTH:
        res = {}
        for kw in ({}, {"bucket_cap_mb": 5}, {"bucket_cap_mb_list": [1, 4]}):
            ddp = cls(Net(rank), **kw)
            res[str(kw)] = (ddp.bucket_bytes_cap, list(ddp.bucket_bytes_cap_list),
                            ddp.bucket_bytes_cap_default, ddp.broadcast_bucket_size,
                            ddp.process_group is dist.group.WORLD, ddp.is_multi_device_module,
                            ddp.use_side_stream_for_tensor_copies, ddp.batched_grad_copy)
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


@pytest.mark.timeout(180)
def test_attributes_match_torch(pools) -> None:
    for r in pools.run(2, _attributes):
        assert r["ours"] == r["theirs"], r


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


@pytest.mark.timeout(180)
def test_torch_syncbatchnorm_on_cpu_refused_at_construction(pools) -> None:
    for r in pools.run(2, _torch_syncbn_on_cpu):
        assert r["theirs"][0] == r["ours"][0] == "ValueError", r
        assert r["theirs"][1] in r["ours"][1], r  # torch's words, then ours
        assert "gradring.nn.SyncBatchNorm.convert_sync_batchnorm" in r["ours"][1], r
        assert "'1'" in r["ours"][1], r  # the layer is named


def _param_count_mismatch(rank, world_size):
    layers = [nn.Linear(2, 2)] + ([nn.Linear(2, 2)] if rank == 0 else [])
    try:
        gradring.DistributedDataParallel(nn.Sequential(*layers))
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_param_count_mismatch_error(pools):
    msgs = pools.run(2, _param_count_mismatch)
    for m in msgs:
        assert "DDP expects same model across all ranks, but Rank 0 has 4 params, " \
               "while rank 1 has inconsistent 2 params." in m


def _shape_mismatch(rank, world_size):
    try:
        gradring.DistributedDataParallel(nn.Linear(3, 2 + rank))
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_param_shape_mismatch_error(pools):
    msgs = pools.run(2, _shape_mismatch)
    msg = msgs[1]
    assert "params[0] in this process with sizes [3, 3] appears not to match sizes of the " \
           "same param in process 0." in msg
    assert "'weight'" in msg
    # Each rank states its own shape and the other side's (rank 0 used to print
    # rank 1's shape as "in this process").
    assert "this process (rank 1) has sizes [3, 3]" in msg and "rank 0 has [2, 3]" in msg
    assert "params[0] in process 1 with sizes [3, 3]" in msgs[0]
    assert "this process (rank 0) has sizes [2, 3]" in msgs[0]


def _swapped_order(rank, world_size):
    keys = ["left", "right"] if rank == 0 else ["right", "left"]
    torch.manual_seed(0)
    model = nn.ModuleDict({k: nn.Linear(4, 4) for k in keys})
    try:
        gradring.DistributedDataParallel(model)
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_same_shapes_in_another_order_fail_at_construction(pools):
    # torch's DDP trains this silently wrong: params[0] of one rank is averaged
    # with params[0] of the other, a different layer of the same shape.
    for rank, msg in enumerate(pools.run(2, _swapped_order)):
        assert "params[0] is 'left.weight' on rank 0 and 'right.weight' on rank 1" in msg, msg
        assert f"this process is rank {rank}" in msg
