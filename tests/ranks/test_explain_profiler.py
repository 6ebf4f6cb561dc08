"""gradring explain on torch.profiler traces of real 2-rank gloo runs, torch's DDP and
gradring's, with known costs injected: each must show in the row it belongs to,
against the same run without it (the oracle)."""

from __future__ import annotations

import glob
import gzip
import json
import os
import time

import pytest
import torch
from torch import nn

from gradring.tools import explain as cli
from gradring.tools.explain import explain_path
from tests.support.explain_rows import assert_rows_add_up, printed_rows

SLEEP_S = 0.03          # the injected cost, 30 ms: far above a step of this model
ROWS = ("forward", "backward", "exposed_comm", "copy", "optimizer", "other")


class Sleep(nn.Module):
    """Sleeps in its forward: ``seconds[rank]``."""

    def __init__(self, seconds: dict[int, float]) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        time.sleep(self.seconds.get(dist.get_rank(), 0.0))
        return x


def _hold_last_bucket(state, bucket):  # noqa: ANN001, ANN201 (torch checks the annotation)
    """A comm hook that holds the last bucket SLEEP_S before reducing it, off the
    backward's thread: the backward ends, and DDP waits for that bucket."""
    import threading

    import torch.distributed as dist

    buf = bucket.buffer().div_(dist.get_world_size())
    if not bucket.is_last():
        return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])
    fut: torch.futures.Future = torch.futures.Future()

    def later() -> None:
        time.sleep(SLEEP_S)
        dist.all_reduce(buf)
        fut.set_result(buf)

    threading.Thread(target=later, daemon=True).start()
    return fut


def _profiled_run(rank: int, world: int, out: str, ddp_kind: str, case: str) -> str:
    torch.manual_seed(0)
    forward_sleep = {0: SLEEP_S, 1: SLEEP_S} if case == "forward" else \
        {1: 2 * SLEEP_S} if case == "straggler" else {}
    model = nn.Sequential(Sleep(forward_sleep), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    if ddp_kind == "torch":
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.25)
    else:
        import gradring

        ddp = gradring.DistributedDataParallel(model, bucket_cap_mb=0.25)
    if case == "hook":
        ddp.register_comm_hook(None, _hold_last_bucket)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    if case == "optimizer":
        opt.register_step_pre_hook(lambda *_: time.sleep(SLEEP_S))
    x = torch.randn(8, 256)
    sched = torch.profiler.schedule(wait=1, warmup=1, active=3)
    path = os.path.join(out, f"{ddp_kind}_{case}")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                schedule=sched, record_shapes=True,
                                on_trace_ready=torch.profiler.tensorboard_trace_handler(
                                    path, worker_name=f"rank{rank}",
                                    use_gzip=case == "forward")) as prof:
        for _ in range(5):
            opt.zero_grad()
            ddp(x).pow(2).mean().backward()
            opt.step()
            prof.step()
    return path


def _runs(pools: object, tmp: str, ddp_kind: str, cases: tuple[str, ...]) -> dict[str, object]:
    out = {}
    for case in cases:
        paths = pools.run(2, _profiled_run, tmp, ddp_kind, case)  # type: ignore[attr-defined]
        out[case] = explain_path(paths[0])
    return out


@pytest.mark.slow  # ten 2-rank profiled runs: about 10 s
@pytest.mark.timeout(240)
@pytest.mark.parametrize("ddp_kind", ["torch", "gradring"])
def test_injected_costs_show_in_their_rows(pools, tmp_path, ddp_kind: str) -> None:
    cases = ("plain", "forward", "straggler", "optimizer") + \
        (("hook",) if ddp_kind == "torch" else ())
    x = _runs(pools, str(tmp_path), ddp_kind, cases)
    plain = x["plain"]
    assert plain.source == "torch.profiler" and plain.ddp == ddp_kind
    assert plain.device == "cpu" and plain.ranks == [0, 1]
    sleep_ms = SLEEP_S * 1e3
    for case, e in x.items():
        doc = e.as_json()
        assert {"ranks", "steps", "parts", "straggler", "findings", "notes", "source", "ddp",
                "device", "buckets"} <= set(doc), case
        for r in ("0", "1"):
            p = doc["parts"][r]
            assert sum(p[k] for k in ROWS) == pytest.approx(p["step"], abs=1e-6), (case, p)
            assert p["wait"] + p["last_bucket"] + p["earlier_buckets"] == \
                pytest.approx(p["exposed_comm"], abs=1e-6), (case, p)
            assert len(doc["buckets"][r]) >= 2, (case, doc["buckets"])
        rows = printed_rows(e.text)
        for r in (0, 1):
            assert_rows_add_up(rows, r)

    def grew(case: str, rank: int) -> dict[str, float]:
        return {k: x[case].parts[rank][k] - plain.parts[rank][k] for k in ROWS}

    # a sleep in the forward lands in forward, on both ranks, and a slow optimizer step
    # in optimizer: rows that held less than half of it without the sleep (other rows
    # may grow too on a loaded machine, so they are not compared)
    for case, row in (("forward", "forward"), ("optimizer", "optimizer")):
        for r in (0, 1):
            assert plain.parts[r][row] < 0.5 * sleep_ms, plain.parts[r]
            assert grew(case, r)[row] >= 0.8 * sleep_ms, (case, grew(case, r))
    # rank 1 sleeps 60 ms more in its forward: it is the straggler, and rank 0 waits for it
    s = x["straggler"]
    assert s.straggler is not None and s.straggler["rank"] == 1, (s.straggler, s.text)
    assert s.parts[0]["wait"] >= 0.5 * 2 * sleep_ms, s.parts[0]
    assert s.parts[0]["wait"] > s.parts[1]["wait"]
    assert "straggler" in s.keys()
    # without a straggler, the line says why, and it is true of the figures beside it
    assert plain.straggler is None or plain.straggler["rank"] in (0, 1)
    if ddp_kind == "torch":
        # a comm hook holding the last bucket: exposed comm, as the last bucket's (the
        # earlier buckets' collectives finish while it is held, so exposed comm grows by
        # less than the hold where they were exposed before)
        h = x["hook"]
        for r in (0, 1):
            assert h.parts[r]["exposed_comm"] >= 0.8 * sleep_ms, h.parts[r]
            assert h.parts[r]["last_bucket"] >= 0.5 * sleep_ms, h.parts[r]
            assert h.parts[r]["last_bucket"] > plain.parts[r]["last_bucket"]


def test_bad_traces_get_one_line_and_status_2(tmp_path, capsys) -> None:
    no_steps = tmp_path / "nosteps.json"
    no_steps.write_text(json.dumps({"traceEvents": [
        {"ph": "X", "name": "aten::mm", "ts": 1.0, "dur": 2.0, "pid": 1, "tid": 1}]}))
    assert cli.main([str(no_steps)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "ProfilerStep" in err and "prof.step()" in err
    no_ddp = tmp_path / "noddp.json.gz"
    events = [{"ph": "X", "name": "ProfilerStep#1", "ts": 0.0, "dur": 100.0, "pid": 1, "tid": 1},
              {"ph": "X", "name": "aten::mm", "ts": 1.0, "dur": 2.0, "pid": 1, "tid": 1},
              {"ph": "X", "name": "autograd::engine::evaluate_function: MmBackward0",
               "ts": 10.0, "dur": 2.0, "pid": 1, "tid": 1}]
    with gzip.open(no_ddp, "wt") as f:
        json.dump({"traceEvents": events, "distributedInfo": {"rank": 0}}, f)
    assert cli.main([str(no_ddp)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "no DDP step" in err, err


def test_json_of_a_real_trace_folder(pools, tmp_path, capsys) -> None:
    path = pools.run(2, _profiled_run, str(tmp_path), "torch", "forward")[0]
    assert sorted(os.path.basename(p).split(".")[0] for p in glob.glob(path + "/*")) == \
        ["rank0", "rank1"]
    assert cli.main([path, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["source"] == "torch.profiler" and doc["ddp"] == "torch"
    assert doc["device"] == "cpu" and "gpu" not in doc
    for r in ("0", "1"):
        for b in doc["buckets"][r]:
            assert set(b) == {"index", "bytes", "launch_ms", "exposed_ms"}
        # bytes from the ops' input dims: the buckets hold every gradient, once
        total = sum(b["bytes"] for b in doc["buckets"][r])
        assert total == 4 * (3 * 256 * 256 + 3 * 256)


@pytest.mark.slow  # a profiled run and a PNG: a few seconds
def test_timeline_draws_a_profiler_trace_with_explains_rows(pools, tmp_path, capsys) -> None:
    pytest.importorskip("matplotlib", reason="drawing the timeline needs matplotlib")
    from gradring.tools import timeline
    from gradring.tools.profile_timeline import load_model, profile_timeline_report
    from gradring.tools.trace_file import trace_files

    path = pools.run(2, _profiled_run, str(tmp_path), "torch", "plain")[0]
    out = str(tmp_path / "t.png")
    assert timeline.main([path, "-o", out, "--last", "0"]) == 0
    assert os.path.getsize(out) > 10_000
    report = profile_timeline_report(load_model(trace_files(path)), 0)
    x = explain_path(path)
    for r in (0, 1):
        # every phase is explain's rows, over the same steps
        assert report.step_ms[r] == pytest.approx(x.parts[r]["step"], rel=1e-9)
        assert sum(report.phase_ms[r].values()) == pytest.approx(report.step_ms[r], rel=1e-9)
        assert report.phase_ms[r]["forward"] == pytest.approx(x.parts[r]["forward"], rel=1e-9)
        # the tiles cover each step exactly once
        for it, segs in report.segments[r].items():
            length = sum(s.t1 - s.t0 for s in segs) * 1e3
            assert length == pytest.approx(
                next(st for st in load_model(trace_files(path)).ranks[r].steps
                     if st.number == it).end_us / 1e3 - segs[0].t0 * 1e3, rel=1e-6)


HTA_A100 = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "hta",
                        "nccl_parser_config", "nccl_data.json.gz")


def test_a_public_a100_trace_gets_its_gpu_breakdown(tmp_path) -> None:
    from gradring.tools import gpu_trace
    from gradring.tools.trace_file import read_json

    x = explain_path(HTA_A100)
    doc = x.as_json()
    assert doc["source"] == "torch.profiler" and doc["ddp"] == "torch"
    assert doc["device"] == "cuda" and set(doc["gpu"]) == {"0"}
    p = doc["parts"]["0"]
    assert sum(p[k] for k in ROWS + ("idle",)) == pytest.approx(p["step"], abs=1e-6)
    g = doc["gpu"]["0"]
    assert set(g) == {"compute_ms", "comm_ms", "exposed_comm_ms", "idle_ms", "overlap_pct"}
    assert g["exposed_comm_ms"] == pytest.approx(p["exposed_comm"])
    assert g["idle_ms"] == pytest.approx(p["idle"])
    # the overlap is over the trace's kernels launched before its last ProfilerStep, as
    # HTA's get_comm_comp_overlap counts them (tests/unit/test_gpu_trace_hta.py compares
    # that figure with HTA's own)
    events = read_json(HTA_A100)["traceEvents"]
    kernels = gpu_trace.read_kernels(events)
    last = max(e["ts"] for e in events if str(e.get("name", "")).startswith("ProfilerStep#"))
    assert g["overlap_pct"] == pytest.approx(
        gpu_trace.overlap_pct(gpu_trace.kernels_before(kernels, last)))
    # every bucket's bytes, as the trace's own record_param_comms says of its all-reduce
    said = sorted(e["args"]["In msg nelems"] * 4 for e in events
                  if e.get("name") == "record_param_comms"
                  and e.get("args", {}).get("Collective name") == "allreduce")
    got = [b["bytes"] for b in doc["buckets"]["0"]]
    assert got and set(got) <= set(said)
