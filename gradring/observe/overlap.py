"""How much of the gradient communication the backward hid: statistics and trace export.

Everything here is a pure function over the reducer's trace events
(gradring/observe/trace.py) plus bucket metadata, so it is tested with synthetic
events and no process group. ``ddp_overlap_stats`` and ``export_chrome_trace``
are the two entry points that read a live ``DistributedDataParallel``.

[Note: what the overlap numbers mean]
Per iteration, with times taken from the reducer's events:

- ``backward_ms``  = backward_end - backward_start: from the first gradient
  hook to the end-of-backward callback. Autograd work before the first
  parameter gradient (the loss and the last layer's input-gradient path up to
  its first AccumulateGrad) is not included: no bucket can be in flight then.
- bucket k's collective is *in flight* from ``launch_k`` to ``done_k``, where
  ``done_k = min(comm_done_k, written_k)``: the comm_done mark runs in a future
  callback that may wait for the GIL, while ``written_k`` is only stamped after
  the reducer's wait on that future returned, so the earlier of the two is the
  better estimate of when the collective finished.
- collectives of one group run one at a time in issue order, so bucket k's
  collective *runs* from ``start_k = max(launch_k, done_{k-1})`` to ``done_k``
  (``run_ms``); ``start_k - launch_k`` is time queued behind the previous
  bucket. The runs never overlap.
- ``comm_ms``      = the sum of the runs: the time during which a collective
  was running (the union of the in-flight intervals).
- bucket k's ``exposed`` = the part of its run after backward_end,
  ``max(0, done_k - max(start_k, backward_end))``.
- ``exposed_ms``   = the sum of the buckets' ``exposed``: the communication
  the backward did not hide: the time after backward_end during which a
  collective ran, without the write-back between two collectives.
  (Communication launched before backward_start cannot happen in a
  synchronised iteration and is not counted.)
- ``overlap_ratio`` = (comm_ms - exposed_ms) / comm_ms: the hidden fraction of
  the communication (1.0 when nothing was communicated).
- ``tail_ms``      = last written - backward_end: everything ``backward()`` spent
  after autograd finished (waiting for collectives *and* copying the reduced
  buckets into ``.grad``); ``tail_ms >= exposed_ms``.

[Note: which steps the reports summarise]
Every report (``ddp.overlap_stats()``, the demo, ``gradring explain``, its
``--json``, ``gradring timeline``) summarises the same iterations of a rank,
chosen by one function, ``steady_steps``:

- complete: both backward marks and, for every launched bucket, its done time;
- a whole step: when the trace holds DDP.forward's marks, a forward started
  before the iteration's backward and the *next* forward has started (a step
  ends where the next one begins, so the newest backward counts once the next
  forward ran);
- steady: the bucket layout of the newest such iteration, iteration 0 left
  out when later ones exist (the iteration before the bucket rebuild, and the
  first one, which also pays for connecting the transport);
- the newest ``last_n`` of them when ``last_n`` > 0, else every one still in
  the ring buffer (``STEADY_LAST_N``).

Each figure is the **mean** over those iterations (``mean``), never a median.
Per iteration the parts of a figure add up to it (the buckets' ``exposed`` to
``exposed_ms``; in explain, waiting for peers, the last bucket and the earlier
buckets to the exposed time, and the rows of the step to the step), and the
mean of a sum is the sum of the means, so every printed breakdown adds up to
its total. A median would not: medians of parts taken over different steps
need not add up to the median of their total, and on a loaded machine, where a
rank sometimes waits for its peer and sometimes the peer for it, they did not
by a factor of two. The mean is also what a run pays: steps x mean step is the
wall time. A step in which the OS descheduled a rank counts with what it cost.

[Note: exposed communication]
One definition, in one function (``exposed_comm``), read by every report:
``ddp.overlap_stats()["exposed_ms"]``, the demo's "exposed communication",
``gradring explain``'s "exposed comm" row (and ``exposed_comm`` in its
``--json``) and ``gradring timeline``'s report: per rank, the mean of
``exposed_ms`` over the iterations of [Note: which steps the reports
summarise]. Each report computes it from the same events, the reducer's own
``perf_counter`` times (``record.rank_record`` keeps them as they are, with
the rank's clock offset beside them), so for one run and one rank they give
the same float. explain splits each iteration's exposed time into waiting for
peers, the last bucket and the earlier buckets (``split_exposed``); the parts
add up to it, iteration by iteration and in the mean.

[Note: trace clocks]
The reducer stamps ``time.perf_counter()``. A per-rank trace file stores its
times relative to its own first exported event, plus that event's wall-clock
time: ``perf_counter`` + an offset ``time.time() - time.perf_counter()``
sampled once per process. ``merge_traces`` shifts each rank by the difference
of those wall-clock origins. On one host perf_counter is the system-wide
monotonic clock, so the offsets differ only by sampling jitter (microseconds);
across hosts the alignment is as good as their NTP sync (typically around a
millisecond), which is enough to line up buckets, not to time one collective.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import math
import os
import tempfile
import time
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from gradring.observe.record import clock_offset, rank_record
from gradring.observe.trace import Event

COMPUTE_TID = 0  # Chrome-trace thread id of the compute lane
COMM_TID = 1     # ... and of the communication lane


class BucketTimes(NamedTuple):
    """One bucket in one iteration; times in ms relative to backward_start."""

    bucket: int
    ready: float
    launch: float
    start: float     # when its collective began running (after the previous one's)
    done: float      # when its collective finished (see the Note)
    written: float   # when its reduced gradients were in .grad (nan if unknown)
    exposed: float   # the part of its run after backward_end (see the Note)

    @property
    def wait_ms(self) -> float:
        """Ready to launch: waiting for lower-indexed buckets to launch first."""
        return self.launch - self.ready

    @property
    def queue_ms(self) -> float:
        """Launch to start: queued behind the previous bucket's collective."""
        return self.start - self.launch

    @property
    def run_ms(self) -> float:
        """Start to done: this bucket's own collective."""
        return self.done - self.start

    @property
    def flight_ms(self) -> float:
        """Launch to done."""
        return self.done - self.launch


class IterationTimes(NamedTuple):
    """One complete iteration (see [Note: what the overlap numbers mean])."""

    iteration: int
    t0: float                  # backward_start, perf_counter seconds
    backward_ms: float
    comm_ms: float
    exposed_ms: float
    tail_ms: float
    buckets: tuple[BucketTimes, ...]   # ordered by bucket index

    @property
    def overlap_ratio(self) -> float:
        return 1.0 if self.comm_ms <= 0 else (self.comm_ms - self.exposed_ms) / self.comm_ms

    @property
    def end(self) -> float:
        """When the last reduced gradient was in .grad (perf_counter seconds)."""
        return self.t0 + (self.backward_ms + self.tail_ms) / 1e3


def iteration_times(events: Iterable[Event]) -> list[IterationTimes]:
    """Per-iteration breakdown of every complete iteration in ``events``, oldest first."""
    by_iter: dict[int, dict[tuple[str, int], float]] = {}
    for e in events:
        marks = by_iter.setdefault(e.iteration, {})
        marks.setdefault((e.kind, e.bucket), e.t)  # first mark wins
    out = []
    for it in sorted(by_iter):
        one = _one_iteration(it, by_iter[it])
        if one is not None:
            out.append(one)
    return out


def _one_iteration(it: int, m: dict[tuple[str, int], float]) -> IterationTimes | None:
    bs, be = m.get(("backward_start", -1)), m.get(("backward_end", -1))
    if bs is None or be is None:
        return None
    launched = sorted(b for kind, b in m if kind == "launch")
    if not launched:
        return None
    ms = lambda t: (t - bs) * 1e3
    back = ms(be)
    buckets: list[BucketTimes] = []
    prev_done = float("-inf")
    for b in launched:
        launch = m[("launch", b)]
        comm_done, written = m.get(("comm_done", b)), m.get(("written", b))
        ends = [t for t in (comm_done, written) if t is not None]
        if not ends:
            return None  # still in flight: the iteration is not complete
        done = min(ends)
        start = min(max(launch, prev_done), done)
        prev_done = max(prev_done, done)
        ready = m.get(("ready", b), launch)
        d, s = ms(done), ms(start)
        buckets.append(BucketTimes(b, ms(ready), ms(launch), s, d,
                                   float("nan") if written is None else ms(written),
                                   max(0.0, d - max(s, back))))
    last_done = max(x.done for x in buckets)
    written_all = [x.written for x in buckets if x.written == x.written]
    last_written = max(written_all) if written_all else last_done
    return IterationTimes(
        iteration=it, t0=bs, backward_ms=back,
        comm_ms=math.fsum(x.run_ms for x in buckets),
        exposed_ms=math.fsum(x.exposed for x in buckets),
        tail_ms=max(0.0, last_written - back),
        buckets=tuple(buckets),
    )


def _layout(it: IterationTimes) -> tuple[int, ...]:
    return tuple(b.bucket for b in it.buckets)


#: How many of the newest steady iterations the reports take; 0: every one recorded.
STEADY_LAST_N = 0


def mean(values: Sequence[float]) -> float:
    """The one average every report takes ([Note: which steps the reports summarise]);
    0.0 for no values."""
    return math.fsum(values) / len(values) if values else 0.0


def recent(iterations: Sequence[IterationTimes], last_n: int = 10) -> list[IterationTimes]:
    """The newest ``last_n`` iterations that share the newest one's bucket layout.

    Iteration 0 is left out when any other qualifies (see the Note).
    """
    if not iterations:
        return []
    layout = _layout(iterations[-1])
    same = [it for it in iterations if _layout(it) == layout]
    if len(same) > 1 and same[0].iteration == 0:
        same = same[1:]
    return same[-last_n:] if last_n > 0 else same


def steady_iterations(iterations: Sequence[IterationTimes],
                      last_n: int = STEADY_LAST_N) -> list[IterationTimes]:
    """The steady ones of ``iterations`` ([Note: which steps the reports summarise]):
    same layout as the newest, iteration 0 left out, the newest ``last_n`` (0: all)."""
    return recent(iterations, last_n)


def forward_starts(events: Iterable[Event]) -> list[float]:
    """Every forward's start (DDP.forward's mark), sorted."""
    return sorted(e.t for e in events if e.kind == "forward_start")


def step_bounds(it: IterationTimes, forwards: Sequence[float]) -> tuple[float, float] | None:
    """The step of ``it``: its own forward's start (the last before its backward) and the
    next forward's start (the first after its last write); None while either is missing."""
    i = bisect.bisect_right(forwards, it.t0)
    j = bisect.bisect_left(forwards, it.end)
    if i == 0 or j == len(forwards):
        return None
    return forwards[i - 1], forwards[j]


def steady_steps(events: Sequence[Event], last_n: int = STEADY_LAST_N) -> list[IterationTimes]:
    """The iterations every report summarises, from one rank's events ([Note: which
    steps the reports summarise]): complete, whole steps where the trace has
    DDP.forward's marks, steady, the newest ``last_n`` (0: all)."""
    its = iteration_times(events)
    forwards = forward_starts(events)
    if forwards:
        its = [it for it in its if step_bounds(it, forwards) is not None]
    return steady_iterations(its, last_n)


class ExposedComm(NamedTuple):
    """The exposed communication of one rank ([Note: exposed communication])."""

    ms: float                            # mean over the summarised iterations
    iterations: tuple[int, ...]          # which iterations
    per_iteration_ms: tuple[float, ...]  # each one's exposed_ms, in that order


def exposed_comm(chosen: Sequence[IterationTimes]) -> ExposedComm:
    """The one definition of exposed communication ([Note: exposed communication]):
    the mean of ``exposed_ms`` over ``chosen`` (``steady_steps``' answer)."""
    per = tuple(it.exposed_ms for it in chosen)
    return ExposedComm(mean(per), tuple(it.iteration for it in chosen), per)


class ExposedPiece(NamedTuple):
    """Part of one bucket's exposed run ([Note: exposed communication]): from ``t0`` to
    ``t1`` (ms after backward_start); ``waiting`` while the slowest rank had not yet
    launched that bucket (no collective finishes before every rank joins it)."""

    bucket: int
    t0: float
    t1: float
    waiting: bool


def split_exposed(it: IterationTimes, launched_by_all: dict[int, float] | None = None
                  ) -> list[ExposedPiece]:
    """Each bucket's exposed run, cut where the slowest rank launched that bucket:
    ``launched_by_all[bucket]`` in ms after this iteration's backward_start (None or a
    missing bucket: no waiting known). The pieces' lengths add up to ``it.exposed_ms``."""
    back = it.backward_ms
    out = []
    for b in it.buckets:
        lo, hi = max(b.start, back), b.done
        if hi <= lo:
            continue
        g = (launched_by_all or {}).get(b.bucket)
        cut = lo if g is None else min(max(g, lo), hi)
        if cut > lo:
            out.append(ExposedPiece(b.bucket, lo, cut, True))
        if hi > cut:
            out.append(ExposedPiece(b.bucket, cut, hi, False))
    return out


class ExposedParts(NamedTuple):
    """One iteration's exposed time in explain's three parts (they add up to it)."""

    wait: float
    last_bucket: float
    earlier_buckets: float


def exposed_parts(it: IterationTimes, launched_by_all: dict[int, float] | None = None
                  ) -> ExposedParts:
    """Waiting for peers, the last bucket's own run and the earlier buckets' own runs,
    after backward_end: ``split_exposed`` summed. ``earlier_buckets`` is the remainder,
    so that the three add up to ``it.exposed_ms``."""
    pieces = split_exposed(it, launched_by_all)
    last = it.buckets[-1].bucket
    wait = math.fsum(p.t1 - p.t0 for p in pieces if p.waiting)
    own_last = math.fsum(p.t1 - p.t0 for p in pieces if not p.waiting and p.bucket == last)
    return ExposedParts(wait, own_last, max(0.0, it.exposed_ms - wait - own_last))


class BucketInfo(NamedTuple):
    """What the stats say about a bucket besides its timings."""

    nbytes: int
    params: tuple[str, ...]


def summarize(iterations: Sequence[IterationTimes], buckets: Sequence[BucketInfo] = (),
              last_n: int = STEADY_LAST_N) -> dict[str, Any]:
    """Means over the steady ones of ``iterations`` (newest ``last_n``; 0: all), plus a
    per-bucket table ([Note: which steps the reports summarise]).

    ``buckets[k]`` describes bucket k (its size and parameter names); buckets
    without an entry get ``nbytes`` 0 and no names. Keys are documented in
    docs/overlap.md; all times are milliseconds. The buckets' ``exposed_ms``
    add up to ``exposed_ms``.
    """
    chosen = steady_iterations(iterations, last_n)
    if not chosen:
        return {"iterations": 0, "backward_ms": 0.0, "comm_ms": 0.0, "exposed_ms": 0.0,
                "tail_ms": 0.0, "overlap_ratio": 1.0, "exposed_per_iteration_ms": [],
                "exposed_iterations": [], "buckets": []}
    exposed = exposed_comm(chosen)
    comm = mean([it.comm_ms for it in chosen])
    table = []
    for k, bucket in enumerate(chosen[-1].buckets):
        rows = [it.buckets[k] for it in chosen]
        info = buckets[bucket.bucket] if bucket.bucket < len(buckets) else BucketInfo(0, ())
        back = [it.backward_ms for it in chosen]
        hidden = sum(r.done <= b for r, b in zip(rows, back))
        table.append({
            "bucket": bucket.bucket,
            "nbytes": info.nbytes,
            "params": list(info.params),
            "ready_ms": mean([r.ready for r in rows]),
            "ready_to_launch_ms": mean([r.wait_ms for r in rows]),
            "queued_ms": mean([r.queue_ms for r in rows]),
            "run_ms": mean([r.run_ms for r in rows]),
            "exposed_ms": mean([r.exposed for r in rows]),
            "launch_to_done_ms": mean([r.flight_ms for r in rows]),
            "finished_before_backward_end": 2 * hidden > len(rows),
            "hidden_fraction": hidden / len(rows),
        })
    return {
        "iterations": len(chosen),
        "backward_ms": mean([it.backward_ms for it in chosen]),
        "comm_ms": comm,
        "exposed_ms": exposed.ms,
        "tail_ms": mean([it.tail_ms for it in chosen]),
        "overlap_ratio": 1.0 if comm <= 0 else (comm - exposed.ms) / comm,
        "exposed_per_iteration_ms": list(exposed.per_iteration_ms),
        "exposed_iterations": list(exposed.iterations),
        "buckets": table,
    }


def bucket_infos(ddp: Any) -> list[BucketInfo]:
    """Sizes and parameter names of a DDP model's current buckets."""
    reducer = ddp.reducer
    return [BucketInfo(b.nbytes, tuple(reducer.names[i] for i in b.param_indices))
            for b in reducer.buckets]


def ddp_overlap_stats(ddp: Any, last_n: int = STEADY_LAST_N) -> dict[str, Any]:
    """``summarize`` over a gradring DDP model's ``steady_steps`` (what
    ``ddp.overlap_stats()`` returns)."""
    chosen = steady_steps(list(ddp.reducer.trace.events), last_n)
    return summarize(chosen, bucket_infos(ddp), 0)


def format_table(stats: dict[str, Any], *, max_names: int = 3) -> str:
    """The per-bucket table of ``summarize``'s result as fixed-width text."""
    head = (f"{'bucket':>6} {'KiB':>9} {'ready':>8} {'wait':>7} {'queued':>7} {'run':>7} "
            f"{'exposed':>7} {'hidden':>6}  params")
    lines = [head]
    for b in stats["buckets"]:
        names = b["params"]
        shown = ", ".join(names[:max_names]) + (f", +{len(names) - max_names}"
                                                if len(names) > max_names else "")
        lines.append(f"{b['bucket']:>6} {b['nbytes'] / 1024:>9.1f} {b['ready_ms']:>8.2f} "
                     f"{b['ready_to_launch_ms']:>7.2f} {b['queued_ms']:>7.2f} {b['run_ms']:>7.2f} "
                     f"{b['exposed_ms']:>7.2f} {b['hidden_fraction']:>6.0%}  {shown}")
    lines.append(f"(means over {stats['iterations']} steps, ms from backward start; wait = "
                 "ready->launch, queued = launch->start, run = start->done, exposed = the part "
                 "of the run after the backward ended (the buckets' exposed add up to the "
                 "exposed communication); hidden = share of steps it finished before the "
                 "backward ended)")
    return "\n".join(lines)


# ------------------------------------------------------------------ Chrome trace
def bucket_span_name(k: int) -> str:
    return f"gradring::bucket_all_reduce#{k}"


def chrome_events(iterations: Sequence[IterationTimes], buckets: Sequence[BucketInfo] = (), *,
                  rank: int = 0, origin: float | None = None) -> list[dict[str, Any]]:
    """Chrome-trace events for one rank: a compute lane and a comm lane.

    Compute lane (tid 0): ``gradring::backward`` spans backward_start..end and
    contains one segment per bucket, ``gradring::grads_for_bucket#k``, from the
    previous bucket's ready time to bucket k's (the backward work that produced
    its gradients), then ``gradring::backward_rest``; ``gradring::finalize``
    follows, from backward_end to the last write into ``.grad``. Comm lane
    (tid 1): ``gradring::bucket_all_reduce#k`` from start to done. Times are µs
    from ``origin`` (perf_counter seconds; default: the first backward_start).
    """
    if not iterations:
        return []
    base = iterations[0].t0 if origin is None else origin
    out: list[dict[str, Any]] = [
        {"ph": "M", "pid": rank, "name": "process_name", "args": {"name": f"rank {rank}"}},
        {"ph": "M", "pid": rank, "name": "process_sort_index", "args": {"sort_index": rank}},
        {"ph": "M", "pid": rank, "tid": COMPUTE_TID, "name": "thread_name",
         "args": {"name": "compute"}},
        {"ph": "M", "pid": rank, "tid": COMM_TID, "name": "thread_name",
         "args": {"name": "comm"}},
    ]

    def span(name: str, cat: str, tid: int, t0_ms: float, t1_ms: float, it: IterationTimes,
             **args: Any) -> None:
        ts = (it.t0 - base) * 1e6 + t0_ms * 1e3
        out.append({"ph": "X", "name": name, "cat": cat, "pid": rank, "tid": tid,
                    "ts": round(ts, 3), "dur": round(max(0.0, t1_ms - t0_ms) * 1e3, 3),
                    "args": {"iteration": it.iteration, **args}})

    for it in iterations:
        span("gradring::backward", "backward", COMPUTE_TID, 0.0, it.backward_ms, it,
             exposed_ms=round(it.exposed_ms, 4), comm_ms=round(it.comm_ms, 4))
        prev = 0.0
        for b in sorted(it.buckets, key=lambda x: x.ready):
            end = min(max(b.ready, prev), it.backward_ms)
            span(f"gradring::grads_for_bucket#{b.bucket}", "compute", COMPUTE_TID, prev, end, it,
                 bucket=b.bucket)
            prev = end
        span("gradring::backward_rest", "compute", COMPUTE_TID, prev, it.backward_ms, it)
        span("gradring::finalize", "finalize", COMPUTE_TID, it.backward_ms,
             it.backward_ms + it.tail_ms, it, exposed_ms=round(it.exposed_ms, 4))
        for b in it.buckets:
            info = buckets[b.bucket] if b.bucket < len(buckets) else BucketInfo(0, ())
            span(bucket_span_name(b.bucket), "comm", COMM_TID, b.start, b.done, it,
                 bucket=b.bucket, bytes=info.nbytes, params=list(info.params),
                 ready_to_launch_ms=round(b.wait_ms, 4), queued_ms=round(b.queue_ms, 4))
    return out


def export_chrome_trace(ddp: Any, path: str, *, rank: int | None = None,
                        curve: Any = None) -> str:
    """Write this rank's trace (every complete iteration still in the ring buffer) to ``path``.

    Open it in Perfetto (ui.perfetto.dev) or chrome://tracing, or merge all
    ranks' files with :func:`merge_traces`. The file also keeps the raw
    events and the DDP's settings that ``gradring explain`` reads, and
    ``curve`` (a ``step_model.CommCurve`` measured on the link), if given.
    Returns ``path``.
    """
    comm = getattr(ddp.reducer, "comm", None)
    if rank is None:
        rank = comm.rank if comm is not None else 0
    world = comm.world_size if comm is not None else 1
    its = iteration_times(list(ddp.reducer.trace.events))
    origin = its[0].t0 if its else time.perf_counter()
    doc = {
        "traceEvents": chrome_events(its, bucket_infos(ddp), rank=rank, origin=origin),
        "displayTimeUnit": "ms",
        "otherData": {"gradring_rank": rank, "world_size": world,
                      "origin_unix_us": (origin + clock_offset()) * 1e6,
                      "clock": "perf_counter; ts relative to origin_unix_us"},
    }
    if hasattr(ddp, "comm") and hasattr(ddp, "module"):  # a gradring DDP, not a stand-in
        doc["otherData"]["gradring_explain"] = rank_record(ddp, curve)
    _write_whole(path, doc)
    return path


def _write_whole(path: str, doc: dict[str, Any]) -> None:
    """Write JSON so that a reader sees no file or the whole file, never half of
    one (another rank may be waiting for it in merge_traces); make the folder."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".trace-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def merge_traces(paths: Sequence[str], out: str, *, wait_s: float = 120.0) -> str:
    """Merge per-rank traces into one file on a shared time axis ([Note: trace clocks]).

    Each input keeps its pid (its rank); times are shifted so that the
    earliest rank's first event is at 0. Returns ``out``. Ranks write their
    traces at their own pace: a file not there yet is waited for, up to
    ``wait_s`` seconds (export_chrome_trace writes each file whole, so one that
    exists is complete); then the error names the missing files.
    """
    deadline = time.monotonic() + wait_s
    missing = [p for p in paths if not os.path.exists(p)]
    while missing and time.monotonic() < deadline:
        time.sleep(0.05)
        missing = [p for p in missing if not os.path.exists(p)]
    if missing:
        raise FileNotFoundError(f"merge_traces: after {wait_s:g}s these traces are still "
                                f"missing: {', '.join(missing)} (did every rank call "
                                "export_chrome_trace?)")
    docs = []
    for p in paths:
        with open(p) as f:
            docs.append(json.load(f))
    if not docs:
        raise ValueError("merge_traces needs at least one trace file")
    origins = [d.get("otherData", {}).get("origin_unix_us", 0.0) for d in docs]
    first = min(origins)
    events: list[dict[str, Any]] = []
    for d, o in zip(docs, origins):
        shift = o - first
        for e in d["traceEvents"]:
            if "ts" in e:
                e = {**e, "ts": round(e["ts"] + shift, 3)}
            events.append(e)
    merged = {"traceEvents": events, "displayTimeUnit": "ms",
              "otherData": {"ranks": [d.get("otherData", {}).get("gradring_rank") for d in docs],
                            "origin_unix_us": first,
                            "gradring_explain": [d["otherData"]["gradring_explain"]
                                                 for d in docs if "gradring_explain"
                                                 in d.get("otherData", {})],
                            "alignment": "per-rank wall-clock origin (time.time offset)"}}
    _write_whole(out, merged)
    return out
