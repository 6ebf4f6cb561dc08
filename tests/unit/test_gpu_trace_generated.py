"""The torch-DDP-shaped trace benchmarks/explain_vs_hta.py generates is one HTA and
gradring read alike: same kernels, same overlap and breakdown (HTA's figures are the
oracle), with DDP's events where a reader of torch's DDP looks for them."""

from __future__ import annotations

import collections
import math
import os

import pytest

from benchmarks.explain_vs_hta import make_ddp_trace
from gradring.tools.gpu_trace import (
    device_breakdown,
    device_window,
    kernels_before,
    overlap_pct,
    read_kernels,
)
from gradring.tools.trace_file import read_json

pytest.importorskip("hta", reason="holistictraceanalysis is missing: pip install -e '.[test]'")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_generated_trace_reads_as_hta_reads_it(tmp_path):
    from hta.trace_analysis import TraceAnalysis

    path = os.path.join(tmp_path, "rank0.json")
    count = make_ddp_trace(path, events=6000, rank=0, world=2, layers=12)
    doc = read_json(path)
    events = doc["traceEvents"]
    assert len(events) == count >= 6000
    names = collections.Counter(e.get("name") for e in events)
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                   if str(e.get("name", "")).startswith("ProfilerStep#"))
    assert len(steps) >= 3
    for name in ("DistributedDataParallel.forward", "c10d::allreduce_", "nccl:all_reduce",
                 "record_param_comms", "torch.distributed.ddp.reducer::copy_bucket_to_grad",
                 "Optimizer.step#SGD.step"):
        assert names[name] >= len(steps), name
    kernels = read_kernels(events)
    assert all(k.launch_us is not None and k.launch_us < k.start_us for k in kernels)
    assert sum(k.is_comm for k in kernels) == names["nccl:all_reduce"]

    kept = kernels_before(kernels, steps[-1][0])
    rounded = []
    for k in kept:  # as HTA rounds ns fractions (see test_gpu_trace_hta.py)
        start, end = math.ceil(k.start_us), math.floor(k.start_us + k.dur_us)
        rounded.append(k._replace(start_us=float(start), dur_us=float(end - start)))
    analysis = TraceAnalysis(trace_dir=str(tmp_path))
    overlap = analysis.get_comm_comp_overlap(visualize=False)
    assert overlap_pct(rounded) == pytest.approx(
        float(overlap["comp_comm_overlap_pctg"].iloc[0]), abs=0.006)
    hta = analysis.get_temporal_breakdown(visualize=False).iloc[0]
    lo, hi = device_window(rounded)
    mine = device_breakdown(rounded, lo, hi)
    assert hi - lo == pytest.approx(hta["kernel_time(us)"], abs=0.5)
    assert mine["idle_ms"] * 1e3 == pytest.approx(hta["idle_time(us)"], abs=0.5)
    assert mine["compute_ms"] * 1e3 == pytest.approx(hta["compute_time(us)"], abs=0.5)
