"""``gradring timeline`` for torch.profiler traces: the same phases and lanes as for
gradring's own record, from the trace model (``read_profiler``), GPU lanes included.

Every instant of a ``ProfilerStep`` is one phase of ``timeline.PHASES``
(explain's rows, [Note: the rows of a profiled step] in ``analysis.py``): where spans
overlap, waiting for peers wins, then a collective running after autograd, the
backward, the forward, the optimizer, copying into .grad, then other. The comm lane
draws each bucket from its launch to its end; on a GPU trace a third lane per rank
draws the device's kernels (compute, NCCL, memory).
"""

from __future__ import annotations

from typing import Any

from gradring.observe.overlap import ExposedComm
from gradring.tools import analysis
from gradring.tools.timeline_lanes import (
    GANTT_MAX,
    PHASE_ROWS,
    PHASES,
    Segment,
    TimelineReport,
    _tile,
)
from gradring.tools.trace_model import StepTrace, TraceModel


def _segments(st: StepTrace, gates: dict[int, float] | None) -> list[Segment]:
    s = 1e-6  # us -> s
    marks: list[tuple[int, float, float, str, int]] = []
    for b in st.buckets:
        g = gates.get(b.index) if gates else None
        for a, e in b.exposed:
            if g is not None and a < g:
                marks.append((0, a * s, min(e, g) * s, PHASES[2], b.index))
                a = min(e, g)
            if e > a:
                marks.append((1, a * s, e * s, PHASES[3], b.index))
    marks.append((2, st.backward_start_us * s, st.backward_end_us * s, "backward", -1))
    for a, e in st.forward_us:
        marks.append((3, a * s, e * s, "forward", -1))
    for a, e in st.optimizer_us:
        marks.append((4, a * s, e * s, "optimizer", -1))
    marks.append((5, st.backward_end_us * s, st.tail_end_us * s, "copy into .grad", -1))
    return [Segment(st.number, label, a, b, bucket)
            for a, b, label, bucket in _tile(st.start_us * s, st.end_us * s, marks)]


def gpu_lanes(model: TraceModel, chosen: set[int]) -> dict[int, list[tuple[float, float, str]]]:
    """Rank -> its kernels in the drawn steps as (start s, end s, kind), kind as HTA counts
    it (``gpu_trace.kernel_kind``); {} on CPU traces."""
    if model.device != "cuda":
        return {}
    from gradring.tools import gpu_trace

    out = {}
    for r, rt in model.ranks.items():
        devices = gpu_trace.by_device(gpu_trace.read_kernels(rt.events))
        if not devices:
            continue
        kernels = max(devices.values(), key=len)
        steps = sorted(rt.steps, key=lambda st: st.start_us)
        owner = gpu_trace.assign_steps(kernels, [(st.start_us, st.end_us) for st in steps])
        out[r] = [(k.start_us * 1e-6, (k.start_us + k.dur_us) * 1e-6, gpu_trace.kernel_kind(k.name))
                  for k, o in zip(kernels, owner) if o is not None and steps[o].number in chosen]
    return out


def profile_timeline_report(model: TraceModel, last: int = 3) -> TimelineReport:
    """The timeline of a profiled run: the newest ``last`` kept steps (0: all)."""
    rows, kept, _ = analysis.rank_rows(model)
    if not kept:
        raise ValueError("no ProfilerStep holds a complete DDP step on every rank")
    chosen = kept[-last:] if last > 0 else kept
    gates = analysis.gates_of(model)
    segments, phase_ms, step_ms, comm, exposed = {}, {}, {}, {}, {}
    for r, rt in model.ranks.items():
        by_n = {st.number: st for st in rt.steps}
        segments[r] = {n: _segments(by_n[n], {b.index: gates[r][(n, b.index)]
                                              for b in by_n[n].buckets
                                              if (n, b.index) in gates[r]} or None)
                       for n in chosen}
        drawn = [rows[r][n] for n in chosen]
        phase_ms[r] = {p: sum(sum(x[k] for k in PHASE_ROWS[p]) for x in drawn) / len(drawn)
                       for p in PHASES}
        step_ms[r] = sum(x["step"] for x in drawn) / len(drawn)
        comm[r] = [(n, b.index, b.launch_us * 1e-6, b.done_us * 1e-6) for n in chosen
                   for b in by_n[n].buckets if b.done_us is not None]
        every = [rows[r][n]["exposed_comm"] for n in kept]
        exposed[r] = ExposedComm(sum(every) / len(every), tuple(kept), tuple(every))
    offsets = {r: rt.offset_us * 1e-6 for r, rt in model.ranks.items()}
    return TimelineReport("gantt" if len(chosen) <= GANTT_MAX else "summary", list(chosen),
                          segments, offsets, exposed, phase_ms, step_ms, comm,
                          gpu_lanes(model, set(chosen)),
                          "gradring explain" if model.device == "cpu" else
                          "the CPU's view: gradring explain gives the device's on GPU traces")


def load_model(paths: list[str], max_bytes: int | None = None) -> Any:
    """The trace model of torch.profiler files (None when they hold gradring's record)."""
    from gradring.tools.explain_record import records_of
    from gradring.tools.read_profiler import is_profiler_trace, read_profiler
    from gradring.tools.trace_file import read_json

    docs = [(p, read_json(p, max_bytes=max_bytes)) for p in paths]
    if records_of(docs):
        return None
    profiled = [(p, d) for p, d in docs if is_profiler_trace(d) and has_steps(d)]
    return read_profiler(profiled) if profiled else None


def has_steps(doc: Any) -> bool:
    """Whether a trace holds ``ProfilerStep`` spans (else timeline draws it as before)."""
    events = doc.get("traceEvents") if isinstance(doc, dict) else doc
    return isinstance(events, list) and any(
        isinstance(e, dict) and str(e.get("name", "")).startswith("ProfilerStep#")
        for e in events)
