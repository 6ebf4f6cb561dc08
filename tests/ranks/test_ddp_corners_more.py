"""More corners against torch's own DDP: bucket caps, re-wrapping, manual
backward inside forward, the unused-parameter error under no_sync, and
construction before init_process_group."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.algorithms.ddp_comm_hooks.default_hooks as default_hooks
from torch import nn

import gradring
from tests.ranks.test_ddp_corners import IMPLS, _flat_params, _grads, _same_everywhere
from tests.support.irregular_models import compare_grads

# ---------------------------------------------------------------- bucket caps


def _six_linears() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(6)])


def _sizes(value) -> list[int]:
    """torch's logging data gives sizes as '1, 2'; gradring's as a list."""
    if value is None:
        return []
    if isinstance(value, str):
        return [int(v) for v in value.split(",") if v.strip()]
    return [int(v) for v in value]


def _bucket_sizes(rank, world_size, kwargs, torch_kwargs=None):
    out = {}
    for name, cls in IMPLS.items():
        kw = kwargs if name == "gradring" or torch_kwargs is None else torch_kwargs
        ddp = cls(_six_linears(), **kw)
        x = torch.randn(2, 1024)
        for _ in range(3):
            ddp(x).sum().backward()
        data = ddp._get_ddp_logging_data()
        out[name] = (_sizes(data["bucket_sizes"]), _sizes(data.get("rebuilt_bucket_sizes")),
                     _same_everywhere(_flat_params(ddp.module) - 0)
                     and _same_everywhere(torch.cat([p.grad.reshape(-1)
                                                     for p in ddp.module.parameters()])))
    return out


@pytest.mark.parametrize("kwargs", [
    {}, {"bucket_cap_mb": 5}, {"bucket_cap_mb": 25}, {"bucket_cap_mb": 0.5},
    {"find_unused_parameters": True}, {"find_unused_parameters": True, "bucket_cap_mb": 5},
    {"bucket_cap_mb": 0}, {"bucket_cap_mb": -1},
], ids=["default", "5", "25", "0.5", "find_unused", "find_unused_5", "0", "-1"])
def test_bucket_caps_match_torch(pools, kwargs):
    for r in pools.run(2, _bucket_sizes, kwargs):
        assert r["gradring"] == r["torch"]
        assert r["gradring"][2]  # replicas agree
    if kwargs == {"bucket_cap_mb": 5}:
        # An explicit cap is also the first rebuilt bucket's: three of two layers.
        assert r["gradring"][1] == [8396800] * 3


def _different_caps(rank, world_size, find_unused):
    kwargs = {"bucket_cap_mb": [3, 7, 5][rank % 3], "find_unused_parameters": find_unused}
    if not find_unused:
        return _bucket_sizes(rank, world_size, kwargs)
    # torch's DDP cannot train here (its first buckets differ across ranks and
    # gloo aborts); the oracle is torch with rank 0's cap on every rank.
    return _bucket_sizes(rank, world_size, kwargs, {**kwargs, "bucket_cap_mb": 3})


@pytest.mark.parametrize("find_unused", [False, True], ids=["default", "find_unused"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_with_different_caps_follow_rank0(pools, world_size, find_unused):
    results = pools.run(world_size, _different_caps, find_unused)
    for r in results:
        assert r["gradring"] == r["torch"]
        assert r["gradring"][2]
    assert all(r["gradring"][:2] == results[0]["gradring"][:2] for r in results)


# --------------------------------------------------------------- re-wrapping


def _rewrap(rank, world_size, use_old_again, kwargs):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).double()
    out = {}
    for name, cls in IMPLS.items():
        module = copy.deepcopy(base)
        opt = torch.optim.SGD(module.parameters(), lr=0.05)
        steps = []
        old = cls(module, **kwargs)  # the first fit
        plan = [old, old]
        new = cls(module, **kwargs)  # the second fit, while the first wrapper is alive
        plan += [new, new, new] + ([old, old] if use_old_again else [])
        for step, ddp in enumerate(plan):
            g = torch.Generator().manual_seed(10 * step + rank)
            opt.zero_grad(set_to_none=True)
            ddp(torch.randn(3, 4, generator=g, dtype=torch.float64)).pow(2).sum().backward()
            steps.append(_grads(module))
            opt.step()
        out[name] = (steps, _same_everywhere(_flat_params(module)))
        del old, new
    # Oracle: a plain copy, its gradients averaged by hand.
    module = copy.deepcopy(base)
    opt = torch.optim.SGD(module.parameters(), lr=0.05)
    steps = []
    for step in range(len(out["torch"][0])):
        g = torch.Generator().manual_seed(10 * step + rank)
        opt.zero_grad(set_to_none=True)
        module(torch.randn(3, 4, generator=g, dtype=torch.float64)).pow(2).sum().backward()
        for p in module.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world_size
        steps.append(_grads(module))
        opt.step()
    out["oracle"] = steps
    return out


@pytest.mark.parametrize("use_old_again", [False, True], ids=["new_only", "old_again"])
@pytest.mark.parametrize("kwargs", [{}, {"find_unused_parameters": True},
                                    {"static_graph": True}],
                         ids=["default", "find_unused", "static"])
def test_wrapping_again_while_old_wrapper_alive(pools, use_old_again, kwargs):
    for r in pools.run(2, _rewrap, use_old_again, kwargs):
        assert compare_grads(r["gradring"][0], r["oracle"], tol=1e-12) is None
        assert r["gradring"][1]
        if "static_graph" not in kwargs:
            # With static_graph torch's old reducer joins the new one's first
            # iterations and the replicas drift apart (docs/ddp-differences.md).
            assert compare_grads(r["gradring"][0], r["torch"][0], tol=1e-12) is None
            assert r["torch"][1]


def _old_hooks_never_act(rank, world_size):
    """An old wrapper left mid-backward (its reduction unfinished) must not
    touch the new wrapper's reductions."""
    torch.manual_seed(0)
    module = nn.ModuleDict({"used": nn.Linear(3, 3), "idle": nn.Linear(3, 3)}).double()
    module.forward = lambda x: module["used"](x)
    old = gradring.DistributedDataParallel(module)
    old(torch.ones(2, 3, dtype=torch.float64)).sum().backward()  # idle: unfinished
    new = gradring.DistributedDataParallel(module, find_unused_parameters=True)
    grads = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(3):
            module.zero_grad(set_to_none=True)
            x = torch.full((2, 3), float(rank + step), dtype=torch.float64)
            new(x).sum().backward()
            grads.append(module["used"].weight.grad.clone())
    return grads, old.reducer.require_finalize


def test_old_wrapper_mid_backward_leaves_new_one_alone(pools):
    results = pools.run(2, _old_hooks_never_act)
    for grads, old_pending in results:
        assert not old_pending
        for step, g in enumerate(grads):
            # mean over ranks of x = rank + step, summed over 2 rows
            assert torch.allclose(g, torch.full((3, 3), 2 * (0.5 + step), dtype=torch.float64))


# ---------------------------------------------- unused parameter, then no_sync


def _unused_then_no_sync(rank, world_size):
    out = {}
    for name, cls in IMPLS.items():
        torch.manual_seed(0)
        module = nn.ModuleDict({"used": nn.Linear(3, 3), "idle": nn.Linear(3, 3)})
        module.forward = lambda x, m=module: m["used"](x)
        ddp = cls(module)
        x = torch.randn(2, 3)
        ddp(x).sum().backward()
        try:
            with ddp.no_sync():
                ddp(x).sum().backward()
            out[name] = "no error"
        except RuntimeError as e:
            out[name] = str(e)
    return out


def test_unused_parameter_then_no_sync_names_the_unused(pools):
    for r in pools.run(2, _unused_then_no_sync):
        head = "Expected to have finished reduction in the prior iteration"
        assert head in r["torch"] and head in r["gradring"]
        assert "idle.weight" in r["gradring"] and "idle.bias" in r["gradring"]
        assert "used.weight" not in r["gradring"] and "used.bias" not in r["gradring"]


# ----------------------------------- manual backward inside forward (Lightning)


class _ManualStep(nn.Module):
    """A LightningModule-like body: training_step runs backward and the
    optimizer step itself, while DDP's forward is still running."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(6, 2)
        self.ddp = None
        self.opt = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        loss = self.b(torch.tanh(self.a(x))).pow(2).mean()
        ddp = self.ddp
        # What Lightning's DDPStrategy.pre_backward does for manual optimization.
        if torch.is_grad_enabled() and ddp.require_backward_grad_sync:
            ddp.require_forward_param_sync = True
            tensors = [loss] if ddp.find_unused_parameters and not ddp.static_graph else []
            ddp.reducer._rebuild_buckets()
            ddp.reducer.prepare_for_backward(tensors)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        # ... and what its post_backward does in static_graph's first iteration.
        if ddp.static_graph and not getattr(self, "delayed", False):
            ddp.reducer._delay_all_reduce()
            self.delayed = True
        self.opt.step()
        # Lightning's _DDPForwardRedirection: the reduction is done, so DDP's
        # own post-forward must not prepare another one.
        ddp.require_backward_grad_sync = False
        return loss.detach()


def _manual_inside_forward(rank, world_size, kwargs):
    torch.manual_seed(0)
    base = _ManualStep().double()
    out = {}
    for name, cls in IMPLS.items():
        module = copy.deepcopy(base)
        ddp = cls(module, **kwargs)
        calls: list[int] = []

        def counting(state, bucket, calls=calls):
            calls.append(1)
            return default_hooks.allreduce_hook(None, bucket)

        ddp.register_comm_hook(None, counting)
        module.ddp, module.opt = ddp, torch.optim.SGD(module.parameters(), lr=0.1)
        reductions = []
        for step in range(5):
            g = torch.Generator().manual_seed(10 * step + rank)
            before = len(calls)
            ddp(torch.randn(3, 4, generator=g, dtype=torch.float64))
            ddp.require_backward_grad_sync = True
            reductions.append(len(calls) - before)
        out[name] = (_flat_params(module), reductions, _same_everywhere(_flat_params(module)))
        module.ddp = module.opt = None
    return out


@pytest.mark.parametrize("kwargs", [{}, {"find_unused_parameters": True},
                                    {"static_graph": True}],
                         ids=["default", "find_unused", "static"])
def test_manual_backward_inside_forward_matches_torch(pools, kwargs):
    for r in pools.run(2, _manual_inside_forward, kwargs):
        params_m, red_m, same_m = r["gradring"]
        params_t, red_t, same_t = r["torch"]
        assert same_m and same_t  # replicas identical after every step
        assert red_m == red_t and all(n > 0 for n in red_m)  # reduced once per step
        assert torch.allclose(params_m, params_t, rtol=0, atol=1e-12)


# --------------------------------------------------- before init_process_group


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


# ------------------------------------------- two losses from one forward


def _two_losses(rank, world_size, how, kwargs):
    torch.manual_seed(0)
    base = nn.Linear(3, 2).double()
    out = {}
    for name, cls in IMPLS.items():
        ddp = cls(copy.deepcopy(base), **kwargs)
        steps, error = [], None
        for step in range(3):
            g = torch.Generator().manual_seed(10 * step + rank)
            y = ddp(torch.randn(4, 3, generator=g, dtype=torch.float64))
            l1, l2 = y.pow(2).sum(), 3 * y.sum()
            ddp.zero_grad(set_to_none=True)
            try:
                if how == "retain_graph":
                    l1.backward(retain_graph=True)
                    l2.backward()
                elif how == "together":
                    torch.autograd.backward([l1, l2])
                else:
                    (l1 + l2).backward()
            except RuntimeError as e:
                error = str(e)
                break
            steps.append(_grads(ddp.module))
        grads = torch.cat([p.grad.reshape(-1) for p in ddp.module.parameters()])
        out[name] = (steps, error, _same_everywhere(grads))
    return out


@pytest.mark.parametrize("how", ["together", "summed"])
@pytest.mark.parametrize("kwargs", [{}, {"find_unused_parameters": True},
                                    {"static_graph": True}],
                         ids=["default", "find_unused", "static"])
def test_two_losses_in_one_backward_match_torch(pools, how, kwargs):
    for r in pools.run(2, _two_losses, how, kwargs):
        assert r["gradring"][1] is None and r["torch"][1] is None
        assert compare_grads(r["gradring"][0], r["torch"][0], tol=1e-12) is None
        assert r["gradring"][2] and r["torch"][2]


def test_two_backwards_from_one_forward_behave_like_torch(pools):
    # torch reduces the first backward and leaves the second one's gradients
    # local: its replicas drift apart. gradring does exactly the same (it must
    # not break this pattern) and warns once (docs/ddp-differences.md).
    for r in pools.run(2, _two_losses, "retain_graph", {}):
        assert r["torch"][1] is None and not r["torch"][2]
        assert r["gradring"][1] is None and not r["gradring"][2]
        assert compare_grads(r["gradring"][0], r["torch"][0], tol=0.0) is None


# ------------------------------------------- buffers that change between forwards


class _BufferTree(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3).double()
        self.norm = nn.BatchNorm1d(3).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.lin(x))
        for name, buf in self.named_buffers():
            if buf.dtype == torch.float64 and buf.dim() == 1 and name != "norm.running_var":
                y = y + buf[:3].sum()
        return y


def _buffer_tree_changes(rank, world_size):
    # Between forwards the module's buffers change in every way the per-forward
    # sync must notice: registered after wrapping, on the root and on a new
    # submodule; a buffer's memory swapped under the same tensor object; a
    # buffer resized in place; a submodule replaced. Each rank changes them
    # differently; every forward must see rank 0's values, as with torch's DDP.
    torch.manual_seed(0)
    base = _BufferTree()
    out = {}
    for name, cls in IMPLS.items():
        model = copy.deepcopy(base)
        ddp = cls(model)
        seen = []
        x = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
        for step in range(6):
            mine = float((rank + 1) * (step + 1))
            if step == 1:
                model.register_buffer("late", torch.full((3,), mine, dtype=torch.float64))
            elif step == 2:
                model.extra = nn.Module()
                model.extra.register_buffer("deep", torch.full((4,), mine, dtype=torch.float64))
            elif step == 3:
                model.late.data = torch.full((3,), mine, dtype=torch.float64)
            elif step == 4:
                model.extra.deep.resize_(5).fill_(mine)
            elif step == 5:
                model.norm = nn.BatchNorm1d(3).double()
                model.norm.running_mean.fill_(mine)
            y = ddp(x)
            seen.append([b.clone() for b in model.buffers()] + [y.detach().clone()])
            y.sum().backward()
        out[name] = seen
    return out


def test_buffer_changes_between_forwards_are_synced_like_torch(pools):
    for r in pools.run(2, _buffer_tree_changes):
        for mine, theirs in zip(r["gradring"], r["torch"], strict=True):
            assert len(mine) == len(theirs)
            for a, b in zip(mine, theirs):
                assert a.shape == b.shape and torch.equal(a, b)
