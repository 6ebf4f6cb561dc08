"""``gradring explain``'s analysis of a trace model: rows, buckets, the straggler, findings.

Pure: it reads a ``TraceModel`` (``read_profiler``) and returns an
``Explanation``; nothing here reads files, measures or imports torch.

[Note: which steps a profiler trace's figures are over]
Every ``ProfilerStep`` that holds a DDP backward on every rank is a step.
A step whose time (the slowest rank's) lies more than ``OUTLIER_MADS`` scaled
median absolute deviations from the median step is left out, and the
explanation says how many were. The figures are means over the steps kept,
a trimmed mean: the rows of each step add up to that step, so their means
add up to the mean step (medians of rows would not add up), and no outlier
step moves them.

[Note: the rows of a profiled step]
Per rank and step, in ms (``read_profiler`` says which events make each):
forward; backward (autograd); exposed comm, the tail after autograd less the
copies, split by the bucket the rank waited for: ``wait`` (before the last
rank launched that bucket, on the aligned clocks), ``last_bucket`` and
``earlier_buckets``; copy; optimizer; other, the rest of the step. On a GPU
trace the same CPU rows are given, and ``gpu`` gives the device's view.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from gradring.observe.explain import STEP_ROWS, Explanation, Finding
from gradring.tools.trace_model import StepTrace, TraceModel

#: Steps further than this many scaled MADs from the median step are left out.
OUTLIER_MADS = 3.0
#: The straggler: the others wait for it at least this much per step (and 2 % of it) ...
STRAGGLER_WAIT_MS = 0.1
STRAGGLER_WAIT_FRACTION = 0.02
#: ... and it launched the last bucket last in at least this share of the steps.
STRAGGLER_CONSISTENCY = 0.8


def _clip_ms(spans: Sequence[tuple[float, float]], lo: float, hi: float) -> float:
    return sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in spans) / 1e3


def step_rows(st: StepTrace, gates: dict[int, float] | None) -> dict[str, float]:
    """One step's rows ([Note: the rows of a profiled step]); ``gates[k]``: when the last
    rank launched bucket k, on this rank's clock (None: one rank, nobody to wait for)."""
    step = (st.end_us - st.start_us) / 1e3
    backward = (st.backward_end_us - st.backward_start_us) / 1e3
    tail = (st.tail_end_us - st.backward_end_us) / 1e3
    exposed = max(0.0, tail - st.copy_ms)
    wait = last = earlier = 0.0
    n = len(st.buckets)
    for b in st.buckets:
        mine = sum(e - s for s, e in b.exposed) / 1e3
        g = gates.get(b.index) if gates else None
        w = _clip_ms(b.exposed, float("-inf"), g) if g is not None else 0.0
        wait += w
        if b.index == n - 1:
            last += mine - w
        else:
            earlier += mine - w
    rest = exposed - wait - last - earlier  # no bucket to blame (a tail without buckets)
    last += rest
    row = {"step": step, "forward": st.forward_ms, "backward": backward,
           "exposed_comm": exposed, "wait": wait, "last_bucket": last,
           "earlier_buckets": earlier, "copy": st.copy_ms, "optimizer": st.optimizer_ms,
           "pre_forward": st.broadcast_ms, "post_forward": st.search_ms}
    row["other"] = step - sum(row[k] for k in STEP_ROWS if k != "other")
    row["compute"] = step - exposed
    return row


def gates_of(model: TraceModel) -> dict[int, dict[tuple[int, int], float]]:
    """Rank -> (step, bucket) -> when the last rank launched it, on that rank's clock."""
    if len(model.ranks) < 2:
        return {r: {} for r in model.ranks}
    common: dict[tuple[int, int], float] = {}
    count: dict[tuple[int, int], int] = {}
    for rt in model.ranks.values():
        for st in rt.steps:
            for b in st.buckets:
                key = (st.number, b.index)
                t = b.launch_us + rt.offset_us
                common[key] = max(common.get(key, t), t)
                count[key] = count.get(key, 0) + 1
    full = {k: t for k, t in common.items() if count[k] == len(model.ranks)}
    return {r: {k: t - rt.offset_us for k, t in full.items()} for r, rt in model.ranks.items()}


def kept_steps(model: TraceModel) -> tuple[list[int], list[int]]:
    """([Note: which steps a profiler trace's figures are over]) (kept, left out) numbers."""
    per_rank = [{st.number: (st.end_us - st.start_us) / 1e3 for st in rt.steps}
                for rt in model.ranks.values()]
    common = sorted(set.intersection(*(set(p) for p in per_rank)))
    if not common:
        return [], []
    step = {n: max(p[n] for p in per_rank) for n in common}
    med = statistics.median(step.values())
    mad = statistics.median(abs(v - med) for v in step.values()) * 1.4826
    bound = OUTLIER_MADS * max(mad, 0.01 * med)
    kept = [n for n in common if abs(step[n] - med) <= bound]
    return kept, [n for n in common if n not in kept]


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def rank_rows(model: TraceModel) -> tuple[dict[int, dict[int, dict[str, float]]], list[int],
                                           list[int]]:
    """Rank -> step number -> rows, over every step both kept and left out; and the kept
    and left-out step numbers."""
    gates = gates_of(model)
    kept, out = kept_steps(model)
    rows = {}
    for r, rt in model.ranks.items():
        g = gates[r]
        rows[r] = {st.number: step_rows(st, {b.index: g[(st.number, b.index)]
                                             for b in st.buckets
                                             if (st.number, b.index) in g} or None)
                   for st in rt.steps}
    return rows, kept, out


def bucket_table(model: TraceModel, kept: Sequence[int]) -> dict[int, list[dict[str, Any]]]:
    """Rank -> per bucket: index, bytes, launch_ms after the backward's start and
    exposed_ms, means over the kept steps."""
    out: dict[int, list[dict[str, Any]]] = {}
    for r, rt in model.ranks.items():
        by_index: dict[int, list[tuple[Any, float, float]]] = {}
        for st in rt.steps:
            if st.number not in kept:
                continue
            for b in st.buckets:
                by_index.setdefault(b.index, []).append(
                    (b.nbytes, (b.launch_us - st.backward_start_us) / 1e3,
                     sum(e - s for s, e in b.exposed) / 1e3))
        out[r] = [{"index": k, "bytes": v[0][0],
                   "launch_ms": _mean([x[1] for x in v]),
                   "exposed_ms": _mean([x[2] for x in v])}
                  for k, v in sorted(by_index.items())]
    return out


def straggler(model: TraceModel, rows: dict[int, dict[int, dict[str, float]]],
              parts: dict[int, dict[str, float]], kept: Sequence[int]
              ) -> tuple[dict[str, Any] | None, str]:
    """The rank the others wait for, and (when none) why none, from the same figures."""
    if len(parts) < 2:
        return None, "one rank only"
    gates = gates_of(model)
    last_launcher: dict[int, int] = {}
    for n in kept:
        when = {}
        for r, rt in model.ranks.items():
            st = next((s for s in rt.steps if s.number == n), None)
            if st is None or not st.buckets:
                continue
            when[r] = st.buckets[-1].launch_us + rt.offset_us
        if len(when) == len(parts):
            last_launcher[n] = max(when, key=lambda r: when[r])
    step = max(p["step"] for p in parts.values())
    need = max(STRAGGLER_WAIT_MS, STRAGGLER_WAIT_FRACTION * step)
    waits = {r: p["wait"] for r, p in parts.items()}
    waits_text = ", ".join(f"rank {r} {w:.2f}" for r, w in sorted(waits.items()))
    if not last_launcher or not any(gates.values()):
        return None, "no bucket all-reduce that every rank recorded, so no waiting to measure"
    counts = {r: sum(1 for v in last_launcher.values() if v == r) for r in parts}
    slow = max(counts, key=lambda r: counts[r])
    others = {r: w for r, w in waits.items() if r != slow}
    worst = max(others.values())
    if worst < need:
        return None, (f"no rank waits for another's buckets {need:.2f} ms/step or more "
                      f"(waiting for peers, ms/step: {waits_text})")
    if counts[slow] < STRAGGLER_CONSISTENCY * len(last_launcher):
        return None, (f"the ranks take turns: rank {slow} launched the last bucket last in "
                      f"only {counts[slow]} of {len(last_launcher)} steps "
                      f"(waiting for peers, ms/step: {waits_text})")
    fast = min(parts, key=lambda r: parts[r]["compute"])
    if fast == slow:
        fast = min(others, key=lambda r: parts[r]["compute"])
    candidates = ("forward", "backward", "copy", "optimizer", "other")
    part = max(candidates, key=lambda k: parts[slow][k] - parts[fast][k])
    return {"rank": slow, "fastest": fast, "excess_ms": worst,
            "compute_ms": parts[slow]["compute"], "fastest_ms": parts[fast]["compute"],
            "part": part, "part_excess_ms": parts[slow][part] - parts[fast][part],
            "last_in_steps": counts[slow], "steps": len(last_launcher),
            "waits": others}, ""


def summarise(model: TraceModel) -> tuple[dict[int, dict[str, float]], list[int], list[int],
                                          dict[int, dict[int, dict[str, float]]]]:
    """Per rank the rows' means over the kept steps, with ``steps``: how many."""
    rows, kept, out = rank_rows(model)
    parts = {}
    for r in sorted(rows):
        use = [rows[r][n] for n in kept if n in rows[r]]
        keys = list(use[0]) if use else list(STEP_ROWS) + ["step"]
        parts[r] = {k: _mean([u[k] for u in use]) for k in keys}
        parts[r]["steps"] = float(len(use))
    return parts, kept, out, rows


def explain_model(model: TraceModel) -> Explanation:
    """The explanation of a trace model: rows, buckets, straggler, findings, notes."""
    parts, kept, out, rows = summarise(model)
    if not kept:
        raise ValueError("no ProfilerStep holds a complete DDP step on every rank: profile "
                         "at least one whole training step on each rank")
    notes = list(model.notes)
    gpu = gpu_breakdown(model, kept, parts, notes)
    buckets = bucket_table(model, kept)
    s, why = straggler(model, rows, parts, kept)
    findings: list[Finding] = []
    if s is not None:
        findings.append(Finding(
            "straggler", f"rank {s['rank']} is the rank the others wait for",
            f"find what makes rank {s['rank']}'s {s['part']} slower (its data, a busier core, "
            "uneven work); balanced ranks would not wait", s["excess_ms"],
            f"rank {s['rank']} launched the last bucket last in {s['last_in_steps']} of "
            f"{s['steps']} steps; " + ", ".join(f"rank {r} waits {w:.2f} ms/step"
                                                for r, w in s["waits"].items())
            + f" for it; its {s['part']} takes {s['part_excess_ms']:+.2f} ms/step against "
            f"rank {s['fastest']} (events: the bucket all-reduces' launches, ProfilerStep)"))
    from gradring.tools.findings import profile_findings

    more, more_notes = profile_findings(model, parts, rows, kept)
    findings += more
    notes += more_notes
    findings.sort(key=lambda f: -f.saving_ms)
    first = min(parts)
    left = f"; {len(out)} step(s) left out, their time beyond {OUTLIER_MADS:g} MADs of the " \
        f"median step ({', '.join(map(str, out))})" if out else ""
    summary = (f"means over {len(kept)} ProfilerStep(s) of a torch.profiler trace of "
               f"{model.ddp}'s DDP ({model.backend or 'unknown backend'}, {model.device}){left}")
    return Explanation(sorted(parts), int(parts[first]["steps"]), parts, s, findings, notes,
                       source=model.source, ddp=model.ddp, device=model.device, gpu=gpu,
                       buckets=buckets, straggler_note=why, summary=summary)


def gpu_breakdown(model: TraceModel, kept: Sequence[int], parts: dict[int, dict[str, float]],
                  notes: list[str]) -> dict[int, dict[str, float]] | None:
    """The device's view of the kept steps, per rank (GPU traces only): compute, comm,
    exposed comm and idle ms per step, and the overlap % over the trace; adds ``idle``."""
    if model.device != "cuda":
        return None
    try:
        from gradring.tools import gpu_trace
    except ImportError:
        notes.append("this trace has GPU kernels, but this gradring has no GPU-trace reader "
                     "(gradring.tools.gpu_trace): the device's view is left out")
        return None
    out = {}
    for r, rt in model.ranks.items():
        kernels = gpu_trace.read_kernels(rt.events)
        if not kernels:
            continue
        steps = [st for st in rt.steps if st.number in kept]
        per = [gpu_trace.device_breakdown(kernels, st.start_us, st.end_us) for st in steps]
        row = {k: _mean([p[k] for p in per]) for k in
               ("compute_ms", "comm_ms", "exposed_comm_ms", "idle_ms")}
        row["overlap_pct"] = gpu_trace.overlap_pct(kernels)
        out[r] = row
    return out or None
