"""torch's ZeRO overlap hooks on gradring's DDP, against torch's DDP.

``hook_with_zero_step`` and ``hook_with_zero_step_interleaved`` (in
``torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook``) wrap a comm hook so
that ``ZeroRedundancyOptimizer(overlap_with_ddp=True)`` steps each rank's shard
from inside DDP's backward. They read ``ddp._has_rebuilt_buckets`` in every
bucket's hook, and ``bucket.index()``, ``bucket.parameters()`` and
``bucket.gradients()``. Each rank function trains the same model under torch's
DDP and under gradring's, in the same processes, and the test compares the
parameters after every step and the flag at every forward.

[Note: the gloo refusal, lifted here only]
Both hook builders raise "Gloo backend using Overlapping DDP with ZeRO may meet
hangs" when the DDP's process group is gloo; they check it
once, when the hook is built, with ``dist.get_backend(ddp.process_group)``. gradring
keeps that refusal (the check is torch's code and gradring's DDP has the same
``process_group``): ``test_gloo_refused_as_torch_refuses``. The rank pool is gloo,
so the other tests build the hook with ``dist.get_backend`` answering "nccl" for
that one call (``_gloo_allowed``); the hooks then run on gloo, in torch's DDP as in
gradring's.

The hang is real for the interleaved hook: it chains the ZeRO step onto the
all-reduce's future, so on gloo the step, its broadcasts and the wait for them run
in gloo's own completion thread, and with several buckets torch's DDP times out
there as gradring's does. So the interleaved hook here wraps ``_allreduce_waited``,
torch's ``allreduce_hook`` waited for before it returns: the chained step then runs
at once, in the thread that called the hook. ``hook_with_zero_step`` wraps
``allreduce_hook`` itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import ddp_zero_hook
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.optim import ZeroRedundancyOptimizer

import gradring

pytestmark = pytest.mark.timeout(240)

TORCH_DDP = torch.nn.parallel.DistributedDataParallel
BOTH = (("theirs", TORCH_DDP), ("ours", gradring.DistributedDataParallel))
STEPS = 6
MODES = {"default": {}, "static_graph": {"static_graph": True},
         "find_unused_parameters": {"find_unused_parameters": True}}


@contextlib.contextmanager
def _gloo_allowed() -> Iterator[None]:
    """Make the hook builders' backend check see NCCL: see [Note: the gloo refusal,
    lifted here only]. Only the building of the hook runs inside."""
    with mock.patch.object(ddp_zero_hook.dist, "get_backend", lambda group=None: "nccl"):
        yield


def _allreduce_waited(state: object, bucket: dist.GradBucket) -> torch.futures.Future:
    """torch's ``allreduce_hook``, finished before it returns (see the module's docstring)."""
    fut = allreduce_hook(state, bucket)
    fut.wait()
    return fut


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 4))


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(100 * step + rank))


def _zero_overlap(rank: int, world: int, interleaved: bool, shard_buckets: bool,
                  mode: str) -> dict:
    if interleaved:
        build, inner = ddp_zero_hook.hook_with_zero_step_interleaved, _allreduce_waited
    else:
        build, inner = ddp_zero_hook.hook_with_zero_step, allreduce_hook
    out = {}
    for name, cls in BOTH:
        model = _model()
        initial = [p.detach().clone() for p in model.parameters()]
        # A small cap: several buckets after the rebuild, spread over the ranks.
        ddp = cls(model, bucket_cap_mb=0.001, **MODES[mode])
        zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.SGD,
                                       overlap_with_ddp=True, lr=0.1)
        with _gloo_allowed():
            hook = build(inner, ddp, zero, shard_buckets=shard_buckets)
        ddp.register_comm_hook(None, hook)
        flags, params = [], []
        for step in range(STEPS):
            ddp(_batch(step, rank)).pow(2).mean().backward()
            flags.append(ddp._has_rebuilt_buckets)
            params.append([p.detach().clone() for p in model.parameters()])
        out[name] = {
            "flags": flags, "params": params,
            "moved": any(not torch.equal(a, b) for a, b in zip(initial, params[-1])),
            "buckets": len(zero._overlap_info.params_per_bucket),
        }
    theirs, ours = out["theirs"], out["ours"]
    return {
        "flags": (theirs["flags"], ours["flags"]),
        "steps_equal": [all(torch.equal(a, b) for a, b in zip(t, o))
                        for t, o in zip(theirs["params"], ours["params"])],
        "moved": (theirs["moved"], ours["moved"]),
        "buckets": (theirs["buckets"], ours["buckets"]),
        # Every rank must hold the same parameters (ZeRO broadcasts each shard).
        "last": [p.sum().item() for p in ours["params"][-1]],
    }


@pytest.mark.parametrize("interleaved", [False, True], ids=["step", "interleaved"])
@pytest.mark.parametrize("shard_buckets", [False, True], ids=["whole", "sharded"])
@pytest.mark.parametrize("mode", ["default", "static_graph"])
def test_zero_overlap_hooks_train_as_torch(pools, interleaved: bool, shard_buckets: bool,
                                           mode: str) -> None:
    results = pools.run(2, _zero_overlap, interleaved, shard_buckets, mode)
    for r in results:
        theirs_flags, ours_flags = r["flags"]
        assert ours_flags == theirs_flags, r["flags"]
        assert r["steps_equal"] == [True] * STEPS, r["steps_equal"]
        # ZeRO stepped (after the rebuild) in both, over more than one bucket.
        assert r["moved"] == (True, True), r
        assert r["buckets"][0] == r["buckets"][1] > 1, r
    assert results[0]["last"] == results[1]["last"]


def _find_unused(rank: int, world: int) -> dict:
    """With find_unused_parameters torch never rebuilds, so ZeRO never initialises:
    the hook reduces and no rank steps, in both."""
    return _zero_overlap(rank, world, False, False, "find_unused_parameters")


def test_zero_overlap_never_starts_with_find_unused_parameters_as_torch(pools) -> None:
    for r in pools.run(2, _find_unused):
        assert r["flags"] == ([False] * STEPS, [False] * STEPS), r["flags"]
        assert r["steps_equal"] == [True] * STEPS and r["moved"] == (False, False), r


def _rebuilt_flags(rank: int, world: int) -> dict:
    """``_has_rebuilt_buckets`` after construction and after each forward and backward."""
    out = {}
    for mode, kw in MODES.items():
        for name, cls in BOTH:
            ddp = cls(_model(), **kw)
            seen = [ddp._has_rebuilt_buckets]
            for step in range(4):
                y = ddp(_batch(step, rank))
                seen.append(ddp._has_rebuilt_buckets)
                y.sum().backward()
                seen.append(ddp._has_rebuilt_buckets)
            out[(mode, name)] = seen
    return out


def test_has_rebuilt_buckets_as_torch(pools) -> None:
    for r in pools.run(2, _rebuilt_flags):
        for mode in MODES:
            assert r[(mode, "ours")] == r[(mode, "theirs")], (mode, r)
        # torch's own sequences, so that a change in torch shows here.
        assert r[("default", "theirs")] == [False] * 3 + [True] * 6
        assert r[("static_graph", "theirs")] == [False] * 5 + [True] * 4
        assert r[("find_unused_parameters", "theirs")] == [False] * 9


def _gloo_refusal(rank: int, world: int) -> dict:
    out = {}
    for name, cls in BOTH:
        ddp = cls(_model())
        zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.SGD,
                                       overlap_with_ddp=True, lr=0.1)
        for build in (ddp_zero_hook.hook_with_zero_step,
                      ddp_zero_hook.hook_with_zero_step_interleaved):
            try:
                build(allreduce_hook, ddp, zero)
                out[(name, build.__name__)] = None
            except RuntimeError as exc:
                out[(name, build.__name__)] = str(exc)
    assert dist.get_backend() == "gloo"
    return out


def test_gloo_refused_as_torch_refuses(pools) -> None:
    for r in pools.run(2, _gloo_refusal):
        for build in ("hook_with_zero_step", "hook_with_zero_step_interleaved"):
            assert r[("ours", build)] == r[("theirs", build)], r
            assert "Gloo backend" in r[("theirs", build)], r
