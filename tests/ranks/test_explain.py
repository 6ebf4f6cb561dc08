"""gradring.explain: the step breakdown (synthetic events, exact) and every finding,
each provoked in a small real 2-rank run and absent from a run that must not report it."""

from __future__ import annotations

import json
import time

import pytest
import torch
from torch import nn

import gradring
from gradring.observe.trace import Event
from gradring.tools import explain_record as ex
from tests.support.explain_rows import assert_rows_add_up, printed_rows

STEPS = 12


# ----------------------------------------------------------------- synthetic: exact numbers
def _rank_events(fwd0: float, slow: float, gate_shift: float = 0.0) -> list[Event]:
    """Three steps of 20 ms (+slow) each; times in seconds. Per step: forward 2 ms
    (pre 0.5, post 0.3), backward 8 ms + slow, two buckets, optimizer 1 ms."""
    out = []
    t = fwd0
    for it in range(3):
        ms = lambda x, t=t: t + x / 1e3  # noqa: E731
        b0 = 3.0 + slow
        out += [Event(it, "forward_start", -1, ms(0)), Event(it, "module_start", -1, ms(0.5)),
                Event(it, "module_end", -1, ms(1.7)), Event(it, "forward_end", -1, ms(2.0)),
                Event(it, "backward_start", -1, ms(b0)),
                Event(it, "ready", 0, ms(b0 + 2)), Event(it, "launch", 0, ms(b0 + 2)),
                Event(it, "comm_done", 0, ms(b0 + 9)),   # 1 ms past backward_end
                Event(it, "ready", 1, ms(b0 + 7.5)), Event(it, "launch", 1, ms(b0 + 7.5)),
                Event(it, "backward_end", -1, ms(b0 + 8)),
                Event(it, "comm_done", 1, ms(b0 + 12 + gate_shift)),
                Event(it, "written", 0, ms(b0 + 9.2)),
                Event(it, "written", 1, ms(b0 + 12.5 + gate_shift)),
                Event(it + 1, "optimizer_start", -1, ms(b0 + 13 + gate_shift)),
                Event(it + 1, "optimizer_end", -1, ms(b0 + 14 + gate_shift))]
        t += (20.0 + slow + gate_shift) / 1e3
    return out


def test_step_breakdown_on_synthetic_events_is_exact() -> None:
    evs = _rank_events(100.0, 0.0)
    steps = ex.rank_steps(evs)
    assert [s.iteration for s in steps] == [1]  # iteration 0 left out; the last has no end
    s = steps[0]
    assert s.step == pytest.approx(20.0)
    assert s.forward == pytest.approx(2.0)
    assert s.pre_forward == pytest.approx(0.5) and s.post_forward == pytest.approx(0.3)
    assert s.backward == pytest.approx(8.0)
    # exposed 4 ms after backward_end: bucket 0 still runs for 1, then bucket 1 for 3
    assert s.exposed_comm == pytest.approx(4.0)
    assert s.earlier_buckets == pytest.approx(1.0) and s.last_bucket == pytest.approx(3.0)
    assert s.wait == 0.0
    assert s.optimizer == pytest.approx(1.0)
    assert s.copy == pytest.approx(0.5)
    assert s.other == pytest.approx(20.0 - 2 - 8 - 4 - 0.5 - 1)
    # the rows add up to the step, the parts to the exposed time
    assert sum(getattr(s, k) for k in ex.STEP_ROWS) == pytest.approx(s.step)
    assert sum(getattr(s, k) for k in ex.EXPOSED_ROWS) == pytest.approx(s.exposed_comm)


def _records(*ranks: list[Event], **facts: object) -> list[dict]:
    return [{"rank": r, "facts": _facts(**facts), "curve": None,
             "events": [list(e) for e in evs]} for r, evs in enumerate(ranks)]


def test_wait_for_the_slowest_rank_is_split_off_the_exposed_time() -> None:
    # Rank 1 starts its backward 2 ms later; both finish the last collective together.
    fast, slow = _rank_events(100.0, 0.0, gate_shift=2.0), _rank_events(100.0, 2.0)
    rec = _records(fast, slow)
    gates = ex.launched_by_all(rec, ex.record_events(rec))
    s = ex.rank_steps(fast, gates[0])[0]
    # The fast rank's backward ends at 11 ms. Bucket 0 runs on to 12 (the slow rank
    # launched it at 7: real work); bucket 1 starts at 12 but the slow rank launches
    # it only at 12.5 (5 + 7.5): 0.5 ms of waiting, then 4.5 of its own run.
    assert s.wait == pytest.approx(0.5)
    assert s.earlier_buckets == pytest.approx(1.0) and s.last_bucket == pytest.approx(4.5)
    assert s.wait + s.last_bucket + s.earlier_buckets == pytest.approx(6.0)
    x = ex.analyse(rec)
    assert x.parts[0]["wait"] == pytest.approx(0.5) and x.parts[1]["wait"] == 0.0
    # The printed table gives the whole exposed time (overlap_stats' figure) on one
    # row and its parts indented below it, adding up to it as printed.
    rows = printed_rows(ex.format_explanation(x))
    assert rows["exposed comm"][0] == pytest.approx(6.0, abs=0.005)
    assert rows["wait (peers)"][0] == pytest.approx(0.5, abs=0.005)
    for r in (0, 1):
        assert_rows_add_up(rows, r)


def test_printed_rows_add_up_as_printed() -> None:
    # 1.114 + 1.114 + 1.114 = 3.342: rounded alone, 1.11 x 3 = 3.33 under a 3.34 total
    assert ex.apportion(3.342, [1.114, 1.114, 1.114]) == [1.12, 1.11, 1.11]
    assert sum(ex.apportion(7.72, [0.374, 3.733, 3.613])) == pytest.approx(7.72)
    assert ex.apportion(0.0, [0.0, 0.0]) == [0.0, 0.0]


def _facts(**kw: object) -> dict:
    base = {"rank": 0, "world_size": 2, "device": "cpu", "find_unused": False,
            "unused_last": 0, "static_graph": False, "bucket_view": True, "comm_hook": "",
            "sync_buffers": True, "buffers": [], "num_forward": 3, "bucket_cap_bytes": 25 << 20,
            "sizes": [], "keys": [], "names": [], "bucket_params": [], "bucket_bytes": [],
            "grad_bytes_outside_buckets": 0}
    return {**base, **kw}


def test_no_complete_step_is_a_clear_error() -> None:
    rec = [{"rank": 0, "facts": _facts(), "curve": None,
            "events": [list(e) for e in _rank_events(1.0, 0.0)[:10]]}]
    with pytest.raises(ValueError, match="no complete DDP step"):
        ex.analyse(rec)


# ----------------------------------------------------------------- real 2-rank runs
class Sleepy(nn.Module):
    """Sleeps ``seconds`` in its forward on rank ``rank``: a straggler on demand."""

    def __init__(self, rank: int, seconds: float) -> None:
        super().__init__()
        self.rank, self.seconds = rank, seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        if dist.get_rank() == self.rank:
            time.sleep(self.seconds)
        return x


def _mlp(width: int, depth: int, out: int = 8) -> list[nn.Module]:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return layers + [nn.Linear(width, out)]


class WithUnusedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(*_mlp(16, 48))
        self.spare = nn.Linear(8, 8)  # never used

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _slow_hook(state: object, bucket: object) -> torch.futures.Future:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    time.sleep(0.004)  # a codec whose work costs more than its bytes save here
    return allreduce_hook(state, bucket)


def _build(case: str) -> tuple[nn.Module, dict, torch.Tensor]:
    torch.manual_seed(0)
    kw: dict = {}
    if case in ("unused_on", "unused_needed"):
        # 97 small tensors: the graph walk is measurable, the step stays short
        model = WithUnusedHead() if case == "unused_needed" else nn.Sequential(*_mlp(16, 48))
        kw = {"find_unused_parameters": True}
        return model, kw, torch.randn(4, 16)
    if case == "constant_buffer":
        model = nn.Sequential(*_mlp(64, 2))
        model.register_buffer("table", torch.randn(1 << 20))  # 4 MiB, never written
        return model, kw, torch.randn(4, 64)
    if case == "batchnorm":
        model = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(),
                              nn.Linear(64, 8))
        return model, kw, torch.randn(4, 64)
    if case in ("tiny_cap", "default_cap"):  # 4 MiB in 32 tensors: 1 bucket each at 1 KB
        model = nn.Sequential(*_mlp(256, 16))
        kw = {"bucket_cap_mb": 0.001} if case == "tiny_cap" else {}
        return model, kw, torch.randn(4, 256)
    if case == "split_last":    # 32 MiB of 4 MiB tensors in one last bucket
        return nn.Sequential(*_mlp(1024, 8)), kw, torch.randn(2, 1024)
    if case == "one_tensor_last":  # the last bucket is one 4 MiB tensor: no cap splits it
        return nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 8)), kw, \
            torch.randn(2, 1024)
    if case in ("slow_hook", "no_hook"):
        return nn.Sequential(*_mlp(256, 3)), kw, torch.randn(4, 256)
    if case in ("copies", "view"):
        # find_unused_parameters keeps every reduced gradient in the bucket until finalize
        # copies it out (no homes, nothing lent): the copy a bucket view saves.
        kw = {"gradient_as_bucket_view": case == "view", "find_unused_parameters": True}
        return nn.Sequential(*_mlp(512, 4)), kw, torch.randn(4, 512)
    if case in ("straggler", "balanced"):
        model = nn.Sequential(Sleepy(1, 0.05 if case == "straggler" else 0.0), *_mlp(64, 2))
        return model, kw, torch.randn(4, 64)
    raise ValueError(case)


def explain_case(rank: int, world: int, case: str, out_dir: str | None = None) -> dict:
    torch.set_num_threads(1)
    model, kw, x = _build(case)
    ddp = gradring.DistributedDataParallel(model, **kw)
    if case == "slow_hook":
        ddp.register_comm_hook(None, _slow_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        ddp(x).pow(2).mean().backward()
        opt.step()
    result = gradring.explain(ddp)
    assert isinstance(result, ex.Explanation)
    out = {"keys": result.keys(), "text": result.text, "parts": result.parts,
           "straggler": result.straggler, "unused_last": len(ddp.reducer.unused_in_last_forward())}
    if out_dir is not None:
        from gradring.link_curve import curve_sizes, measure_allreduce
        from gradring.observe.overlap import export_chrome_trace, merge_traces

        total = sum(p.numel() * p.element_size() for p in ddp.module.parameters())
        curve = measure_allreduce(ddp.comm, curve_sizes(total))
        paths = ddp.comm.all_gather_object(
            export_chrome_trace(ddp, f"{out_dir}/rank{rank}.json", curve=curve))
        live = ex.analyse(ddp.comm.all_gather_object(ex.rank_record(ddp, curve)))
        out["live_parts"] = live.parts
        if rank == 0:
            merge_traces(paths, f"{out_dir}/merged.json")
    return out


PAIRS = [  # (finding, run that provokes it, run that must not report it)
    ("find_unused", "unused_on", "unused_needed"),
    ("forward_sync_buffers", "constant_buffer", "batchnorm"),
    ("bucket_cap", "tiny_cap", "default_cap"),
    ("last_bucket", "split_last", "one_tensor_last"),
    ("comm_hook", "slow_hook", "no_hook"),
    ("bucket_view", "copies", "view"),
    ("straggler", "straggler", "balanced"),
]


@pytest.mark.parametrize("key,provoked,clean", PAIRS, ids=[p[0] for p in PAIRS])
def test_finding_is_reported_when_provoked_and_not_otherwise(pools, key, provoked, clean) -> None:
    hit = pools.run(2, explain_case, provoked, timeout=120)
    assert hit[0]["keys"] == hit[1]["keys"], "every rank gets the same answer"
    if key == "bucket_cap" and key not in hit[0]["keys"]:
        # the fitted model's saving must also clear the spread of the measured steps: on
        # a loaded machine it may not, and explain must then say so, naming the change
        assert "is far from the step model's pick: construct DDP with bucket_cap_mb=" in \
            hit[0]["text"] and "too noisy to tell" in hit[0]["text"], hit[0]["text"]
    else:
        assert key in hit[0]["keys"], hit[0]["text"]
        finding = next(line for line in hit[0]["text"].splitlines() if "expected saving" in line)
        assert "ms/step" in finding
    miss = pools.run(2, explain_case, clean, timeout=120)
    assert key not in miss[0]["keys"], miss[0]["text"]
    if key == "find_unused":
        assert miss[0]["unused_last"] == 2  # the clean run really left spare.weight, .bias unused
    if key == "straggler":
        assert hit[0]["straggler"]["rank"] == 1 and hit[0]["straggler"]["part"] == "forward"


def test_trace_files_give_the_live_answer(pools, tmp_path, capsys) -> None:
    res = pools.run(2, explain_case, "constant_buffer", str(tmp_path), timeout=120)
    merged = str(tmp_path / "merged.json")
    offline = ex.analyse(ex.load(merged))
    # Same events, same arithmetic: the file and the live model agree exactly.
    assert offline.parts == {int(k): v for k, v in res[0]["live_parts"].items()}
    assert ex.analyse(ex.load(str(tmp_path))).parts == offline.parts  # the per-rank files
    from gradring.tools import explain as cli

    assert cli.main([merged]) == 0
    out = capsys.readouterr().out
    # torch 2.13's name for it: broadcast_buffers is deprecated (a FutureWarning)
    assert "forward_sync_buffers=False" in out and "broadcast_buffers" not in out
    assert cli.main([merged, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ranks"] == [0, 1] and "forward_sync_buffers" in [f["key"] for f in doc["findings"]]


def test_explain_cli_rejects_files_it_cannot_read(tmp_path, capsys) -> None:
    from gradring.tools import explain as cli

    dump = tmp_path / "rank0.json"
    dump.write_text(json.dumps({"rank": 0, "pid": 1, "entries": []}))
    assert cli.main([str(tmp_path)]) == 2
    assert "flight-recorder dump" in capsys.readouterr().err
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"traceEvents": [], "otherData": {}}))
    assert cli.main([str(old)]) == 2
    err = capsys.readouterr().err
    assert "without ProfilerStep spans" in err and "prof.step()" in err
