"""find_unused_parameters, static_graph and the errors, differentially against torch's DDP."""

import warnings

import pytest
import torch
from torch import nn

import gradring
from tests.support.irregular_models import batch, compare_grads, run_side_by_side

# ---------------------------------------------------------------- rank bodies


def _side_by_side(rank, world_size, kind, kwargs, steps, sign=None):
    inputs = []
    for s in range(steps):
        x = batch(rank, s)
        if sign is not None:  # force the data-dependent branch per rank
            x = x.abs() * sign(rank, s)
        inputs.append(x)
    return run_side_by_side(rank, kind, kwargs, inputs)


def _warn_once(rank, world_size):
    # As torch's C++ reducer: a line on stderr, once per process (not a Python warning).
    from gradring import announce
    from tests.support.notices import stderr_text

    announce._SAID.discard("nothing_unused")  # an earlier test of this rank may have said it
    with warnings.catch_warnings(record=True) as caught, stderr_text() as err:
        warnings.simplefilter("always")
        for _ in range(2):
            ddp = gradring.DistributedDataParallel(nn.Linear(3, 3), find_unused_parameters=True)
            for _ in range(3):
                ddp(torch.randn(2, 3)).sum().backward()
    assert not [w for w in caught if "find_unused_parameters" in str(w.message)]
    return [line for line in err.getvalue().splitlines() if "find_unused_parameters" in line]


def _deep(rank, world_size):
    from tests.support.irregular_models import Deep

    ddp = gradring.DistributedDataParallel(Deep(), find_unused_parameters=True)
    ddp(torch.randn(2, 4)).sum().backward()
    return ddp.module.scale.grad is not None, ddp.module.unused.weight.grad is None


def _unused_error(rank, world_size, kind_of_skip):
    model = nn.ModuleDict({"used": nn.Linear(3, 3), "idle": nn.Linear(3, 3)})
    ddp = gradring.DistributedDataParallel(model)
    msgs = []
    for _ in range(3):
        x = torch.randn(2, 3)
        try:
            if kind_of_skip == "all" or (kind_of_skip == "rank1" and rank == 1):
                out = _Wrapped.forward_used_only(ddp, x)
            else:
                out = _Wrapped.forward_both(ddp, x)
            out.sum().backward()
        except RuntimeError as e:
            msgs.append(str(e))
            break
    return msgs


class _Wrapped:
    """Call the DDP wrapper so that only some submodules run."""

    @staticmethod
    def forward_used_only(ddp, x):
        ddp.module.forward = lambda x: ddp.module["used"](x)
        return ddp(x)

    @staticmethod
    def forward_both(ddp, x):
        ddp.module.forward = lambda x: ddp.module["idle"](ddp.module["used"](x))
        return ddp(x)


def _static_changes(rank, world_size, change):
    model = nn.ModuleDict({"a": nn.Linear(3, 3), "b": nn.Linear(3, 3)})
    ddp = gradring.DistributedDataParallel(model, static_graph=True)
    events = []
    for step in range(5):
        use_b = {"b_dropped": step < 2, "b_added": step >= 2, "none": True}[change]
        ddp.module.forward = (lambda x, ub=use_b: model["b"](model["a"](x)) if ub
                              else model["a"](x))
        try:
            ddp(torch.randn(2, 3)).sum().backward()
            events.append(("ok", step, ddp._get_ddp_logging_data()["has_rebuilt_buckets"]))
        except RuntimeError as e:
            events.append(("error", step, str(e)))
            break
    return events


# ---------------------------------------------------------------------- tests


@pytest.mark.parametrize("world_size", [2, 3])
def test_find_unused_matches_torch(pools, world_size):
    # b used on odd steps only, on every rank; skip never used.
    for r in pools.run(world_size, _side_by_side, "branchy",
                       {"find_unused_parameters": True}, 4, _sign_alternating):
        assert r["gradring"]["error"] is None and r["torch"]["error"] is None
        assert compare_grads(r["gradring"]["grads"], r["torch"]["grads"]) is None
        # never-used layer keeps grad None
        assert all(g[4] is None and g[5] is None for g in r["gradring"]["grads"])
        assert r["gradring"]["logging"]["bucket_sizes"] and \
            not r["gradring"]["logging"]["has_rebuilt_buckets"]


def _sign_alternating(rank, s):
    return 1.0 if s % 2 else -1.0


def _sign_rank0_only(rank, s):
    return 1.0 if rank == 0 else -1.0


def test_used_on_some_ranks_only_gets_the_average(pools):
    for r in pools.run(2, _side_by_side, "branchy", {"find_unused_parameters": True}, 3,
                       _sign_rank0_only):
        assert r["gradring"]["error"] is None
        assert compare_grads(r["gradring"]["grads"], r["torch"]["grads"]) is None
        assert r["gradring"]["grads"][0][2] is not None  # b: rank 0 used it, everyone averages


def test_unused_output_grads_stay_none(pools):
    # head_b feeds only the unused second output: with find_unused it must be
    # reported unused (grad None), not "used with zero gradient".
    for r in pools.run(2, _side_by_side, "two_heads", {"find_unused_parameters": True}, 2):
        assert compare_grads(r["gradring"]["grads"], r["torch"]["grads"]) is None
        assert r["gradring"]["grads"][0][4] is None


@pytest.mark.parametrize("world_size", [2, 3])
def test_moe_matches_torch(pools, world_size):
    for r in pools.run(world_size, _side_by_side, "moe", {"find_unused_parameters": True}, 4):
        assert r["gradring"]["error"] is None, r["gradring"]["error"]
        assert compare_grads(r["gradring"]["grads"], r["torch"]["grads"]) is None


def test_warns_once_when_nothing_unused(pools):
    msgs = pools.run(2, _warn_once)[0]
    assert len(msgs) == 1 and "traversal" in msgs[0], msgs
    assert msgs[0].startswith("[rank0]:")


def test_iterative_traversal_on_deep_graph(pools):
    assert pools.run(2, _deep) == [(True, True), (True, True)]


def test_static_graph_matches_torch_and_rebuilds_at_third_forward(pools):
    for r in pools.run(2, _side_by_side, "branchy", {"static_graph": True}, 4,
                       _sign_always_positive):
        assert r["gradring"]["error"] is None, r["gradring"]["error"]
        assert compare_grads(r["gradring"]["grads"], r["torch"]["grads"]) is None
        assert r["gradring"]["grads"][0][4] is None  # skip: unused every iteration


def _sign_always_positive(rank, s):
    return 1.0


def test_static_graph_rebuild_timing(pools):
    events = pools.run(2, _static_changes, "none")[0]
    rebuilt = [e[2] for e in events if e[0] == "ok"]
    assert rebuilt[:4] == [0, 0, 1, 1], events  # recorded in backward 2, rebuilt at forward 3


def test_static_graph_param_dropped_raises_next_forward(pools):
    for events in pools.run(2, _static_changes, "b_dropped"):
        kind, step, msg = events[-1]
        assert kind == "error" and step == 3, events
        assert "Expected to have finished reduction in the prior iteration" in msg
        assert "one parameter is used in first iteration, but then got unused" in msg
        assert "b.weight" in msg


def test_static_graph_param_added_raises_in_backward(pools):
    for events in pools.run(2, _static_changes, "b_added"):
        kind, step, msg = events[-1]
        assert kind == "error" and step == 2, events
        assert "one parameter is unused in first iteration, but then got used" in msg
        assert "b." in msg


def test_reentrant_checkpoint_twice(pools):
    for r in pools.run(2, _side_by_side, "checkpointed", {"static_graph": True}, 3):
        assert r["gradring"]["error"] is None, r["gradring"]["error"]
        assert compare_grads(r["gradring"]["grads"], r["torch"]["grads"]) is None
    for r in pools.run(2, _side_by_side, "checkpointed", {"find_unused_parameters": True}, 2):
        assert "Expected to mark a variable ready only once" in r["torch"]["error"]
        msg = r["gradring"]["error"]
        assert msg and "Expected to mark a variable ready only once" in msg
        assert "block.0." in msg and "checkpoint" in msg


def test_unused_parameter_error_names_params_on_every_rank(pools):
    for msgs in pools.run(2, _unused_error, "all"):
        assert len(msgs) == 1
        m = msgs[0]
        assert "Expected to have finished reduction in the prior iteration" in m
        assert "find_unused_parameters=True" in m
        for rank in (0, 1):
            assert f"did not receive grad for rank {rank}: 2 3" in m
        assert "idle.weight" in m and "idle.bias" in m
