"""DDP behaviour beyond the numbers: buckets, init sync, bad input, API surface."""

import io
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradring

# ---------------------------------------------------------------- rank bodies


def _linear12():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(12)])


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _reference_buckets(rank, world_size, find_unused):
    ddp = gradring.DistributedDataParallel(_linear12(), find_unused_parameters=find_unused)
    seen = []
    x = torch.randn(2, 1024)
    for _ in range(3):
        ddp(x).sum().backward()
        data = ddp._get_ddp_logging_data()
        # torch's logging data gives sizes as "n1, n2" and the rebuilt indices
        # flat; the reducer keeps each bucket's.
        seen.append((_ints(data["bucket_sizes"]), _ints(data["rebuilt_bucket_sizes"]),
                     ddp.reducer.rebuilt_param_indices, data["has_rebuilt_buckets"]))
    return seen


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


def _buffers_each_forward(rank, world_size):
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    ddp = gradring.DistributedDataParallel(model)
    x = torch.randn(8, 4) + rank
    ddp(x).sum().backward()
    # Each rank's BN now has local statistics; the next forward broadcasts rank 0's.
    before = model[1].running_mean.clone()
    ddp.eval()
    ddp(x)
    after = model[1].running_mean.clone()
    everyone = [torch.empty_like(after) for _ in range(world_size)]
    dist.all_gather(everyone, after)
    return all(torch.equal(everyone[0], e) for e in everyone), torch.equal(before, after)


def _param_count_mismatch(rank, world_size):
    layers = [nn.Linear(2, 2)] + ([nn.Linear(2, 2)] if rank == 0 else [])
    try:
        gradring.DistributedDataParallel(nn.Sequential(*layers))
    except RuntimeError as e:
        return str(e)
    return "no error"


def _shape_mismatch(rank, world_size):
    try:
        gradring.DistributedDataParallel(nn.Linear(3, 2 + rank))
    except RuntimeError as e:
        return str(e)
    return "no error"


def _backward_twice(rank, world_size):
    """torch's DDP averages the first backward and only accumulates the second
    one locally; gradring does the same and says so in a warning."""
    out = {}
    for name, cls in (("ours", gradring.DistributedDataParallel),
                      ("theirs", torch.nn.parallel.DistributedDataParallel)):
        torch.manual_seed(0)
        ddp = cls(nn.Linear(3, 3).double())
        x = torch.randn(2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
        loss = ddp(x).sum()
        loss.backward(retain_graph=True)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            loss.backward()
        out[name] = ([p.grad.clone() for p in ddp.parameters()],
                     [str(w.message) for w in seen if "second time" in str(w.message)])
    return {"same": all(torch.equal(a, b) for a, b in zip(out["ours"][0], out["theirs"][0])),
            "warned": out["ours"][1]}


def _no_grad_and_eval_leave_reducer_alone(rank, world_size):
    torch.manual_seed(0)
    ddp = gradring.DistributedDataParallel(nn.Linear(3, 3))
    with torch.no_grad():
        ddp(torch.randn(2, 3))
        ddp(torch.randn(2, 3))
    ddp.eval()
    ddp(torch.randn(2, 3))  # grad enabled, eval mode: prepares but never backwards
    ddp.train()
    x = torch.full((2, 3), float(rank))
    ddp(x).sum().backward()
    g = ddp.module.weight.grad.clone()
    expected = torch.full((3, 3), 2.0 * sum(range(world_size)) / world_size)
    return torch.allclose(g, expected)


def _subgroup(rank, world_size):
    sub = dist.new_group([0, 1])
    if rank > 1:
        return None
    torch.manual_seed(rank)
    ddp = gradring.DistributedDataParallel(nn.Linear(2, 1, bias=False), process_group=sub)
    ddp(torch.full((1, 2), float(rank + 1))).sum().backward()
    return ddp.module.weight.grad.tolist()


def _state_dict_and_pickle(rank, world_size):
    ddp = gradring.DistributedDataParallel(nn.Linear(3, 2))
    keys = sorted(ddp.state_dict())
    ddp.load_state_dict(ddp.state_dict())
    buf = io.BytesIO()
    torch.save(ddp, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    same = torch.equal(back.module.weight, ddp.module.weight)
    return keys, same


def _bucket_view(rank, world_size):
    ddp = gradring.DistributedDataParallel(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)),
                                           gradient_as_bucket_view=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad(set_to_none=False)
        ddp(torch.randn(4, 8)).sum().backward()
        opt.step()
    buffers = [b.buffer for b in ddp.reducer.buckets]

    def inside(t):
        return any(b.data_ptr() <= t.data_ptr() < b.data_ptr() + b.numel() * b.element_size()
                   for b in buffers)
    all_views = all(inside(p.grad) for p in ddp.module.parameters())
    try:
        ddp.module[0].weight.grad.detach_()
        detach_msg = "no error"
    except RuntimeError as e:
        detach_msg = str(e)
    return all_views, detach_msg


def _logging_keys(rank, world_size):
    ddp = gradring.DistributedDataParallel(nn.Linear(3, 2), bucket_cap_mb=5)
    return ddp._get_ddp_logging_data()


# ---------------------------------------------------------------------- tests


def test_reference_bucket_numbers_default_mode(pools):
    seen = pools.run(2, _reference_buckets, False)[0]
    (sizes1, rebuilt1, _, has1), (sizes2, rebuilt2, idx2, has2), _ = seen
    assert sizes1 == [50380800] and rebuilt1 == [] and not has1
    # After the 2nd forward (seen after its backward): rebuilt in arrival order.
    assert has2 and rebuilt2 == [4198400, 29388800, 16793600]
    assert idx2 == [[23, 22], list(range(21, 7, -1)), list(range(7, -1, -1))]


def test_reference_bucket_numbers_find_unused(pools):
    seen = pools.run(2, _reference_buckets, True)[0]
    for sizes, rebuilt, _, has in seen:
        assert sizes == [16797696, 29388800, 4194304]
        assert rebuilt == [] and not has


def test_init_sync_broadcasts_rank0_params_and_buffers(pools):
    assert pools.run(3, _init_sync) == [True, True, True]


def test_buffers_broadcast_before_forward(pools):
    for same_everywhere, _ in pools.run(2, _buffers_each_forward):
        assert same_everywhere


def test_param_count_mismatch_error(pools):
    msgs = pools.run(2, _param_count_mismatch)
    for m in msgs:
        assert "DDP expects same model across all ranks, but Rank 0 has 4 params, " \
               "while rank 1 has inconsistent 2 params." in m


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


def test_backward_twice_accumulates_locally_with_a_warning(pools):
    for r in pools.run(2, _backward_twice):
        assert r["same"], r
        assert len(r["warned"]) == 1 and "NOT averaged" in r["warned"][0], r


def test_no_grad_and_eval_forward(pools):
    assert pools.run(2, _no_grad_and_eval_leave_reducer_alone) == [True, True]


def test_subgroup(pools):
    res = pools.run(3, _subgroup)
    assert res[2] is None
    assert res[0] == res[1] == [[1.5, 1.5]]


def _view_at_hook(rank, world_size, impl):
    # A weight above the held-slot size (model[2]'s, 2 MiB) whose bucket,
    # before and after the rebuild, fills only with the first layer's
    # gradients (the last layer's 1.2 MiB close the rebuild's first bucket).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(),
                          nn.Linear(512, 600))
    wrap = gradring.DistributedDataParallel if impl == "gradring" else \
        nn.parallel.DistributedDataParallel
    ddp = wrap(model, gradient_as_bucket_view=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    big = model[2].weight
    seen = []
    # Runs once the last layer's gradients are in and before the first
    # layer's backward: is the large .grad already its bucket view there?
    model[0].register_full_backward_pre_hook(
        lambda *_: seen.append(big.grad is not None and big.grad._is_view()))
    torch.manual_seed(rank)
    grads = []
    for _ in range(4):
        opt.zero_grad(set_to_none=True)
        ddp(torch.randn(4, 16)).square().sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return seen, grads


def test_state_dict_and_torch_save(pools):
    for keys, same in pools.run(2, _state_dict_and_pickle):
        assert keys == ["module.bias", "module.weight"] and same


def test_gradient_as_bucket_view_shares_storage(pools):
    for all_views, detach_msg in pools.run(2, _bucket_view):
        assert all_views
        assert "view" in detach_msg.lower()


def test_gradient_as_bucket_view_points_a_large_grad_at_its_slot_at_its_hook(pools):
    # torch's DDP copies a new gradient into its view and lets it go at the
    # gradient's own hook, so a bucket's new gradients never live all at once
    # (the memory gradient_as_bucket_view saves); gradring's large slots do
    # the same. The results are the same bits.
    theirs = pools.run(2, _view_at_hook, "torch")
    ours = pools.run(2, _view_at_hook, "gradring")
    for (seen_t, grads_t), (seen_g, grads_g) in zip(theirs, ours):
        assert seen_t == [True] * 4
        assert seen_g == seen_t
        for step_t, step_g in zip(grads_t, grads_g):
            assert all(torch.equal(a, b) for a, b in zip(step_t, step_g))


def test_logging_data_keys(pools):
    data = pools.run(2, _logging_keys)[0]
    for key in ("bucket_sizes", "rebuilt_bucket_sizes", "rebuilt_per_bucket_param_indices",
                "has_rebuilt_buckets", "world_size", "bucket_cap_bytes",
                "find_unused_parameters", "static_graph", "gradient_as_bucket_view"):
        assert key in data
    assert data["world_size"] == 2 and data["bucket_cap_bytes"] == 5 * 1024 * 1024


def test_errors_without_process_group():
    assert not dist.is_initialized()
    # The exception type torch's DDP raises, with a message naming the fix.
    with pytest.raises(Exception) as theirs:
        torch.nn.parallel.DistributedDataParallel(nn.Linear(2, 2))
    with pytest.raises(type(theirs.value), match="init_process_group"):
        gradring.DistributedDataParallel(nn.Linear(2, 2))


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


def _failing_hook(state, bucket):
    fut = torch.futures.Future()
    fut.set_exception(RuntimeError("collective exploded"))
    return fut


def _collective_failure_names_bucket(rank, world_size):
    torch.manual_seed(0)
    ddp = gradring.DistributedDataParallel(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2)))
    ddp.register_comm_hook(None, _failing_hook)
    try:
        ddp(torch.randn(2, 3)).sum().backward()
    except RuntimeError as e:
        msg = str(e)
    else:
        msg = "no error"
    # the DDP object stays usable for a clean next iteration once the hook behaves
    return msg


def test_collective_failure_names_bucket_and_params(pools):
    for msg in pools.run(2, _collective_failure_names_bucket):
        assert "collective exploded" in msg
        assert "bucket 0" in msg and "1.weight" in msg and "0.bias" in msg


def _profiler_spans(rank, world_size):
    ddp = gradring.DistributedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ddp(torch.randn(2, 4)).sum().backward()
    return sorted({e.key for e in prof.key_averages() if e.key.startswith("gradring::")})


def test_profiler_shows_bucket_spans(pools):
    names = pools.run(2, _profiler_spans)[0]
    assert "gradring::bucket_all_reduce#0" in names and "gradring::bucket_wait#0" in names
