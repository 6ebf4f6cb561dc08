"""gradring.tools.gpu_trace on real torch-DDP GPU traces, against Holistic Trace
Analysis' own figures for the same files.

The traces are HTA's test data (tests/data/hta/README.md): A100 and V100 runs with
NCCL. HTA (``holistictraceanalysis``, in the ``test`` extra) parses each folder and
computes ``get_comm_comp_overlap`` and ``get_temporal_breakdown``; gradring reads the
same files with ``read_json`` and ``read_kernels``.

HTA analyses the kernels launched before the last ProfilerStep began, and rounds
timestamps with nanosecond fractions inward to whole microseconds (``ts`` up,
``ts + dur`` down). Given the same kernels rounded the same way, gradring's figures
must equal HTA's; on the unrounded kernels, which ``gradring explain`` uses, they
must stay within a point of the window.
"""

from __future__ import annotations

import copy
import glob
import math
import os

import pytest

from gradring.tools.gpu_trace import (
    Kernel,
    assign_steps,
    device_breakdown,
    device_window,
    kernels_before,
    overlap_pct,
    read_kernels,
    step_windows,
)
from gradring.tools.trace_file import read_json

pytest.importorskip("hta", reason="holistictraceanalysis is missing: pip install -e '.[test]'")

# HTA 0.5.0 sorts and drops in place, which pandas 3 deprecates (and warns on each call).
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "hta")

# The two-rank folder is small enough for the default suite; the others take HTA
# several seconds each to parse.
FOLDERS = [
    "trace_filter",
    pytest.param("nccl_parser_config", marks=pytest.mark.slow),
    pytest.param("negative_queue_length_values_check", marks=pytest.mark.slow),
    pytest.param("df_index_resolver", marks=pytest.mark.slow),
    pytest.param(os.path.join("trace_diff", "control"), marks=pytest.mark.slow),
]


class Rank:
    """One rank's file as gradring reads it."""

    def __init__(self, path: str) -> None:
        doc = read_json(path)
        events = doc["traceEvents"]
        self.rank = int(doc["distributedInfo"]["rank"])
        self.kernels = read_kernels(events)
        self.steps = sorted(
            (float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
            if isinstance(e, dict) and e.get("ph") == "X"
            and str(e.get("name", "")).startswith("ProfilerStep#"))
        # what HTA analyses: kernels launched before the last step began
        self.kept = kernels_before(self.kernels, self.steps[-1][0])


def hta_rounded(kernels: list[Kernel]) -> list[Kernel]:
    out = []
    for k in kernels:
        start, end = math.ceil(k.start_us), math.floor(k.start_us + k.dur_us)
        out.append(k._replace(start_us=float(start), dur_us=float(end - start)))
    return out


def breakdown_us(kernels: list[Kernel], window: tuple[float, float]) -> dict[str, float]:
    """gradring's figures in HTA's terms: idle, compute, non-compute, window (us)."""
    b = device_breakdown(kernels, *window)
    span = window[1] - window[0]
    return {"idle": b["idle_ms"] * 1e3, "compute": b["compute_ms"] * 1e3,
            "non_compute": span - (b["compute_ms"] + b["idle_ms"]) * 1e3, "kernel": span}


def hta_breakdown_us(row) -> dict[str, float]:  # noqa: ANN001 - a pandas row
    return {"idle": row["idle_time(us)"], "compute": row["compute_time(us)"],
            "non_compute": row["non_compute_time(us)"], "kernel": row["kernel_time(us)"]}


@pytest.fixture(scope="module", params=FOLDERS)
def traces(request):
    from hta.trace_analysis import TraceAnalysis

    folder = os.path.join(DATA, request.param)
    ranks = {r.rank: r for r in map(Rank, sorted(glob.glob(os.path.join(folder, "*.json.gz"))))}
    analysis = TraceAnalysis(trace_dir=folder)
    assert sorted(analysis.t.traces) == sorted(ranks)
    return ranks, analysis


def test_overlap_matches_hta(traces):
    ranks, analysis = traces
    hta = analysis.get_comm_comp_overlap(visualize=False).set_index("rank")
    for rank, mine in ranks.items():
        theirs = float(hta.loc[rank, "comp_comm_overlap_pctg"])
        assert overlap_pct(hta_rounded(mine.kept)) == pytest.approx(theirs, abs=0.006)
        assert overlap_pct(mine.kept) == pytest.approx(theirs, abs=1.0)


def test_temporal_breakdown_matches_hta(traces):
    ranks, analysis = traces
    hta = analysis.get_temporal_breakdown(visualize=False).set_index("rank")
    for rank, mine in ranks.items():
        theirs = hta_breakdown_us(hta.loc[rank])
        rounded = hta_rounded(mine.kept)
        assert breakdown_us(rounded, device_window(rounded)) == pytest.approx(theirs, abs=0.5)
        # unrounded: within 1% of the window, figure by figure
        got = breakdown_us(mine.kept, device_window(mine.kept))
        assert got == pytest.approx(theirs, abs=0.01 * theirs["kernel"])


def test_each_step_matches_hta(traces):
    """Per ProfilerStep: the kernels launched in the step, over their own span on the
    device, against HTA's temporal breakdown of the same iteration; and the steps'
    device windows tile the timeline, so their sums are HTA's whole-trace figures."""
    from hta.analyzers.breakdown_analysis import BreakdownAnalysis

    ranks, analysis = traces
    whole = analysis.get_temporal_breakdown(visualize=False).set_index("rank")
    for rank, mine in ranks.items():
        rounded = hta_rounded(mine.kept)
        where = assign_steps(rounded, mine.steps)
        df = analysis.t.traces[rank]
        iterations = sorted(int(i) for i in df["iteration"].unique() if i >= 0)
        assert len(iterations) == len(mine.steps) - 1  # HTA leaves out the last step
        for index, iteration in enumerate(iterations):
            view = copy.copy(analysis.t)
            view.traces = {rank: df[df["iteration"].eq(iteration)]}
            theirs = hta_breakdown_us(
                BreakdownAnalysis.get_temporal_breakdown(view, visualize=False).iloc[0])
            step = [k for k, i in zip(rounded, where) if i == index]
            assert breakdown_us(step, device_window(step)) == pytest.approx(theirs, abs=0.5)
        total = {"idle": 0.0, "compute": 0.0, "non_compute": 0.0, "kernel": 0.0}
        for window in step_windows(rounded, mine.steps):
            if window is not None:
                for key, value in breakdown_us(rounded, window).items():
                    total[key] += value
        assert total == pytest.approx(hta_breakdown_us(whole.loc[rank]), abs=0.5)
