"""``delay_all_reduce_named_params`` with ``param_to_hook_all_reduce``, against torch's DDP.

The last layer's parameters are left out of the buckets and averaged by one
all-reduce launched from the first layer's weight's hook. Both wrappers train
the same model on the same batches; every gradient and every parameter must
be torch's, bit for bit, with each setting that composes with it (no_sync,
static_graph, find_unused_parameters, a comm hook, gradient_as_bucket_view).
Misuse must raise what torch raises.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import gradring

pytestmark = pytest.mark.timeout(300)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 4))


def _wrap(cls: type, model: nn.Module, setting: str) -> nn.Module:
    delayed = [(n, p) for n, p in model.named_parameters() if n.startswith("4.")]
    kwargs = {
        "find_unused": {"find_unused_parameters": True},
        "static_graph": {"static_graph": True},
        "view": {"gradient_as_bucket_view": True},
    }.get(setting, {})
    # Small buckets: several of them, so their order is compared too.
    ddp = cls(model, delay_all_reduce_named_params=delayed,
              param_to_hook_all_reduce=model[0].weight, bucket_cap_mb=0.0006, **kwargs)
    if setting == "comm_hook":
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    return ddp


def _differences(ours: nn.Module, theirs: nn.Module, what: str) -> list[str]:
    wrong = []
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        if (p.grad is None) != (q.grad is None):
            wrong.append(f"{what} {name}: .grad None on one side only")
        elif p.grad is not None and not torch.equal(p.grad, q.grad):
            wrong.append(f"{what} {name}: grad differs by {(p.grad - q.grad).abs().max():.3g}")
        if not torch.equal(p.detach(), q.detach()):
            wrong.append(f"{what} {name}: parameter differs")
    return wrong


def _train_side_by_side(rank: int, world: int, setting: str) -> list[str]:
    torch.set_num_threads(1)
    base = _model()
    if rank == 1:  # construction broadcasts rank 0's delayed parameters
        with torch.no_grad():
            base[4].weight.add_(1.0)
    ours = _wrap(gradring.DistributedDataParallel, copy.deepcopy(base), setting)
    theirs = _wrap(nn.parallel.DistributedDataParallel, copy.deepcopy(base), setting)
    wrong = []
    if ours.parameters_to_ignore != theirs.parameters_to_ignore:
        wrong.append(f"parameters_to_ignore {ours.parameters_to_ignore} vs "
                     f"{theirs.parameters_to_ignore}")
    wrong += _differences(ours.module, theirs.module, "after construction")
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ours, theirs)]
    for step in range(4):
        g = torch.Generator().manual_seed(10 * step + rank)
        batches = [torch.randn(6, 8, generator=g) for _ in range(2)]
        for m, opt in zip((ours, theirs), opts):
            opt.zero_grad(set_to_none=step % 2 == 0)
            if setting == "no_sync":
                with m.no_sync():
                    m(batches[0]).pow(2).mean().backward()
                # torch all-reduces the delayed gradients under no_sync too, and
                # leaves the work unwaited: without this wait its next backward
                # would add to the buffer while gloo still sums it.
                dist.barrier()
            m(batches[1]).pow(2).mean().backward()
            # torch leaves its delayed all-reduce unwaited: gloo's barrier waits for it.
            dist.barrier()
        wrong += _differences(ours.module, theirs.module, f"step {step} gradients")
        for opt in opts:
            opt.step()
        wrong += _differences(ours.module, theirs.module, f"step {step} parameters")
    # The buckets hold the same parameters, in the same order, as torch's
    # (torch leaves the rebuilt keys out where it never rebuilds, gradring
    # has them empty: docs/ddp-differences.md).
    logs = [m._get_ddp_logging_data() for m in (ours, theirs)]
    for key in ("num_parameter_tensors", "bucket_sizes", "rebuilt_bucket_sizes",
                "rebuilt_per_bucket_param_indices"):
        if logs[0].get(key) != logs[1].get(key, ""):
            wrong.append(f"logging data {key}: {logs[0].get(key)!r} vs {logs[1].get(key)!r}")
    # The delayed gradients are averages: the same on every rank.
    grads = [p.grad.clone() for p in ours.module[4].parameters()]
    everyone = [None] * world
    dist.all_gather_object(everyone, grads)
    if not all(torch.equal(a, b) for got in everyone for a, b in zip(got, everyone[0])):
        wrong.append("the delayed gradients differ between ranks")
    return wrong


@pytest.mark.parametrize("setting", ["default", "no_sync", "find_unused", "static_graph",
                                     "comm_hook", "view"])
def test_delayed_all_reduce_matches_torch_bit_for_bit(pools, setting) -> None:
    for wrong in pools.run(2, _train_side_by_side, setting, timeout=200):
        assert not wrong, wrong


def _misuse(rank: int, world: int) -> dict[str, dict[str, str]]:
    torch.set_num_threads(1)
    out: dict[str, dict[str, str]] = {}
    for name, cls in (("ours", gradring.DistributedDataParallel),
                      ("torch", nn.parallel.DistributedDataParallel)):
        cases = {
            "only_named": lambda m: {"delay_all_reduce_named_params":
                                     [("4.weight", m[4].weight)]},
            "only_hook": lambda m: {"param_to_hook_all_reduce": m[0].weight},
            "hook_frozen": lambda m: {
                "delay_all_reduce_named_params": [("4.weight", m[4].weight)],
                "param_to_hook_all_reduce": m[0].weight.requires_grad_(False)},
        }
        res = {}
        for case, kwargs in cases.items():
            model = _model()
            try:
                cls(model, **kwargs(model))
                res[case] = "constructed"
            except Exception as exc:  # noqa: BLE001 - the error is the result
                res[case] = f"{type(exc).__name__}: {exc}"
        out[name] = res
    return out


def test_misuse_raises_as_torch_does(pools) -> None:
    for out in pools.run(2, _misuse, timeout=120):
        ours, theirs = out["ours"], out["torch"]
        for case in ("only_named", "only_hook"):
            assert theirs[case].startswith("ValueError") and \
                "need to be set at the same time" in theirs[case], theirs[case]
            assert ours[case] == theirs[case]
        assert ours["hook_frozen"].split(":")[0] == theirs["hook_frozen"].split(":")[0]
        assert "requires_grad" in theirs["hook_frozen"] or "gradient" in theirs["hook_frozen"]
        assert theirs["hook_frozen"].split(": ", 1)[1] in ours["hook_frozen"]


def _all_delayed(rank: int, world: int) -> list[str]:
    """Every trainable parameter delayed: the module runs with no reducer.
    torch 2.13 means to support this and fails by accident (AttributeError
    in its first forward), so the oracle is the plain model's gradient,
    divided by the world size and summed over the group, as torch's hook does.
    The hook sits on the middle layer's weight, so the last layer's gradients
    are complete when it fires (the middle layer's own gradients race the
    all-reduce, in torch as here: they are not compared)."""
    torch.set_num_threads(1)
    base = _model()
    base[0].requires_grad_(False)
    plain = copy.deepcopy(base)
    m = copy.deepcopy(base)
    delayed = [(n, p) for n, p in m.named_parameters() if p.requires_grad]
    ours = gradring.DistributedDataParallel(m, delay_all_reduce_named_params=delayed,
                                            param_to_hook_all_reduce=m[2].weight)
    # What torch's constructor sets before it would leave the buckets out stays
    # readable (torch's values for a DDP built with no cap arguments).
    wrong = [f"{name} = {value!r}" for name, value, want in (
        ("bucket_bytes_cap", ours.bucket_bytes_cap, 25 * 1024 * 1024),
        ("bucket_bytes_cap_list", ours.bucket_bytes_cap_list, []),
        ("bucket_bytes_cap_default", ours.bucket_bytes_cap_default, True),
        ("static_graph", ours.static_graph, False),
        ("mixed_precision", ours.mixed_precision, None)) if value != want]
    for step in range(3):
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(step + 7 * rank))
        for model in (ours, plain):
            model.zero_grad(set_to_none=step != 1)
            model(x).pow(2).mean().backward()
        for name, p in m.named_parameters():
            if name.startswith("4."):
                want = dict(plain.named_parameters())[name].grad.div(world)
                dist.all_reduce(want)
                if not torch.equal(p.grad, want):
                    wrong.append(f"step {step} {name}: grad differs")
    return wrong


def test_every_parameter_delayed_trains(pools) -> None:
    for wrong in pools.run(2, _all_delayed, timeout=120):
        assert not wrong, wrong
