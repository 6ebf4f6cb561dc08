"""``gradring.explain``: why is this DDP step slow? A measured breakdown and ranked findings.

Pure functions over what a run recorded: every rank's trace events
(observe/trace.py: the reducer's bucket marks, DDP.forward's marks, the
optimizer's) on one wall clock, plus a few facts about each rank's DDP
(``facts_of`` in observe/record.py). ``explain_ddp`` gathers them from a
live model (a collective: every rank calls it); ``load`` reads them back from traces written by
``overlap.export_chrome_trace`` / ``merge_traces``. The command line is
``gradring explain`` (tools/explain.py); docs/explain.md shows an example.

[Note: the step breakdown]
A step runs from one DDP forward's start to the next one's. Per rank and
step, in ms (medians over the steady steps: iteration 0 and steps before the
newest bucket layout left out, as ``overlap.steady_iterations`` does):

- forward     forward_start -> forward_end (buffer sync, module, graph walk);
- backward    backward_start -> backward_end (first parameter gradient to
              the end-of-backward callback);
- exposed comm (the row, "exposed_total") the one figure of [Note: exposed
              communication] in overlap.py: the median of the per-iteration
              exposed time over the steady iterations, as overlap_stats(),
              the demo and the timeline report it. The three parts below are
              medians of their own and need not add up to it;
- wait        the part of the exposed communication (backward_end -> last
              collective done) before the *slowest* rank launched its last
              bucket: no collective can finish before every rank joins it.
              When every bucket was reduced after the backward (no core for
              the comm thread), the buckets run one after the other and the
              wait is counted bucket by bucket: the part of each bucket's
              collective before the slowest rank launched that bucket;
- last bucket the rest of the exposed time spent in the last bucket's own
              collective (its gradients are ready only when autograd ends);
- exposed     the rest: earlier buckets' collectives still running after
              the backward;
- optimizer   every optimizer.step() between the last write into .grad
              and the next forward;
- other       what remains: the loss, zero_grad, data loading, copying the
              reduced buckets into .grad (``write``, also reported alone).

[Note: how findings are measured]
Each finding is reported only when its condition holds *and* the saving it
predicts, computed from this run's numbers, is at least ``MIN_SAVING_MS``
and ``MIN_SAVING_FRACTION`` of the step. docs/explain.md lists each rule.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from gradring.buckets import MIB
from gradring.observe.overlap import (
    STEADY_LAST_N,
    IterationTimes,
    exposed_comm,
    iteration_times,
    recent,
)
from gradring.observe.record import rank_record
from gradring.observe.trace import Event
from gradring.step_model import DEFAULT_CAPS_MB, CommCurve, Prediction, Profile, choose, simulate

PARTS = ("forward", "backward", "exposed", "last_bucket", "wait", "optimizer", "other")
LABELS = {"forward": "forward", "backward": "backward", "exposed": "exposed comm",
          "last_bucket": "last bucket", "wait": "wait (peers)", "optimizer": "optimizer",
          "other": "other"}
#: The printed breakdown: the exposed communication is one row (the same figure
#: as ``overlap_stats()['exposed_ms']`` per step), then the three parts it is
#: made of, indented; the unindented rows add up to the step.
EXPOSED_PARTS = ("wait", "last_bucket", "exposed")
UNINDENTED = ("forward", "backward", "exposed_total", "optimizer")
TABLE_ROWS = (("forward", "forward"), ("backward", "backward"),
              ("exposed_total", "exposed comm"), ("wait", "  wait (peers)"),
              ("last_bucket", "  last bucket"), ("exposed", "  earlier buckets"),
              ("optimizer", "optimizer"), ("other", "other"), ("step", "step"))
#: A finding's predicted saving must reach both of these to be reported ...
MIN_SAVING_MS = 0.1
MIN_SAVING_FRACTION = 0.02
#: ... except for settings whose change costs no step time (pure overhead when the
#: condition holds): for them NO_TRADEOFF_MIN_MS alone is the bar.
NO_TRADEOFF = ("find_unused", "broadcast_buffers", "bucket_view")
#: Findings said whenever their condition holds, whatever their saving: how the run went.
ALWAYS = ("at_the_end",)
NO_TRADEOFF_MIN_MS = 0.25
#: Buckets up to this size measure the per-bucket cost in the run itself.
SMALL_BUCKET_BYTES = 64 * 1024
#: A straggler is a rank whose compute exceeds the fastest rank's by this much (and 2 ms).
STRAGGLER_FRACTION = 0.25
STRAGGLER_MS = 2.0
STRAGGLER_CONSISTENCY = 0.8
#: "Far" from the step model's best cap: a factor of at least this.
CAP_FACTOR = 4.0


class RankStep(NamedTuple):
    """One step of one rank ([Note: the step breakdown]); all ms."""

    iteration: int
    step: float
    forward: float
    pre_forward: float   # forward_start -> module_start: buffer broadcast, rebuild check
    post_forward: float  # module_end -> forward_end: find_unused's graph walk
    backward: float
    exposed: float
    last_bucket: float
    wait: float
    optimizer: float
    other: float
    write: float         # tail after the last collective: copying results into .grad


class Finding(NamedTuple):
    key: str           # find_unused | bucket_cap | last_bucket | comm_hook | bucket_view |
                       # broadcast_buffers | straggler | at_the_end
    title: str
    change: str
    saving_ms: float
    evidence: str


@dataclass
class Explanation:
    """What ``explain`` found: per-rank medians, the straggler, ranked findings."""

    ranks: list[int]
    steps: int
    parts: dict[int, dict[str, float]]        # rank -> part (PARTS, step, write, ...) -> ms
    straggler: dict[str, Any] | None
    findings: list[Finding]
    notes: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return format_explanation(self)

    def __str__(self) -> str:
        return self.text

    def keys(self) -> list[str]:
        return [f.key for f in self.findings]


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


def last_launches(events: Sequence[Event]) -> dict[int, float]:
    """Iteration -> absolute time this rank launched its last bucket."""
    return {it.iteration: it.t0 + it.buckets[-1].launch / 1e3 for it in iteration_times(events)}


def bucket_launches(events: Sequence[Event]) -> dict[tuple[int, int], float]:
    """(iteration, bucket) -> absolute time this rank launched that bucket."""
    return {(it.iteration, b.bucket): it.t0 + b.launch / 1e3
            for it in iteration_times(events) for b in it.buckets}


def rank_steps(events: Sequence[Event], gate: dict[int, float] | None = None,
               bucket_gate: dict[tuple[int, int], float] | None = None) -> list[RankStep]:
    """Every complete step of one rank's events ([Note: the step breakdown]).

    ``gate[it]``: when the slowest rank launched iteration ``it``'s last
    bucket (same clock as the events); ``bucket_gate[(it, b)]``: when the
    slowest rank launched bucket ``b`` (used when every bucket was reduced
    after the backward); None: this rank alone."""
    gate = gate or {}
    its = recent(iteration_times(events), 0)
    fwd = _sorted_times(events, "forward_start")
    mod_s, mod_e = _sorted_times(events, "module_start"), _sorted_times(events, "module_end")
    fwd_e = _sorted_times(events, "forward_end")
    opt_s, opt_e = _sorted_times(events, "optimizer_start"), _sorted_times(events, "optimizer_end")
    out = []
    for it in its:
        t0 = it.t0
        f0 = _last_before(fwd, t0)
        written = t0 + (it.backward_ms + it.tail_ms) / 1e3
        f1 = _first_after(fwd, written)
        if f0 is None or f1 is None:
            continue
        ms0, me, fe = (_first_after(x, f0, t0) for x in (mod_s, mod_e, fwd_e))
        if ms0 is None or me is None or fe is None:
            continue
        opt = 0.0
        for s in opt_s:
            if written <= s < f1:
                e = _first_after(opt_e, s, f1)
                if e is not None:
                    opt += e - s
        step = (f1 - f0) * 1e3
        wait, last, other_comm = _split_exposed(it, gate.get(it.iteration), bucket_gate)
        forward = (fe - f0) * 1e3
        exposed_all = wait + last + other_comm
        rest = step - forward - it.backward_ms - exposed_all - opt * 1e3
        out.append(RankStep(it.iteration, step, forward, (ms0 - f0) * 1e3, (fe - me) * 1e3,
                            it.backward_ms, other_comm, last, wait, opt * 1e3, max(0.0, rest),
                            max(0.0, it.tail_ms - it.exposed_ms)))
    return out


def _split_exposed(it: IterationTimes, gate: float | None,
                   bucket_gate: dict[tuple[int, int], float] | None = None,
                   ) -> tuple[float, float, float]:
    """(wait, last bucket, other buckets) parts of ``it.exposed_ms``."""
    exposed = it.exposed_ms
    if exposed <= 0:
        return 0.0, 0.0, 0.0
    back = it.backward_ms
    if bucket_gate and all(b.launch >= back for b in it.buckets):
        # Reduced after the backward, one bucket after the other: each bucket's
        # collective waits for the slowest rank to launch *that* bucket.
        wait = last_part = 0.0
        for k, b in enumerate(it.buckets):
            lo, hi = max(b.start, back), b.done
            if hi <= lo:
                continue
            g = bucket_gate.get((it.iteration, b.bucket))
            w = 0.0 if g is None else min(hi - lo, max(0.0, (g - it.t0) * 1e3 - lo))
            wait += w
            if k == len(it.buckets) - 1:
                last_part = hi - lo - w
        wait = min(wait, exposed)
        last_part = min(last_part, exposed - wait)
        return wait, last_part, max(0.0, exposed - wait - last_part)
    wait = 0.0 if gate is None else min(exposed, max(0.0, (gate - it.t0) * 1e3 - back))
    lo, hi = back + wait, back + exposed
    last = it.buckets[-1]
    last_part = max(0.0, min(hi, last.done) - max(lo, last.start))
    return wait, last_part, max(0.0, exposed - wait - last_part)


def _medians(steps: Sequence[RankStep]) -> dict[str, float]:
    med = statistics.median
    out = {k: med([getattr(s, k) for s in steps]) for k in RankStep._fields if k != "iteration"}
    # Medians of the parts need not add up to the median step: keep "other" as the remainder.
    out["other"] = max(0.0, out["step"] - sum(out[k] for k in PARTS if k != "other"))
    out["compute"] = statistics.median([_compute(s) for s in steps])
    return out


# ------------------------------------------------------------------ analysis
def record_events(records: Sequence[dict[str, Any]]) -> dict[int, list[Event]]:
    """Rank -> its events, on its own clock (add ``record["clock_offset"]`` for the wall
    clock; records written before it existed hold wall-clock times and no offset)."""
    return {r["rank"]: [Event(int(a), str(b), int(c), float(d)) for a, b, c, d in r["events"]]
            for r in records}


def analyse(records: Sequence[dict[str, Any]], last_n: int = STEADY_LAST_N) -> Explanation:
    """Explain a run from every rank's ``rank_record`` (or what ``load`` read back):
    medians over the newest ``last_n`` steady steps (0: all of them)."""
    if not records:
        raise ValueError("explain needs at least one rank's record")
    records = sorted(records, key=lambda r: r["rank"])
    events = record_events(records)
    # Gates on the wall clock (each rank's times + its clock offset), then back on each
    # rank's own clock: the rank's times are used as recorded ([Note: exposed communication]).
    offset = {r["rank"]: float(r.get("clock_offset", 0.0)) for r in records}
    gate: dict[int, float] = {}
    bucket_gate: dict[tuple[int, int], float] = {}
    for rank, evs in events.items():
        for it, t in last_launches(evs).items():
            gate[it] = max(gate.get(it, t + offset[rank]), t + offset[rank])
        for key, t in bucket_launches(evs).items():
            bucket_gate[key] = max(bucket_gate.get(key, t + offset[rank]), t + offset[rank])
    many = len(events) > 1
    per_rank = {rank: rank_steps(evs, {k: g - offset[rank] for k, g in gate.items()}
                                 if many else None,
                                 {k: g - offset[rank] for k, g in bucket_gate.items()}
                                 if many else None)
                for rank, evs in events.items()}
    common = set.intersection(*({s.iteration for s in v} for v in per_rank.values()))
    keep = sorted(common)[-last_n:] if last_n > 0 else sorted(common)
    if not keep:
        raise ValueError("the record holds no complete DDP step on every rank (a step needs "
                         "its forward, backward and the next forward): train at least 3 steps")
    chosen = {rank: [s for s in v if s.iteration in keep] for rank, v in per_rank.items()}
    parts = {rank: _medians(v) for rank, v in chosen.items()}
    for rank, evs in events.items():  # the one figure ([Note: exposed communication])
        exposed = exposed_comm(iteration_times(evs), last_n)
        parts[rank]["exposed_total"] = exposed.ms
        parts[rank]["exposed_iterations"] = float(len(exposed.iterations))
        # The unindented rows add up to the step: "other" is what the rest leaves.
        p = parts[rank]
        p["other"] = max(0.0, p["step"] - sum(p[k] for k in UNINDENTED))
    facts = records[0]["facts"]
    curve_doc = next((r.get("curve") for r in records if r.get("curve")), None)
    curve = CommCurve(curve_doc["sizes"], curve_doc["times_ms"]) if curve_doc else None
    straggler = _straggler(parts, chosen)
    findings = _findings(parts, facts, events[records[0]["rank"]], keep, curve)
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
    findings = [f for f in findings if _worth(f.saving_ms, step) or f.key in ALWAYS
                or (f.key in NO_TRADEOFF and f.saving_ms >= NO_TRADEOFF_MIN_MS)]
    findings.sort(key=lambda f: -f.saving_ms)
    notes = [] if curve is not None else [
        "no all-reduce curve was measured on this link: the bucket-size findings use this "
        "run's own bucket timings, and the comm hook is not judged"]
    if not facts.get("overlap", True):
        notes.append("every bucket was reduced when the backward ended, not overlapped with "
                     f"it ({facts.get('overlap_why', '')}); GRADRING_OVERLAP=1 overlaps "
                     "anyway, and the bucket-size findings are left out")
    return Explanation(sorted(parts), len(keep), parts, straggler, findings, notes)


def _worth(saving: float, step: float) -> bool:
    return saving >= max(MIN_SAVING_MS, MIN_SAVING_FRACTION * step)


def _compute(s: RankStep) -> float:
    return s.step - s.exposed - s.last_bucket - s.wait


def _straggler(parts: dict[int, dict[str, float]],
               steps: dict[int, list[RankStep]]) -> dict[str, Any] | None:
    """The slowest rank, if its median compute exceeds the fastest's by STRAGGLER_MS and
    STRAGGLER_FRACTION *and* it was the slower of the two in STRAGGLER_CONSISTENCY of the
    steps: a rank that is slow all the time, not one the OS descheduled now and then."""
    if len(parts) < 2:
        return None
    slow = max(parts, key=lambda r: parts[r]["compute"])
    fast = min(parts, key=lambda r: parts[r]["compute"])
    excess = parts[slow]["compute"] - parts[fast]["compute"]
    if excess < max(STRAGGLER_MS, STRAGGLER_FRACTION * parts[fast]["compute"]):
        return None
    slower = sum(_compute(a) > _compute(b) for a, b in zip(steps[slow], steps[fast]))
    if slower < STRAGGLER_CONSISTENCY * len(steps[slow]):
        return None
    candidates = ("forward", "backward", "optimizer", "other")
    part = max(candidates, key=lambda k: parts[slow][k] - parts[fast][k])
    return {"rank": slow, "fastest": fast, "excess_ms": excess,
            "compute_ms": parts[slow]["compute"], "fastest_ms": parts[fast]["compute"],
            "part": part, "part_excess_ms": parts[slow][part] - parts[fast][part],
            "waits": {r: p["wait"] for r, p in parts.items() if r != slow}}


def _bucket_stats(events: Sequence[Event], keep: Sequence[int]) -> list[dict[str, float]]:
    """Per bucket index: median ready (ms after backward start) and run ms over ``keep``."""
    its = [it for it in iteration_times(events) if it.iteration in set(keep)]
    if not its:
        return []
    med = statistics.median
    return [{"bucket": b.bucket, "ready": med([it.buckets[k].ready for it in its]),
             "run": med([it.buckets[k].run_ms for it in its])}
            for k, b in enumerate(its[-1].buckets)]


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
    """A curve from this run's own bucket collectives (size -> median run ms)."""
    points = sorted({facts["bucket_bytes"][b["bucket"]]: max(b["run"], 1e-3)
                     for b in buckets}.items())
    return CommCurve([s for s, _ in points], [t for _, t in points])


def _findings(parts: dict[int, dict[str, float]], facts: dict[str, Any],
              events: Sequence[Event], keep: Sequence[int],
              curve: CommCurve | None) -> list[Finding]:
    p = parts[min(parts)]
    out: list[Finding] = []
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
                "broadcast_buffers", "buffers are broadcast before every forward but never change",
                "construct DDP with broadcast_buffers=False", p["pre_forward"],
                f"{len(buffers)} buffer(s), {nbytes / 1024:.1f} KiB, were not written in place on "
                f"rank {facts['rank']} in {facts['num_forward']} forwards; syncing them takes "
                f"{p['pre_forward']:.2f} ms/step (forward_start -> module_start)"))
    if not facts["bucket_view"] and p["write"] > 0:
        mib = facts["grad_bytes_outside_buckets"] / MIB
        out.append(Finding(
            "bucket_view", "reduced gradients are copied into .grad after every backward",
            "construct DDP with gradient_as_bucket_view=True (.grad becomes a view of its "
            "bucket; it cannot be detached in place)", p["write"],
            f"after the last collective, backward() spends {p['write']:.2f} ms/step writing "
            f"results into .grad; {mib:.1f} MiB of gradients live outside the buckets"))
    buckets = _bucket_stats(events, keep)
    if buckets and facts["bucket_params"]:
        measured = curve is not None
        use = curve if curve is not None else _run_curve(facts, buckets)
        profile = _profile(facts, buckets, p["backward"], max(p["compute"], p["backward"]))
        # What one collective costs: its fixed part, as small buckets ran in this very run
        # (under the backward's contention); else the smallest all-reduce on the curve.
        small = [b["run"] for b in buckets
                 if facts["bucket_bytes"][b["bucket"]] <= SMALL_BUCKET_BYTES]
        per_bucket = (statistics.median(small), "median run of this run's small buckets") \
            if small else (use.times_ms[0], "smallest all-reduce")
        # The last bucket's exposure is clearest on the rank that waited least for others.
        p_last = max(parts.values(), key=lambda q: q["last_bucket"])
        if facts.get("overlap", True):  # the step model's buckets overlap the backward
            out += _cap_findings(p, p_last, facts, profile, use, measured, per_bucket)
        else:
            out.append(_at_the_end_finding(p, facts, buckets))
        if facts["comm_hook"] and curve is not None:
            hook = sum(b["run"] for b in buckets)
            plain = sum(curve.time_ms(facts["bucket_bytes"][b["bucket"]]) for b in buckets)
            out.append(Finding(
                "comm_hook", f"the comm hook {facts['comm_hook']} costs more than it saves",
                "remove register_comm_hook (plain all-reduce) or use a cheaper hook",
                hook - plain,
                f"its {len(buckets)} bucket(s) take {hook:.2f} ms/step from start to done; "
                f"plain all-reduces of the same bytes measured {plain:.2f} ms on this link"))
    return out


def overlapped_exposed_ms(buckets: Sequence[dict[str, float]], backward_ms: float) -> float:
    """Exposed time had each bucket launched when ready: bucket k starts at the
    later of its ready time and bucket k-1's end and runs its measured ``run``;
    what ends after ``backward_ms`` is exposed (``buckets`` as ``_bucket_stats``)."""
    end = 0.0
    for b in buckets:
        end = max(b["ready"], end) + b["run"]
    return max(0.0, end - backward_ms)


def _at_the_end_finding(p: dict[str, float], facts: dict[str, Any],
                        buckets: Sequence[dict[str, float]]) -> Finding:
    """Every bucket was reduced after the backward ([Note: overlap needs a free core]
    in reducer/overlap_policy.py): say so, and what launching at ready time would save."""
    why = facts.get("overlap_why", "")
    reason = f"({why})"
    own = p["last_bucket"] + p["exposed"]  # the exposed time less waiting for peers
    pred = overlapped_exposed_ms(buckets, p["backward"])
    ready = ", ".join(f"{b['ready']:.2f}" for b in buckets)
    return Finding(
        "at_the_end", f"buckets were reduced after the backward {reason}",
        "unset GRADRING_OVERLAP (or set it to 1): buckets then launch as they become "
        "ready, as in torch's DDP",
        max(0.0, own - pred),
        f"{len(buckets)} bucket(s) ran {own:.2f} ms/step of collectives after the backward "
        f"(waiting for peers left out; the reducer: {why}); launched when ready (at "
        f"{ready} ms of a {p['backward']:.2f} ms backward) with the same run times, "
        f"{pred:.2f} ms would be left exposed")


def _cap_findings(p: dict[str, float], p_last: dict[str, float], facts: dict[str, Any],
                  profile: Profile,
                  curve: CommCurve, measured: bool,
                  per_bucket: tuple[float, str]) -> list[Finding]:
    cur_mb = facts["bucket_cap_bytes"] / MIB
    c, c_source = per_bucket
    caps = sorted(set(DEFAULT_CAPS_MB) | {cur_mb})
    preds = {cap: simulate(profile, curve, cap, per_bucket_ms=c) for cap in caps}
    cur = preds[cur_mb]
    best = choose(list(preds.values()))
    source = "all-reduce times measured on this link" if measured else \
        "this run's own bucket timings"
    out = []
    ratio = max(best.cap_mb / cur_mb, cur_mb / best.cap_mb)
    if ratio >= CAP_FACTOR:
        out.append(Finding(
            "bucket_cap", f"bucket_cap_mb={cur_mb:g} is far from the step model's best",
            f"construct DDP with bucket_cap_mb={best.cap_mb:g}", cur.step_ms - best.step_ms,
            f"step model ({source}; {c:.2f} ms per bucket, the {c_source}): "
            f"{len(cur.buckets)} buckets, "
            f"predicted step {cur.step_ms:.2f} ms; at {best.cap_mb:g} MiB "
            f"{len(best.buckets)} buckets, {best.step_ms:.2f} ms"))
    last_bytes = facts["bucket_bytes"][-1]
    exposed = p_last["exposed"] + p_last["last_bucket"]
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
                f"{exposed:.2f} ms/step exposed; saving = its share of the bytes removed, "
                f"minus {c:.2f} ms for each extra bucket (the {c_source}; {source})"))
    keyed = {f.key: f for f in out}
    if "bucket_cap" in keyed and "last_bucket" in keyed and \
            keyed["bucket_cap"].change.split("=")[-1] == \
            keyed["last_bucket"].change.split("=")[-1].split(":")[0]:
        out = [max(out, key=lambda f: f.saving_ms)]  # one change, said once
    return out


# ------------------------------------------------------------------ text
def format_explanation(x: Explanation) -> str:
    ranks = x.ranks
    n_exposed = int(x.parts[ranks[0]].get("exposed_iterations", x.steps))
    lines = [f"gradring explain: {len(ranks)} rank(s), medians over {x.steps} step(s) "
             f"(exposed comm: over {n_exposed} steady iteration(s))",
             f"{'ms per step':<17}" + "".join(f"{'rank ' + str(r):>16}" for r in ranks)]
    for key, label in TABLE_ROWS:
        row = f"{label:<17}"
        for r in ranks:
            part = x.parts[r]
            v = part[key]
            s = part["step"]
            row += f"{v:>9.2f} {v / s:>5.0%}" if key != "step" and s > 0 else f"{v:>9.2f}      "
        lines.append(row)
    lines.append("(exposed comm: collectives still running after the backward, the same "
                 "figure as overlap_stats(), the demo and gradring timeline; its three parts "
                 "are medians of their own; forward includes buffer sync and the graph walk; "
                 "other: loss, zero_grad, data, copies into .grad)")
    s = x.straggler
    if s is None:
        lines.append(f"stragglers: none (compute within {STRAGGLER_FRACTION:.0%} across ranks)"
                     if len(ranks) > 1 else "stragglers: one rank only")
    else:
        waits = ", ".join(f"rank {r} waits {w:.2f} ms" for r, w in s["waits"].items())
        lines.append(f"stragglers: rank {s['rank']} is slower by {s['excess_ms']:.2f} ms/step "
                     f"({s['excess_ms'] / max(s['fastest_ms'], 1e-9):.0%} more compute than "
                     f"rank {s['fastest']}), mostly in {s['part']}; {waits} for it")
    if not x.findings:
        lines.append(f"findings: none costs at least {MIN_SAVING_MS} ms and "
                     f"{MIN_SAVING_FRACTION:.0%} of the step")
    else:
        lines.append("findings, by measured cost:")
    for k, f in enumerate(x.findings, 1):
        step = max(p["step"] for p in x.parts.values())
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


def load(path: str) -> list[dict[str, Any]]:
    """Every rank's record from a merged trace, one rank's trace, or a folder of them."""
    import glob
    import json
    import os

    paths = sorted(glob.glob(os.path.join(path, "*.json"))) if os.path.isdir(path) else [path]
    if not paths:
        raise ValueError(f"{path}: no .json trace files in this folder")
    records: dict[int, dict[str, Any]] = {}
    for p in paths:
        with open(p) as f:
            doc = json.load(f)
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
