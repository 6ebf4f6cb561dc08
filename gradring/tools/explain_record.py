"""``gradring.explain``: why is this DDP step slow? A measured breakdown and ranked findings.

Pure functions over what a run recorded: every rank's trace events
(observe/trace.py: the reducer's bucket marks, DDP.forward's marks, the
optimizer's) on one wall clock, plus a few facts about each rank's DDP
(``facts_of`` in observe/record.py). ``explain_ddp`` gathers them from a
live model (a collective: every rank calls it); ``load`` reads them back from traces written by
``overlap.export_chrome_trace`` / ``merge_traces``. The command line is
``gradring explain`` (tools/explain.py); docs/explain.md shows an example.

[Note: the step breakdown]
A step runs from one DDP forward's start to the next one's. Per rank, over
the steps of [Note: which steps the reports summarise] in overlap.py (the
very iterations ``ddp.overlap_stats()`` summarises), each step is cut into
rows that add up to it (``rank_steps``), in ms:

- forward          forward_start -> forward_end (buffer sync, module, graph walk);
- backward         backward_start -> backward_end (first parameter gradient to
                   the end-of-backward callback);
- exposed comm     the iteration's ``exposed_ms`` ([Note: exposed
                   communication]), in three parts that add up to it
                   (``overlap.exposed_parts``):
  - wait           the parts of the buckets' exposed runs before the
                   *slowest* rank launched that bucket: no collective can
                   finish before every rank joins it;
  - last bucket    the rest of the last bucket's exposed run (its gradients
                   are ready only when autograd ends);
  - earlier        the rest of the earlier buckets' exposed runs;
- copy into .grad  the rest of ``backward()`` after autograd: the tail less the
                   exposed communication (writing the reduced buckets into .grad);
- optimizer        every optimizer.step() between the last write into .grad
                   and the next forward;
- other            what remains of the step: the loss, zero_grad, data
                   loading, autograd before the first parameter gradient.

Every figure printed is the mean of these per-step values ([Note: which
steps the reports summarise]), so the rows add up to the step and the parts
to the exposed time in the means too; the printed rows are rounded so that
they add up as printed (``apportion``). ``gradring timeline`` cuts the same
steps into the same phases (its ``step_segments``).

[Note: how findings are measured]
Each finding is reported only when its condition holds *and* the saving it
predicts, computed from this run's numbers, is at least ``MIN_SAVING_MS``
and ``MIN_SAVING_FRACTION`` of the step (settings that cost nothing to
change when their condition holds, ``NO_TRADEOFF``: ``NO_TRADEOFF_MIN_MS``
alone). Facts worth knowing that are no finding (a cap pick inside the
run's noise, the reason for an "auto" cap) are said as notes. docs/explain.md
lists each rule.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from gradring.buckets import MIB
from gradring.observe.overlap import (
    STEADY_LAST_N,
    IterationTimes,
    exposed_parts,
    forward_starts,
    iteration_times,
    mean,
    steady_steps,
    step_bounds,
    summarize,
)
from gradring.observe.record import rank_record
from gradring.observe.trace import Event
from gradring.step_model import (
    DEFAULT_CAPS_MB,
    CommCurve,
    Prediction,
    Profile,
    simulate,
)
from gradring.tools.trace_model import MIN_SAVING_FRACTION, MIN_SAVING_MS, Finding

#: The rows of a step ([Note: the step breakdown]); they add up to ``step``.
STEP_ROWS = ("forward", "backward", "exposed_comm", "copy", "optimizer", "other")
#: The parts of ``exposed_comm``; they add up to it.
EXPOSED_ROWS = ("wait", "last_bucket", "earlier_buckets")
#: Rows printed with their own rounding: the step, and the figures overlap_stats() and
#: the demo print too; the others are rounded to add up to them (``apportion``).
PINNED_ROWS = ("step", "backward", "exposed_comm")
TABLE_ROWS = (("forward", "forward"), ("backward", "backward"),
              ("exposed_comm", "exposed comm"), ("wait", "  wait (peers)"),
              ("last_bucket", "  last bucket"), ("earlier_buckets", "  earlier buckets"),
              ("copy", "copy into .grad"), ("optimizer", "optimizer"), ("other", "other"),
              ("step", "step"))
#: A finding's predicted saving must reach both of these to be reported ...
#: ... except for settings whose change costs no step time (pure overhead when the
#: condition holds): for them NO_TRADEOFF_MIN_MS alone is the bar.
NO_TRADEOFF = ("find_unused", "forward_sync_buffers", "bucket_view")
NO_TRADEOFF_MIN_MS = 0.25
#: Buckets up to this size measure the per-bucket cost in the run itself.
SMALL_BUCKET_BYTES = 64 * 1024
#: A straggler is a rank whose compute exceeds the fastest rank's by this much (and 2 ms).
STRAGGLER_FRACTION = 0.25
STRAGGLER_MS = 2.0
STRAGGLER_CONSISTENCY = 0.8
#: "Far" from the step model's pick: a factor of at least this.
CAP_FACTOR = 4.0


class RankStep(NamedTuple):
    """One step of one rank ([Note: the step breakdown]); all ms. ``forward``,
    ``backward``, ``exposed_comm``, ``copy``, ``optimizer`` and ``other`` add up to
    ``step``; ``wait``, ``last_bucket`` and ``earlier_buckets`` to ``exposed_comm``."""

    iteration: int
    step: float
    forward: float
    pre_forward: float   # forward_start -> module_start: buffer broadcast, rebuild check
    post_forward: float  # module_end -> forward_end: find_unused's graph walk
    backward: float
    exposed_comm: float
    wait: float
    last_bucket: float
    earlier_buckets: float
    copy: float          # tail after the exposed communication: copying results into .grad
    optimizer: float
    other: float


@dataclass
class Explanation:
    """What ``explain`` found: per-rank means, the straggler, ranked findings."""

    ranks: list[int]
    steps: int                                # steps summarised on the first rank
    parts: dict[int, dict[str, float]]        # rank -> row (RankStep fields, steps, ...) -> ms
    straggler: dict[str, Any] | None
    findings: list[Finding]
    notes: list[str] = field(default_factory=list)
    source: str = "gradring"                  # "torch.profiler" | "gradring"
    ddp: str = "gradring"                     # "torch" | "gradring": whichever ran
    device: str = "cpu"                       # "cpu" | "cuda"
    gpu: dict[int, dict[str, float]] | None = None   # rank -> device breakdown (GPU traces)
    buckets: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    straggler_note: str = ""                  # why no rank is named, in words
    summary: str = ""                         # which steps the figures are over, in words

    @property
    def text(self) -> str:
        return format_explanation(self)

    def __str__(self) -> str:
        return self.text

    def keys(self) -> list[str]:
        return [f.key for f in self.findings]

    def as_json(self) -> dict[str, Any]:
        """What ``gradring explain --json`` prints: the same figures as the text."""
        return {"ranks": self.ranks, "steps": self.steps,
                "parts": {str(r): v for r, v in self.parts.items()},
                "straggler": self.straggler,
                "findings": [f._asdict() for f in self.findings], "notes": self.notes,
                "source": self.source, "ddp": self.ddp, "device": self.device,
                **({"gpu": {str(r): v for r, v in self.gpu.items()}} if self.gpu else {}),
                "buckets": {str(r): v for r, v in self.buckets.items()}}


# ------------------------------------------------------------------ per-rank steps
def _sorted_times(events: Sequence[Event], kind: str) -> list[float]:
    return sorted(e.t for e in events if e.kind == kind)


def _first_after(times: Sequence[float], t: float, before: float = float("inf")) -> float | None:
    for x in times:
        if t <= x <= before:
            return x
    return None


def _last_before(times: Sequence[float], t: float) -> float | None:
    out = None
    for x in times:
        if x > t:
            break
        out = x
    return out


def bucket_launches(events: Sequence[Event]) -> dict[tuple[int, int], float]:
    """(iteration, bucket) -> absolute time this rank launched that bucket."""
    return {(it.iteration, b.bucket): it.t0 + b.launch / 1e3
            for it in iteration_times(events) for b in it.buckets}


def launched_by_all(records: Sequence[dict[str, Any]],
                    events: dict[int, list[Event]]) -> dict[int, dict[tuple[int, int], float]]:
    """Rank -> (iteration, bucket) -> when the slowest rank launched that bucket, on that
    rank's own clock (the ranks' times are put on the wall clock with their offsets to
    compare them). Empty with one rank: nobody to wait for."""
    offset = {r["rank"]: float(r.get("clock_offset", 0.0)) for r in records}
    if len(events) < 2:
        return {rank: {} for rank in events}
    wall: dict[tuple[int, int], float] = {}
    for rank, evs in events.items():
        for key, t in bucket_launches(evs).items():
            wall[key] = max(wall.get(key, t + offset[rank]), t + offset[rank])
    return {rank: {k: g - offset[rank] for k, g in wall.items()} for rank in events}


def _gates_ms(it: IterationTimes, gates: dict[tuple[int, int], float] | None
              ) -> dict[int, float]:
    """``gates`` for one iteration, in ms after its backward_start."""
    if not gates:
        return {}
    return {b.bucket: (g - it.t0) * 1e3 for b in it.buckets
            if (g := gates.get((it.iteration, b.bucket))) is not None}


def rank_steps(events: Sequence[Event], gates: dict[tuple[int, int], float] | None = None,
               last_n: int = STEADY_LAST_N) -> list[RankStep]:
    """The steps of one rank's events ([Note: the step breakdown]): one per iteration of
    ``overlap.steady_steps(events, last_n)``. ``gates[(it, bucket)]``: when the slowest
    rank launched that bucket (this rank's clock; ``launched_by_all``); None: this rank
    alone, no waiting known."""
    fwd = forward_starts(events)
    mod_s, mod_e = _sorted_times(events, "module_start"), _sorted_times(events, "module_end")
    fwd_e = _sorted_times(events, "forward_end")
    opt_s, opt_e = _sorted_times(events, "optimizer_start"), _sorted_times(events, "optimizer_end")
    out = []
    for it in steady_steps(events, last_n):
        bounds = step_bounds(it, fwd)
        if bounds is None:
            continue  # a trace without DDP.forward's marks: no step to cut
        f0, f1 = bounds
        t0, written = it.t0, it.end
        # DDP.forward marks all four; a mark evicted from the ring buffer counts as zero
        fe = _first_after(fwd_e, f0, t0) or f0
        ms0 = _first_after(mod_s, f0, fe) or f0
        me = _first_after(mod_e, ms0, fe) or fe
        opt = 0.0
        for s in opt_s:
            if written <= s < f1:
                e = _first_after(opt_e, s, f1)
                if e is not None:
                    opt += (e - s) * 1e3
        step = (f1 - f0) * 1e3
        forward = (fe - f0) * 1e3
        exposed = it.exposed_ms
        wait, last, earlier = exposed_parts(it, _gates_ms(it, gates))
        copy = max(0.0, it.tail_ms - exposed)
        other = step - forward - it.backward_ms - exposed - copy - opt
        out.append(RankStep(it.iteration, step, forward, (ms0 - f0) * 1e3, (fe - me) * 1e3,
                            it.backward_ms, exposed, wait, last, earlier, copy, opt, other))
    return out


def _means(steps: Sequence[RankStep]) -> dict[str, float]:
    """Each row's mean over ``steps``; ``compute`` is the step less its exposed comm."""
    out = {k: mean([getattr(s, k) for s in steps]) for k in RankStep._fields
           if k != "iteration"}
    out["compute"] = mean([_compute(s) for s in steps])
    out["steps"] = float(len(steps))
    return out


def apportion(total: float, parts: Sequence[float], decimals: int = 2) -> list[float]:
    """``parts`` rounded to ``decimals`` so that they add up to ``total`` rounded (largest
    remainders get the spare units): a printed breakdown that adds up as printed."""
    unit = 10 ** decimals
    goal = round(float(f"{total:.{decimals}f}") * unit)  # the total as it is printed
    floors = [math.floor(p * unit) for p in parts]
    spare = goal - sum(floors)
    # largest remainders first take a spare unit; smallest first give one back
    order = sorted(range(len(parts)), key=lambda i: floors[i] - parts[i] * unit)
    if spare < 0:
        order.reverse()
    for k in range(abs(spare)):
        floors[order[k % len(order)]] += 1 if spare > 0 else -1
    return [f / unit for f in floors]


# ------------------------------------------------------------------ analysis
def record_events(records: Sequence[dict[str, Any]]) -> dict[int, list[Event]]:
    """Rank -> its events, on its own clock (add ``record["clock_offset"]`` for the wall
    clock; records written before it existed hold wall-clock times and no offset)."""
    return {r["rank"]: [Event(int(a), str(b), int(c), float(d)) for a, b, c, d in r["events"]]
            for r in records}


def all_rank_steps(records: Sequence[dict[str, Any]], last_n: int = STEADY_LAST_N
                   ) -> dict[int, list[RankStep]]:
    """Rank -> its steps ([Note: the step breakdown]), waiting for peers measured against
    every rank's launches: what explain and ``gradring timeline`` both summarise."""
    events = record_events(records)
    gates = launched_by_all(records, events)
    return {rank: rank_steps(evs, gates[rank] or None, last_n) for rank, evs in events.items()}


def analyse(records: Sequence[dict[str, Any]], last_n: int = STEADY_LAST_N) -> Explanation:
    """Explain a run from every rank's ``rank_record`` (or what ``load`` read back):
    means over each rank's newest ``last_n`` steady steps (0: all of them), the steps
    ``overlap_stats(last_n)`` summarises."""
    if not records:
        raise ValueError("explain needs at least one rank's record")
    records = sorted(records, key=lambda r: r["rank"])
    events = record_events(records)
    chosen = all_rank_steps(records, last_n)
    empty = [rank for rank, steps in chosen.items() if not steps]
    if empty:
        raise ValueError(f"the record of rank {empty[0]} holds no complete DDP step (a step "
                         "needs its forward, backward and the next forward): train at least "
                         "3 steps")
    parts = {rank: _means(v) for rank, v in chosen.items()}
    facts = records[0]["facts"]
    curve_doc = next((r.get("curve") for r in records if r.get("curve")), None)
    curve = CommCurve(curve_doc["sizes"], curve_doc["times_ms"]) if curve_doc else None
    straggler = _straggler(parts, chosen)
    first = records[0]["rank"]
    findings, notes = _findings(parts, facts, events[first], last_n, curve, chosen[first])
    if straggler is not None and straggler["excess_ms"] > 0:
        findings.append(Finding(
            "straggler", f"rank {straggler['rank']} is slower than the others",
            f"find what makes rank {straggler['rank']}'s {straggler['part']} slower (its data, "
            "a busier core, uneven work); balanced ranks would not wait",
            straggler["excess_ms"],
            f"its compute takes {straggler['compute_ms']:.2f} ms/step against "
            f"{straggler['fastest_ms']:.2f} ms on rank {straggler['fastest']}; "
            f"the biggest difference is in {straggler['part']} "
            f"(+{straggler['part_excess_ms']:.2f} ms)"))
    step = max(p["step"] for p in parts.values())
    findings = [f for f in findings if _worth(f.saving_ms, step)
                or (f.key in NO_TRADEOFF and f.saving_ms >= NO_TRADEOFF_MIN_MS)]
    findings.sort(key=lambda f: -f.saving_ms)
    if curve is None:
        notes.append("no all-reduce curve was measured on this link: the bucket-size "
                     "findings use this run's own bucket timings, and the comm hook is not "
                     "judged")
    if facts.get("auto_cap_why"):
        notes.append(str(facts["auto_cap_why"]))
    return Explanation(sorted(parts), len(chosen[first]), parts, straggler, findings, notes,
                       device="cuda" if str(facts.get("device", "cpu")).startswith("cuda")
                       else "cpu",
                       buckets={r["rank"]: _bucket_rows(events[r["rank"]], last_n, r["facts"])
                                for r in records},
                       straggler_note=straggler_note(parts, chosen))


def _worth(saving: float, step: float) -> bool:
    return saving >= max(MIN_SAVING_MS, MIN_SAVING_FRACTION * step)


def _compute(s: RankStep) -> float:
    return s.step - s.exposed_comm


def _straggler(parts: dict[int, dict[str, float]],
               steps: dict[int, list[RankStep]]) -> dict[str, Any] | None:
    """The slowest rank, if its mean compute exceeds the fastest's by STRAGGLER_MS and
    STRAGGLER_FRACTION *and* it was the slower of the two in STRAGGLER_CONSISTENCY of the
    steps both ranks recorded: a rank that is slow all the time, not one the OS
    descheduled now and then."""
    if len(parts) < 2:
        return None
    slow = max(parts, key=lambda r: parts[r]["compute"])
    fast = min(parts, key=lambda r: parts[r]["compute"])
    excess = parts[slow]["compute"] - parts[fast]["compute"]
    if excess < max(STRAGGLER_MS, STRAGGLER_FRACTION * parts[fast]["compute"]):
        return None
    fast_by_it = {s.iteration: s for s in steps[fast]}
    pairs = [(a, fast_by_it[a.iteration]) for a in steps[slow] if a.iteration in fast_by_it]
    slower = sum(_compute(a) > _compute(b) for a, b in pairs)
    if not pairs or slower < STRAGGLER_CONSISTENCY * len(pairs):
        return None
    candidates = ("forward", "backward", "copy", "optimizer", "other")
    part = max(candidates, key=lambda k: parts[slow][k] - parts[fast][k])
    return {"rank": slow, "fastest": fast, "excess_ms": excess,
            "compute_ms": parts[slow]["compute"], "fastest_ms": parts[fast]["compute"],
            "part": part, "part_excess_ms": parts[slow][part] - parts[fast][part],
            "waits": {r: p["wait"] for r, p in parts.items() if r != slow}}


def straggler_note(parts: dict[int, dict[str, float]],
                   steps: dict[int, list[RankStep]]) -> str:
    """Why no rank is named a straggler, from the same figures ``_straggler`` judged."""
    if len(parts) < 2:
        return "one rank only"
    slow = max(parts, key=lambda r: parts[r]["compute"])
    fast = min(parts, key=lambda r: parts[r]["compute"])
    a, b = parts[fast]["compute"], parts[slow]["compute"]
    need = max(STRAGGLER_MS, STRAGGLER_FRACTION * a)
    text = (f"compute {a:.2f} ms/step on rank {fast} to {b:.2f} on rank {slow}, "
            f"{b - a:.2f} ms apart")
    if b - a < need:
        return text + f", under the {need:.2f} ms a straggler needs " \
            f"({STRAGGLER_MS:g} ms and {STRAGGLER_FRACTION:.0%})"
    fast_by_it = {s.iteration: s for s in steps[fast]}
    pairs = [(x, fast_by_it[x.iteration]) for x in steps[slow] if x.iteration in fast_by_it]
    slower = sum(_compute(x) > _compute(y) for x, y in pairs)
    return text + f", but rank {slow} was the slower in only {slower} of {len(pairs)} steps " \
        f"(a straggler is slower in {STRAGGLER_CONSISTENCY:.0%} of them)"


def _bucket_rows(events: Sequence[Event], last_n: int, facts: dict[str, Any]
                 ) -> list[dict[str, Any]]:
    """``--json``'s ``buckets`` of one rank: index, bytes, launch_ms (after the backward's
    start) and exposed_ms, means over the summarised steps."""
    table = summarize(steady_steps(events, last_n), (), 0)["buckets"]
    sizes = facts.get("bucket_bytes") or []
    return [{"index": b["bucket"],
             "bytes": sizes[b["bucket"]] if b["bucket"] < len(sizes) else None,
             "launch_ms": b["ready_ms"] + b["ready_to_launch_ms"], "exposed_ms": b["exposed_ms"]}
            for b in table]


def _bucket_stats(events: Sequence[Event], last_n: int) -> list[dict[str, float]]:
    """Per bucket: mean ready (ms after backward start), run and exposed ms over the
    summarised steps (``overlap.summarize``'s table, the figures overlap_stats() gives)."""
    table = summarize(steady_steps(events, last_n), (), 0)["buckets"]
    return [{"bucket": b["bucket"], "ready": b["ready_ms"], "run": b["run_ms"],
             "exposed": b["exposed_ms"]} for b in table]


def _profile(facts: dict[str, Any], buckets: list[dict[str, float]],
             backward_ms: float, step_ms: float) -> Profile:
    """Per-parameter ready times, interpolated inside each bucket by cumulative bytes
    between the previous bucket's ready time and its own (only bucket times are traced)."""
    sizes = facts["sizes"]
    ready = [0.0] * len(sizes)
    prev = 0.0
    for b in buckets:
        idx = facts["bucket_params"][b["bucket"]]
        total = sum(sizes[i] for i in idx) or 1
        acc = 0
        for i in idx:
            acc += sizes[i]
            ready[i] = prev + (b["ready"] - prev) * acc / total
        prev = max(prev, b["ready"])
    return Profile(facts["names"], sizes, facts["keys"], ready, backward_ms, step_ms)


def _run_curve(facts: dict[str, Any], buckets: list[dict[str, float]]) -> CommCurve:
    """A curve from this run's own bucket collectives (size -> mean run ms)."""
    points = sorted({facts["bucket_bytes"][b["bucket"]]: max(b["run"], 1e-3)
                     for b in buckets}.items())
    return CommCurve([s for s, _ in points], [t for _, t in points])


def _findings(parts: dict[int, dict[str, float]], facts: dict[str, Any],
              events: Sequence[Event], last_n: int,
              curve: CommCurve | None, steps: Sequence[RankStep] = ()
              ) -> tuple[list[Finding], list[str]]:
    """Every finding whose condition holds (``analyse`` applies the saving bar), and the
    notes: facts that are no finding."""
    p = parts[min(parts)]
    out: list[Finding] = []
    notes: list[str] = []
    if facts["find_unused"] and facts["unused_last"] == 0:
        bitmap = curve.time_ms(4 * len(facts["sizes"])) if curve is not None else 0.0
        out.append(Finding(
            "find_unused", "find_unused_parameters=True, but no parameter was unused",
            "construct DDP with find_unused_parameters=False (or static_graph=True if the "
            "graph never changes)", p["post_forward"] + bitmap,
            f"the graph walk after each forward takes {p['post_forward']:.2f} ms/step "
            f"(module_end -> forward_end); the used-parameter map's extra all-reduce "
            + (f"{bitmap:.2f} ms on this link" if curve is not None else "was not timed")))
    buffers = facts["buffers"]
    if facts["sync_buffers"] and buffers and facts["num_forward"] >= 4:
        written = [n for n, _, v in buffers if v >= max(1, facts["num_forward"] // 2)]
        if not written:
            nbytes = sum(b for _, b, _ in buffers)
            out.append(Finding(
                "forward_sync_buffers",
                "buffers are broadcast before every forward but never change",
                "construct DDP with forward_sync_buffers=False (the buffers are still "
                "broadcast once, when DDP is constructed)", p["pre_forward"],
                f"{len(buffers)} buffer(s), {nbytes / 1024:.1f} KiB, were not written in place on "
                f"rank {facts['rank']} in {facts['num_forward']} forwards; syncing them takes "
                f"{p['pre_forward']:.2f} ms/step (forward_start -> module_start)"))
    if not facts["bucket_view"] and p["copy"] > 0:
        mib = facts["grad_bytes_outside_buckets"] / MIB
        out.append(Finding(
            "bucket_view", "reduced gradients are copied into .grad after every backward",
            "construct DDP with gradient_as_bucket_view=True (.grad becomes a view of its "
            "bucket; it cannot be detached in place)", p["copy"],
            f"after the last collective, backward() spends {p['copy']:.2f} ms/step writing "
            f"results into .grad (the copy into .grad row); {mib:.1f} MiB of gradients live "
            "outside the buckets"))
    buckets = _bucket_stats(events, last_n)
    if buckets and facts["bucket_params"]:
        measured = curve is not None
        use = curve if curve is not None else _run_curve(facts, buckets)
        profile = _profile(facts, buckets, p["backward"], max(p["compute"], p["backward"]))
        # What one collective costs: its fixed part, as small buckets ran in this very run
        # (under the backward's contention); else the smallest all-reduce on the curve.
        small = [b["run"] for b in buckets
                 if facts["bucket_bytes"][b["bucket"]] <= SMALL_BUCKET_BYTES]
        per_bucket = (mean(small), "mean run of this run's small buckets") \
            if small else (use.times_ms[0], "smallest all-reduce")
        # The last bucket's exposure is clearest on the rank that waited least for others.
        p_last = max(parts.values(), key=lambda q: q["last_bucket"])
        out += _fitted_cap_finding(facts, events, last_n, steps, notes)
        out += _cap_findings(p, p_last, facts, profile, use, measured, per_bucket)
        keyed = {f.key: f for f in out}
        if "bucket_cap" in keyed and "last_bucket" in keyed and \
                keyed["bucket_cap"].change.split("=")[-1] == \
                keyed["last_bucket"].change.split("=")[-1].split(":")[0]:
            worse = min((keyed["bucket_cap"], keyed["last_bucket"]),
                        key=lambda f: f.saving_ms)
            out = [f for f in out if f is not worse]  # one change, said once
        if facts["comm_hook"] and curve is not None:
            hook = sum(b["run"] for b in buckets)
            plain = sum(curve.time_ms(facts["bucket_bytes"][b["bucket"]]) for b in buckets)
            out.append(Finding(
                "comm_hook", f"the comm hook {facts['comm_hook']} costs more than it saves",
                "remove register_comm_hook (plain all-reduce) or use a cheaper hook",
                hook - plain,
                f"its {len(buckets)} bucket(s) take {hook:.2f} ms/step from start to done; "
                f"plain all-reduces of the same bytes measured {plain:.2f} ms on this link"))
    return out, notes


def _cap_findings(p: dict[str, float], p_last: dict[str, float], facts: dict[str, Any],
                  profile: Profile,
                  curve: CommCurve, measured: bool,
                  per_bucket: tuple[float, str]) -> list[Finding]:
    cur_mb = facts["bucket_cap_bytes"] / MIB
    c, c_source = per_bucket
    caps = sorted(set(DEFAULT_CAPS_MB) | {cur_mb})
    preds = {cap: simulate(profile, curve, cap, per_bucket_ms=c) for cap in caps}
    cur = preds[cur_mb]
    source = "all-reduce times measured on this link" if measured else \
        "this run's own bucket timings"
    out = []
    last_bytes = facts["bucket_bytes"][-1]
    exposed = p_last["earlier_buckets"] + p_last["last_bucket"]
    if p_last["last_bucket"] > 0 and p_last["last_bucket"] >= 0.5 * exposed:
        options: list[tuple[float, Prediction]] = []
        for cap, q in preds.items():
            if cap >= cur_mb or not q.buckets:
                continue
            q_last = sum(profile.sizes[i] for i in q.buckets[-1])
            if q_last * 2 > last_bytes:
                continue
            saving = p_last["last_bucket"] * (1 - q_last / last_bytes) \
                - c * (len(q.buckets) - len(cur.buckets))
            options.append((saving, q))
        if options:
            saving, q = max(options, key=lambda o: o[0])
            q_last = sum(profile.sizes[i] for i in q.buckets[-1])
            out.append(Finding(
                "last_bucket", "the last bucket dominates the exposed communication",
                f"construct DDP with bucket_cap_mb={q.cap_mb:g}: the last bucket shrinks from "
                f"{last_bytes / MIB:.2f} to {q_last / MIB:.2f} MiB", saving,
                f"the last bucket's all-reduce left {p_last['last_bucket']:.2f} of "
                f"{exposed:.2f} ms/step exposed (waiting for peers left out); saving = its "
                f"share of the bytes removed, minus {c:.2f} ms for each extra bucket (the "
                f"{c_source}; {source})"))
    return out


def _fitted_cap_finding(facts: dict[str, Any], events: Sequence[Event], last_n: int,
                        steps: Sequence[RankStep], notes: list[str]) -> list[Finding]:
    """The bucket-cap finding from the step model fitted to this run ([Note: the fitted
    step model] in tools/findings.py), by the rule auto and tune pick with; given only
    when the cap is far from the run's (``CAP_FACTOR``) and the saving is outside the
    spread of the measured steps (else a note says the run is too noisy to tell)."""
    from gradring.tools import findings
    from gradring.tools.read_record import record_model

    rank = int(facts["rank"])
    step_ms = {s.iteration: s.step for s in steps}
    model = record_model(rank, steady_steps(events, last_n), facts, step_ms)
    rows = {s.iteration: s._asdict() for s in steps}
    kept = [s.iteration for s in steps]
    fit = findings.fit_rank(model, rank, kept, rows)
    if isinstance(fit, str):
        notes.append(f"the step model could not be fitted to this run: {fit}; no bucket-cap "
                     "finding")
        return []
    cur_mb = facts["bucket_cap_bytes"] / MIB
    rec = findings.recommend_cap(fit, "gradring")
    if rec is None:
        return []
    best, why = rec
    saving = fit.current.step_ms - best.step_ms
    ratio = max(best.cap_mb / cur_mb, cur_mb / best.cap_mb)
    if ratio < CAP_FACTOR:
        return []
    spread = findings.spread_ms([s.step for s in steps])
    finding = Finding(
        "bucket_cap", f"bucket_cap_mb={cur_mb:.3g} is far from the step model's pick",
        f"construct DDP with bucket_cap_mb={best.cap_mb:g}", saving,
        f"step model fitted to this run ({fit.how}): it reproduces the measured "
        f"{fit.measured_step_ms:.2f} ms/step with the run's {len(fit.groups)} bucket(s) and "
        f"predicts {best.step_ms:.2f} at {best.cap_mb:g} MiB ({len(best.buckets)} "
        f"bucket(s)); the cap bucket_cap_mb='auto' and gradring tune pick by the same rule: "
        f"{why}")
    if saving <= spread:
        notes.append(f"{finding.title}: {finding.change} would save {saving:.2f} ms/step by "
                     f"the fitted model, inside the {spread:.2f} ms spread of the measured "
                     "steps (interquartile range): the run is too noisy to tell")
        return []
    return [finding]


# ------------------------------------------------------------------ text
def format_explanation(x: Explanation) -> str:
    ranks = x.ranks
    counts = [int(x.parts[r]["steps"]) for r in ranks]
    over = f"{counts[0]} step(s)" if len(set(counts)) == 1 else \
        "/".join(map(str, counts)) + " step(s) on rank " + "/".join(map(str, ranks))
    head = x.summary or (f"means over {over} (the steps overlap_stats() summarises)")
    lines = [f"gradring explain: {len(ranks)} rank(s), {head}",
             f"{'ms per step':<17}" + "".join(f"{'rank ' + str(r):>16}" for r in ranks)]
    shown: dict[int, dict[str, float]] = {}
    for r in ranks:
        part = x.parts[r]
        # the totals and the rows other reports print too (overlap_stats()' exposed
        # comm and backward) keep their own rounding; the other rows are rounded to
        # add up to them as printed
        row = {k: float(f"{part[k]:.2f}") for k in PINNED_ROWS}
        rest = [k for k in STEP_ROWS if k not in PINNED_ROWS] + \
            (["idle"] if "idle" in part else [])
        row.update(zip(rest, apportion(row["step"] - sum(row[k] for k in PINNED_ROWS
                                                         if k != "step"),
                                       [part[k] for k in rest])))
        row.update(zip(EXPOSED_ROWS, apportion(row["exposed_comm"],
                                               [part[k] for k in EXPOSED_ROWS])))
        shown[r] = row
    rows = TABLE_ROWS + ((("idle", "idle (GPU)"),) if any("idle" in x.parts[r] for r in ranks)
                         else ())
    rows = tuple(sorted(rows, key=lambda kv: kv[0] == "step"))
    for key, label in rows:
        line = f"{label:<17}"
        for r in ranks:
            v, s = shown[r][key], x.parts[r]["step"]
            line += f"{v:>9.2f} {x.parts[r][key] / s:>5.0%}" if key != "step" and s > 0 \
                else f"{v:>9.2f}      "
        lines.append(line)
    lines.append("(rows add up to the step, the indented ones to exposed comm; exposed comm: "
                 + ("collectives still running after the backward, the same figure as "
                    "overlap_stats(), the demo and gradring timeline; "
                    if x.source == "gradring" else
                    "NCCL kernel time with no compute kernel beside it; " if "idle" in
                    x.parts[ranks[0]] else
                    "the wait for collectives after autograd, less the copies; ")
                 + "forward includes buffer sync and the graph walk; other: loss, zero_grad, "
                 "data" + ("; idle: no kernel on the GPU" if "idle" in x.parts[ranks[0]]
                           else "") + ")")
    s = x.straggler
    if s is None:
        lines.append(f"stragglers: none ({x.straggler_note})" if x.straggler_note and
                     len(ranks) > 1 else "stragglers: one rank only" if len(ranks) < 2 else
                     "stragglers: none")
    elif "text" in s:
        lines.append(f"stragglers: {s['text']}")
    else:
        waits = ", ".join(f"rank {r} waits {w:.2f} ms" for r, w in s["waits"].items())
        lines.append(f"stragglers: rank {s['rank']} is slower by {s['excess_ms']:.2f} ms/step "
                     f"({s['excess_ms'] / max(s['fastest_ms'], 1e-9):.0%} more compute than "
                     f"rank {s['fastest']}), mostly in {s['part']}; {waits} for it")
    if not x.findings:
        lines.append(f"findings: none saves at least {MIN_SAVING_MS} ms and "
                     f"{MIN_SAVING_FRACTION:.0%} of the step")
    else:
        lines.append("findings, by measured cost:")
    step = max(p["step"] for p in x.parts.values())
    for k, f in enumerate(x.findings, 1):
        lines.append(f"{k}. {f.title}: expected saving {f.saving_ms:.2f} ms/step "
                     f"({f.saving_ms / step:.0%})")
        lines.append(f"   change: {f.change}")
        lines.append(f"   measured: {f.evidence}")
    lines += [f"note: {n}" for n in x.notes]
    return "\n".join(lines)


# ------------------------------------------------------------------ entry points
def measure_link(ddp: Any) -> CommCurve:
    """All-reduce time against size on ``ddp``'s group, up to its gradients' size
    (``link_curve.measure_allreduce``). Collective: every rank calls it."""
    from gradring.link_curve import curve_sizes, measure_allreduce

    total = sum(p.numel() * p.element_size() for p in ddp.reducer.params)
    return measure_allreduce(ddp.comm, curve_sizes(total))


def explain_ddp(ddp: Any, *, last_n: int = STEADY_LAST_N, measure: bool = True) -> Explanation:
    """Explain a live gradring DDP model. Collective: call it on every rank at the same
    point (it gathers every rank's trace and, with ``measure``, times a few
    all-reduces on the model's group). Every rank gets the same answer."""
    curve = measure_link(ddp) if measure else None
    records = ddp.comm.all_gather_object(rank_record(ddp, curve))
    return analyse(records, last_n=last_n)


def records_of(docs: Sequence[tuple[str, Any]]) -> list[dict[str, Any]]:
    """Every rank's record in parsed trace files ((path, doc) each); [] when none holds
    gradring's record (torch.profiler traces are read by tools/read_profiler.py)."""
    records: dict[int, dict[str, Any]] = {}
    for p, doc in docs:
        if isinstance(doc, dict) and "entries" in doc and "traceEvents" not in doc:
            raise ValueError(f"{p} is a flight-recorder dump, which holds collectives but no "
                             "step timings: read it with `gradring flight`; for explain, save "
                             "traces with gradring.observe.overlap.export_chrome_trace or "
                             "torch.profiler")
        other = doc.get("otherData", {}) if isinstance(doc, dict) else {}
        got = other.get("gradring_explain") if isinstance(other, dict) else None
        if got is None:
            continue
        for rec in got if isinstance(got, list) else [got]:
            records[rec["rank"]] = rec
    return [records[r] for r in sorted(records)]


def load(path: str, *, max_bytes: int | None = None) -> list[dict[str, Any]]:
    """Every rank's record from a merged trace, one rank's trace, or a folder of them."""
    from gradring.tools.trace_file import read_json, trace_files

    records: dict[int, dict[str, Any]] = {}
    for p in trace_files(path):
        doc = read_json(p, max_bytes=max_bytes)
        if isinstance(doc, dict) and "entries" in doc and "traceEvents" not in doc:
            raise ValueError(f"{p} is a flight-recorder dump, which holds collectives but no "
                             "step timings: read it with `gradring flight`; for explain, save "
                             "traces with gradring.observe.overlap.export_chrome_trace")
        other = doc.get("otherData", {}) if isinstance(doc, dict) else {}
        got = other.get("gradring_explain")
        if got is None:
            continue
        for rec in got if isinstance(got, list) else [got]:
            records[rec["rank"]] = rec
    if not records:
        raise ValueError(f"{path}: no gradring step record (write traces with "
                         "gradring.observe.overlap.export_chrome_trace and merge_traces)")
    return [records[r] for r in sorted(records)]
