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
trace see [Note: the rows of a GPU step].

[Note: the rows of a GPU step]
On a trace with GPU kernels the rows are the device's timeline: a step's
window runs from its first kernel to the next step's first kernel
(``gpu_trace.step_windows``); in it, compute time (some compute kernel ran) is
split into forward, backward, copy and optimizer by the CPU phase during which
each kernel was launched (the trace's correlation ids, ``gpu_trace.phase_ms``);
exposed comm is NCCL time with no compute kernel beside it; idle is time with
no kernel; other is the rest (memory copies, and compute launched outside
the phases). They add up to the window. ``gpu`` gives the device's totals.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Sequence
from typing import Any

from gradring.tools.explain_record import STEP_ROWS, Explanation
from gradring.tools.findings import profile_findings
from gradring.tools.trace_model import Finding, StepTrace, TraceModel

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
           "pre_forward": st.broadcast_ms, "post_forward": st.search_ms,
           "unused_map": st.map_ms}
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
    waiter = max(waits, key=lambda r: waits[r])
    if waits[waiter] < need:
        return None, (f"no rank waits for another's buckets {need:.2f} ms/step or more "
                      f"(waiting for peers, ms/step: {waits_text})")
    counts = {r: sum(1 for v in last_launcher.values() if v == r) for r in parts
              if r != waiter}
    slow = max(counts, key=lambda r: counts[r])
    if counts[slow] < STRAGGLER_CONSISTENCY * len(last_launcher):
        return None, (f"rank {waiter} waits {waits[waiter]:.2f} ms/step, but not for one "
                      f"rank: rank {slow} launched the last bucket last in only "
                      f"{counts[slow]} of {len(last_launcher)} steps (waiting for peers, "
                      f"ms/step: {waits_text})")
    others = {r: w for r, w in waits.items() if r != slow}
    worst = max(others.values())
    fast = min(parts, key=lambda r: parts[r]["compute"])
    if fast == slow:
        fast = min(others, key=lambda r: parts[r]["compute"])
    candidates = ("forward", "backward", "copy", "optimizer", "other")
    part = max(candidates, key=lambda k: parts[slow][k] - parts[fast][k])
    return {"rank": slow, "fastest": fast, "excess_ms": worst,
            "compute_ms": parts[slow]["compute"], "fastest_ms": parts[fast]["compute"],
            "part": part, "part_excess_ms": parts[slow][part] - parts[fast][part],
            "last_in_steps": counts[slow], "steps": len(last_launcher),
            "waits": others,
            "text": f"rank {slow}: it launched the last bucket last in {counts[slow]} of "
                    f"{len(last_launcher)} steps; " + ", ".join(
                        f"rank {r} waits {w:.2f} ms/step" for r, w in others.items())
                    + f" for it; compute (step less exposed comm) {parts[slow]['compute']:.2f} "
                    f"ms/step against {parts[fast]['compute']:.2f} on rank {fast}, the "
                    f"largest difference in {part} ({parts[slow][part] - parts[fast][part]:+.2f}"
                    " ms)"}, ""


def summarise(model: TraceModel, last_n: int = 0
              ) -> tuple[dict[int, dict[str, float]], list[int], list[int],
                         dict[int, dict[int, dict[str, float]]]]:
    """Per rank the rows' means over the kept steps (the newest ``last_n`` of them; 0:
    all), with ``steps``: how many."""
    rows, kept, out = rank_rows(model)
    if last_n > 0:
        kept = kept[-last_n:]
    parts = {}
    for r in sorted(rows):
        use = [rows[r][n] for n in kept if n in rows[r]]
        keys = list(use[0]) if use else list(STEP_ROWS) + ["step"]
        parts[r] = {k: _mean([u[k] for u in use]) for k in keys}
        parts[r]["steps"] = float(len(use))
    return parts, kept, out, rows


def explain_model(model: TraceModel, link: dict[int, tuple[float, float]] | None = None,
                  last_n: int = 0) -> Explanation:
    """The explanation of a trace model: rows, buckets, straggler, findings, notes (over
    the newest ``last_n`` kept steps; 0: all)."""
    parts, kept, out, rows = summarise(model, last_n)
    if not kept:
        raise ValueError("no ProfilerStep holds a complete DDP step on every rank: profile "
                         "at least one whole training step on each rank")
    notes = list(model.notes)
    buckets = bucket_table(model, kept)
    gpu = gpu_breakdown(model, kept, parts, notes, buckets)
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
    more, more_notes = profile_findings(model, parts, rows, kept, link=link)
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


def _phase_at(st: StepTrace, optimizer: Sequence[tuple[float, float]]) -> Any:
    """The CPU phase of step ``st`` at a time (us): the phase a kernel launched then is of."""
    def at(t: float) -> str:
        if t < st.backward_start_us:
            return "forward" if t >= st.start_us else "other"
        if t < st.backward_end_us:
            return "backward"
        if t < st.tail_end_us:
            return "copy"
        if any(a <= t < b for a, b in optimizer):
            return "optimizer"
        return "other"
    return at


def _minus_ms(span: tuple[float, float], busy: Sequence[tuple[float, float]]) -> float:
    """ms of ``span`` not covered by the sorted, merged ``busy`` intervals."""
    a, b = span
    covered = sum(max(0.0, min(b, e) - max(a, s)) for s, e in busy if e > a and s < b)
    return max(0.0, (b - a) - covered) / 1e3


def _merged(intervals: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def gpu_breakdown(model: TraceModel, kept: Sequence[int], parts: dict[int, dict[str, float]],
                  notes: list[str], buckets: dict[int, list[dict[str, Any]]] | None = None
                  ) -> dict[int, dict[str, float]] | None:
    """The device's view of the kept steps (GPU traces only), per rank: compute, comm,
    exposed comm and idle ms per step (means) and the overlap % over the trace. It also
    puts the rows of ``parts`` on the device's timeline ([Note: the rows of a GPU step])
    and the buckets' ``exposed_ms`` there."""
    if model.device != "cuda":
        return None
    try:
        from gradring.tools import gpu_trace
    except ImportError:  # pragma: no cover - gpu_trace ships with gradring
        notes.append("this trace has GPU kernels, but this gradring has no GPU-trace reader "
                     "(gradring.tools.gpu_trace): the device's view is left out")
        return None
    out = {}
    gates = gates_of(model)
    for r, rt in model.ranks.items():
        devices = gpu_trace.by_device(gpu_trace.read_kernels(rt.events))
        if not devices:
            continue
        kernels = max(devices.values(), key=len)  # the rank's own GPU
        steps = sorted(rt.steps, key=lambda st: st.start_us)
        windows = gpu_trace.step_windows(kernels, [(st.start_us, st.end_us) for st in steps])
        owner = gpu_trace.assign_steps(kernels, [(st.start_us, st.end_us) for st in steps])
        by_step: dict[int, list[Any]] = {}
        for k, o in zip(kernels, owner):
            if o is not None:
                by_step.setdefault(o, []).append(k)
        kinds = {name: gpu_trace.kernel_kind(name) for name in {k.name for k in kernels}}
        compute_all = _merged([(k.start_us, k.start_us + k.dur_us) for k in kernels
                               if kinds[k.name] == gpu_trace.COMPUTE])
        compute_starts = [a for a, _ in compute_all]
        rows, dev = [], []
        per_bucket: dict[int, list[float]] = {}
        for i, (st, w) in enumerate(zip(steps, windows)):
            if st.number not in kept or w is None:
                continue
            mine = by_step.get(i, [])
            bd = gpu_trace.device_breakdown(kernels, w[0], w[1])
            dev.append(bd)
            compute = [k for k in mine if kinds[k.name] == gpu_trace.COMPUTE]
            share = gpu_trace.phase_ms(compute, _phase_at(st, st.optimizer_us))
            total = sum(share.values()) or 1.0
            row = {k: bd["compute_ms"] * share.get(k, 0.0) / total
                   for k in ("forward", "backward", "copy", "optimizer")}
            step = (w[1] - w[0]) / 1e3
            row["exposed_comm"] = bd["exposed_comm_ms"]
            row["idle"] = bd["idle_ms"]
            row["step"] = step
            row["other"] = step - sum(row[k] for k in ("forward", "backward", "copy",
                                                        "optimizer", "exposed_comm", "idle"))
            # the exposed comm by bucket: each bucket's all-reduce kernel is the first
            # communication kernel launched from its launch on
            lo = max(0, bisect.bisect_left(compute_starts, w[0]) - 1)
            busy = compute_all[lo:bisect.bisect_right(compute_starts, w[1])]
            comm = sorted((k for k in mine if k.is_comm and k.launch_us is not None),
                          key=lambda k: k.launch_us or 0.0)
            used: set[int] = set()
            last = earlier = 0.0
            for b in st.buckets:
                j = next((j for j, k in enumerate(comm) if j not in used
                          and (k.launch_us or 0.0) >= b.launch_us - 1), None)
                if j is None:
                    continue
                used.add(j)
                k = comm[j]
                exp = _minus_ms((max(k.start_us, w[0]), min(k.start_us + k.dur_us, w[1])),
                                busy)
                per_bucket.setdefault(b.index, []).append(exp)
                if b.index == len(st.buckets) - 1:
                    last += exp
                else:
                    earlier += exp
            # waiting for peers: NCCL's last all-reduce cannot end before the last rank
            # launched it; the fast rank's kernel spins inside that time
            wait = 0.0
            if st.buckets and gates.get(r):
                b = st.buckets[-1]
                g = gates[r].get((st.number, b.index))
                if g is not None:
                    wait = min(row["exposed_comm"], max(0.0, (g - b.launch_us) / 1e3))
            row["wait"] = wait
            row["last_bucket"] = min(max(0.0, last - wait), row["exposed_comm"] - wait)
            row["earlier_buckets"] = row["exposed_comm"] - wait - row["last_bucket"]
            row["compute"] = step - row["exposed_comm"] - row["idle"]
            rows.append(row)
        if not dev:
            continue
        res = {k: _mean([p[k] for p in dev]) for k in
               ("compute_ms", "comm_ms", "exposed_comm_ms", "idle_ms")}
        # as HTA's get_comm_comp_overlap: the kernels launched before the last
        # ProfilerStep began (the step the profiler stopped inside is left out)
        res["overlap_pct"] = gpu_trace.overlap_pct(
            gpu_trace.kernels_before(kernels, steps[-1].start_us) if len(steps) > 1
            else kernels)
        out[r] = res
        host = parts[r]
        parts[r] = {k: _mean([x[k] for x in rows]) for k in rows[0]}
        parts[r]["steps"] = float(len(rows))
        parts[r]["pre_forward"] = host.get("pre_forward", 0.0)
        parts[r]["post_forward"] = host.get("post_forward", 0.0)
        if buckets is not None:
            for b in buckets.get(r, []):
                if b["index"] in per_bucket:
                    b["exposed_ms"] = _mean(per_bucket[b["index"]])
    if out:
        notes.append("GPU trace: the rows are the device's timeline ([Note: the rows of a "
                     "GPU step]): each step's kernels from its first to the next step's "
                     "first; compute split by the CPU phase that launched each kernel, "
                     "exposed comm = NCCL kernel time with no compute kernel beside it, "
                     "idle = no kernel running; waiting for peers: the part of it before the "
                     "last rank launched the last bucket (on the CPU clocks)")
    return out or None

