"""torch DDP internals that torch's own DDP tests read, each against torch's DDP.

Every rank function runs the same scenario with torch's DDP and with
gradring's, in the same processes, and the test compares the two: the
reducer's usage map and static-graph detection, the logging data's keys and
types, the reducer's parameter list and names, torch's error sentences, the
profiler events, the output copy switch, the Logger torch's helpers take, and
the rank a Join takes the model from.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import gradring

pytestmark = pytest.mark.timeout(240)

TORCH_DDP = torch.nn.parallel.DistributedDataParallel
BOTH = (("theirs", TORCH_DDP), ("ours", gradring.DistributedDataParallel))


class Branchy(nn.Module):
    """lin2 is used on inputs of ones only (on ``rank_only`` alone, if given)."""

    def __init__(self, rank_only: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin1 = nn.Linear(10, 10, bias=False)
        self.lin2 = nn.Linear(10, 10, bias=False)
        self.rank_only = rank_only

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        use = bool((x == 1).all()) and (self.rank_only is None
                                        or dist.get_rank() == self.rank_only)
        return self.lin2(torch.relu(self.lin1(x))) if use else torch.relu(self.lin1(x))


def _inputs(i: int) -> torch.Tensor:
    return torch.ones(4, 10) if i % 2 else torch.randn(4, 10, generator=torch.Generator()
                                                      .manual_seed(i))


def _used_maps(rank: int, world: int) -> dict:
    out = {}
    for name, cls in BOTH:
        for rank_only in (None, 1):
            ddp = cls(Branchy(rank_only), find_unused_parameters=True)
            maps, static = [], []
            for i in range(4):
                ddp(_inputs(i)).sum().backward()
                maps.append(ddp.reducer._get_local_used_map().tolist())
                static.append(ddp.reducer._ddp_graph_static())
            # The same unused set every iteration: static.
            steady = cls(Branchy(), find_unused_parameters=True)
            for _ in range(3):
                steady(_inputs(0)).sum().backward()
            out[(name, rank_only)] = (maps, static, steady.reducer._ddp_graph_static())
    return out


def test_used_map_and_graph_static_match_torch(pools) -> None:
    for r in pools.run(2, _used_maps):
        for rank_only in (None, 1):
            assert r[("ours", rank_only)] == r[("theirs", rank_only)], r


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(5, 6)
        self.fc2 = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _logging(rank: int, world: int) -> dict:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    out = {}
    for name, cls in BOTH:
        ddp = cls(Net())
        first = ddp._get_ddp_logging_data()
        ddp._set_ddp_runtime_logging_sample_rate(2)
        seen = []
        for _ in range(14):
            ddp(torch.randn(4, 5)).sum().backward()
            seen.append(ddp._get_ddp_logging_data().get("iteration"))
        data = ddp._get_ddp_logging_data()
        hooked = cls(Net())
        hooked.register_comm_hook(None, default_hooks.allreduce_hook)
        builtin = cls(Net())
        builtin._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
        out[name] = {
            "types_first": {k: type(v).__name__ for k, v in first.items()},
            "types": {k: type(v).__name__ for k, v in data.items()},
            "values": {k: data.get(k) for k in (
                "bucket_sizes", "rebuilt_bucket_sizes", "rebuilt_per_bucket_param_indices",
                "prev_iteration_grad_ready_order_indices", "dtypes", "iteration",
                "num_buckets_reduced", "unused_parameter_size", "master_port",
                "torch_distributed_debug", "gloo_num_threads")},
            "iterations": seen,
            "positive": all(data[k] >= 1 for k in (
                "forward_compute_time", "backward_compute_time", "backward_comm_time",
                "avg_forward_compute_time")),
            "hook": (first.get("comm_hook"), hooked._get_ddp_logging_data().get("comm_hook"),
                     builtin._get_ddp_logging_data().get("comm_hook")),
        }
    return out


def test_logging_data_keys_types_and_sampling_match_torch(pools) -> None:
    for r in pools.run(2, _logging):
        theirs, ours = r["theirs"], r["ours"]
        for when in ("types_first", "types"):
            for key, kind in theirs[when].items():
                assert ours[when].get(key) == kind, (when, key, ours[when].get(key), kind)
        assert ours["values"] == theirs["values"]
        assert ours["iterations"] == theirs["iterations"]
        assert ours["positive"] and theirs["positive"]
        assert ours["hook"] == theirs["hook"]


class WithEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(8, 4, sparse=True)
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4, bias=False)
        self.b.weight = self.a.weight  # shared: counted once
        self.frozen = nn.Linear(4, 4)
        self.frozen.bias.requires_grad_(False)
        self.ignored = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ignored(self.frozen(self.b(self.a(self.emb(x)))))


def _params(rank: int, world: int) -> dict:
    out = {}
    for name, cls in BOTH:
        model = WithEmbedding()
        cls._set_params_and_buffers_to_ignore_for_model(model, ["ignored.weight",
                                                                "ignored.bias"])
        ddp = cls(model)
        params, sparse = ddp._build_params_for_reducer()
        mapping = ddp._build_debug_param_to_name_mapping(params)
        errors = []
        for bad in (params + [nn.Parameter(torch.ones(1))], params[:-1]):
            try:
                ddp._build_debug_param_to_name_mapping(bad)
            except ValueError as exc:
                errors.append(str(exc).split(":")[0][:30])
        names = {id(p): n for n, p in model.named_parameters()}
        out[name] = ([names[id(p)] for p in params], sparse, mapping, errors)
    return out


def test_params_for_reducer_and_names_match_torch(pools) -> None:
    for r in pools.run(2, _params):
        assert r["ours"] == r["theirs"], r


def _errors(rank: int, world: int, debug: str) -> dict:
    dist.set_debug_level(getattr(dist.DebugLevel, debug))
    torch_sentence = "set the environment variable TORCH_DISTRIBUTED_DEBUG to either INFO"
    out = {}
    try:
        for name, cls in BOTH:
            ddp = cls(Branchy())
            ddp(_inputs(1)).sum().backward()
            try:
                ddp(_inputs(0)).sum().backward()
                ddp(_inputs(0)).sum().backward()
                unused = None
            except RuntimeError as exc:
                msg = str(exc)
                unused = (torch_sentence in msg,
                          f"did not receive grad for rank {rank}: lin2.weight" in msg)
            # Static graph: lin2 unused in iteration 1, used in 2 ("graph changed"),
            # then the next forward raises the unfinished reduction's static form.
            static = cls(Branchy(), static_graph=True)
            raised = []
            for i in range(4):
                try:
                    static(_inputs(i)).sum().backward()
                    raised.append(None)
                except RuntimeError as exc:
                    raised.append(str(exc)[:60])
                    if len(raised) > 2:
                        break
            out[name] = (unused, raised)
    finally:
        dist.set_debug_level(dist.DebugLevel.OFF)
    return out


@pytest.mark.parametrize("debug", ["OFF", "INFO"])
def test_error_sentences_and_points_match_torch(pools, debug) -> None:
    for r in pools.run(2, _errors, debug):
        assert r["ours"] == r["theirs"], r
        assert r["ours"][0] == ((True, False) if debug == "OFF" else (False, True))


def _profiled(rank: int, world: int) -> dict:
    out = {}
    for name, cls in BOTH:
        counts = []
        for find_unused in (False, True):
            ddp = cls(nn.Linear(10, 10, bias=False), find_unused_parameters=find_unused)
            ddp(torch.randn(3, 10)).sum().backward()  # the rebuild is behind
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) \
                    as prof:
                for _ in range(3):
                    ddp(torch.randn(3, 10)).sum().backward()
            events = prof.events()
            reduce = [e for e in events if e.name == "gloo:all_reduce"]
            counts.append((min(1, len(reduce)), all(e.is_async for e in reduce),
                           sum(e.name.endswith("search_unused_parameters") for e in events)))
            if not find_unused:
                counts.append(len(reduce))
        out[name] = counts
    return out


def test_profiler_events_match_torch(pools) -> None:
    for r in pools.run(2, _profiled):
        assert r["ours"] == r["theirs"], r


class _NoClone(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._overloadpacket == torch.ops.aten.clone:
            raise RuntimeError("clone encountered")
        return func(*args, **(kwargs or {}))


def _sink(rank: int, world: int) -> dict:
    out = {}
    for name, cls in BOTH:
        ddp = cls(nn.Linear(4, 4), find_unused_parameters=True)
        ddp._set_ddp_sink_clone(False)
        with _NoClone():
            ddp(torch.randn(2, 4)).sum().backward()
        cloned = cls(nn.Linear(4, 4), find_unused_parameters=True)
        try:
            with _NoClone():
                cloned(torch.randn(2, 4)).sum().backward()
            default = "no clone"
        except RuntimeError as exc:
            default = str(exc)
        out[name] = (default, ddp.module.weight.grad is not None)
    return out


def test_sink_clone_switch_matches_torch(pools) -> None:
    for r in pools.run(2, _sink):
        assert r["ours"] == r["theirs"] == ("clone encountered", True), r


def _logger_and_join(rank: int, world: int) -> dict:
    out = {}
    for name, cls in BOTH:
        ddp = cls(Net())
        try:
            dist._compute_bucket_assignment_by_size(
                [torch.zeros(3).to_sparse()], [400], logger=ddp.logger)
        except RuntimeError:
            pass
        data = ddp._get_ddp_logging_data()
        joined = cls(Net())
        with joined.join():
            for _ in range(2 + 2 * rank):  # the last rank trains longest
                joined(torch.randn(4, 5)).sum().backward()
        out[name] = (data.get("has_error"), "No support for sparse tensors" in
                     data.get("error", ""), joined._authoritative_rank,
                     joined._get_ddp_logging_data().get("join_uneven_inputs"))
    return out


def test_logger_and_authoritative_rank_match_torch(pools) -> None:
    # A small stand-in for torch's test_ddp_uneven_inputs (too slow on CPU).
    for r in pools.run(2, _logger_and_join):
        assert r["ours"] == r["theirs"] == (1, True, 1, 1), r
