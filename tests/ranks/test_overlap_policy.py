"""When buckets launch: at ready time (the default, as torch's DDP), or all at
the end of the backward (``GRADRING_OVERLAP=0``).

The choice is a pure function of the variable (checked here); the reductions
it leads to must give torch's DDP's bits either way (checked in real ranks
against torch's DDP).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import gradring
from gradring.reducer.overlap_policy import choose
from tests.support.env import environ


def test_buckets_launch_when_ready_by_default() -> None:
    c = choose(env="")
    assert c.overlap and "as in torch's DDP" in c.why
    assert choose(env="auto").overlap


@pytest.mark.parametrize("env,expect", [("1", True), ("on", True), ("0", False), ("off", False)])
def test_the_environment_decides(env, expect) -> None:
    c = choose(env=env)
    assert c.overlap is expect and c.why == f"GRADRING_OVERLAP={env}"


# ------------------------------------------------------------------ real ranks

def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.LayerNorm(64),
                         nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 3))


def _train_both(rank: int, world_size: int, kwargs: dict, envs: tuple = ("0", "0"),
                hook_at: int | None = None) -> dict:
    """Train gradring's DDP and torch's side by side (``envs``: each rank's
    GRADRING_OVERLAP); ``hook_at``: register torch's all-reduce comm hook on both
    after that many steps."""
    torch.set_num_threads(1)
    with environ(GRADRING_OVERLAP=envs[rank]):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mine = gradring.DistributedDataParallel(_model(), **kwargs)
            ref = torch.nn.parallel.DistributedDataParallel(_model(), **kwargs)
        opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (mine, ref)]
        buckets_before_hook = None
        for step in range(6):
            if step == hook_at:
                buckets_before_hook = len(mine.reducer.buckets)
                for m in (mine, ref):
                    m.register_comm_hook(None, default_hooks.allreduce_hook)
            torch.manual_seed(100 * step + rank)
            x, y = torch.randn(5, 16), torch.randn(5, 3)
            for m, o in zip((mine, ref), opts):
                if step % 3 == 1:  # accumulate one micro-batch locally first
                    with m.no_sync():
                        nn.functional.mse_loss(m(x * 0.5), y).backward()
                nn.functional.mse_loss(m(x), y).backward()
                o.step()
                o.zero_grad(set_to_none=step % 2 == 0)
        r = mine.reducer
        last = r.trace.iteration - 1
        ev = r.trace.iteration_events(last)
        end = next(e.t for e in ev if e.kind == "backward_end")
        launches = [e.t for e in ev if e.kind == "launch"]
        same = all(torch.equal(a, b) for a, b in zip(mine.parameters(), ref.parameters()))
        stats = mine.overlap_stats()
        logged = [m._get_ddp_logging_data() for m in (mine, ref)]
        keys = ("rebuilt_bucket_sizes", "rebuilt_per_bucket_param_indices",
                "num_buckets_reduced")
        return {"stats": (stats["launch_when_ready"], stats["launch_why"]),
                "overlap": r.overlap, "why": r.overlap_why, "buckets": len(r.buckets),
                "torch_buckets": len(logged[1]["rebuilt_bucket_sizes"].split(", ")),
                "logged_alike": all(logged[0][k] == logged[1][k] for k in keys),
                "buckets_before_hook": buckets_before_hook,
                "launches": len(launches), "all_after_end": all(t >= end for t in launches),
                "same": same, "shm": mine.comm.on_shared_memory()}


@pytest.mark.parametrize("kwargs", [
    {"bucket_cap_mb": 0.01},
    {"bucket_cap_mb": 0.01, "gradient_as_bucket_view": True},
    {"bucket_cap_mb": 0.01, "static_graph": True},
])
def test_every_bucket_at_the_end_matches_torch_bit_for_bit(pools, kwargs) -> None:
    for r in pools.run(2, _train_both, kwargs, ("0", "0")):
        assert r["overlap"] is False and r["why"] == "GRADRING_OVERLAP=0", r
        assert r["stats"] == (False, "GRADRING_OVERLAP=0"), r
        assert r["buckets"] >= 3 and r["launches"] == r["buckets"], r
        assert r["buckets"] == r["torch_buckets"] and r["logged_alike"], r
        assert r["all_after_end"], r
        assert r["same"], r
        assert r["shm"], r


def test_a_comm_hook_registered_later_launches_each_bucket_when_ready(pools) -> None:
    # A comm hook returns futures: with GRADRING_OVERLAP=0 too, each bucket is
    # launched when ready from the next synchronised forward on.
    for r in pools.run(2, _train_both, {"bucket_cap_mb": 0.01}, ("0", "0"), 3):
        assert r["buckets_before_hook"] == r["buckets"] == r["torch_buckets"] >= 3, r
        assert r["launches"] == r["buckets"] and not r["all_after_end"], r
        assert r["logged_alike"] and r["same"], r


@pytest.mark.parametrize("kwargs", [{"bucket_cap_mb": 0.01}, {"bucket_cap_mb": 0.01,
                                                              "static_graph": True}])
def test_every_rank_follows_rank_0s_choice(pools, kwargs) -> None:
    # Rank 1 alone asks for overlap: it must follow rank 0, or static_graph's first
    # iteration would issue its usage map between different buckets on the two ranks.
    r0, r1 = pools.run(2, _train_both, kwargs, ("0", "1"))
    assert r0["overlap"] is False and r1["overlap"] is False, (r0, r1)
    assert r1["why"].startswith("rank 0's choice") and "GRADRING_OVERLAP=1" in r1["why"], r1
    assert r0["same"] and r1["same"], (r0, r1)
    assert r1["all_after_end"], r1


def _unused_at_the_end(rank: int, world_size: int) -> str:
    torch.set_num_threads(1)
    with environ(GRADRING_OVERLAP="0"):
        torch.manual_seed(0)
        module = nn.ModuleDict({"a": nn.Linear(32, 32), "idle": nn.Linear(32, 32),
                                "b": nn.Linear(32, 32)})
        module.forward = lambda x, m=module: m["b"](m["a"](x))
        ddp = gradring.DistributedDataParallel(module, bucket_cap_mb=0.004)
        x = torch.randn(2, 32)
        ddp(x).sum().backward()
        try:
            ddp(x).sum().backward()
            return "no error"
        except RuntimeError as e:
            return str(e)


def test_unused_parameter_with_every_bucket_at_the_end_names_it(pools) -> None:
    for msg in pools.run(2, _unused_at_the_end):
        assert "Expected to have finished reduction in the prior iteration" in msg, msg
        assert "idle.weight" in msg and "idle.bias" in msg, msg
        assert "a.weight" not in msg, msg
