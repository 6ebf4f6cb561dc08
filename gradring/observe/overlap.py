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
  collective *runs* from ``start_k = max(launch_k, done_{k-1})`` to ``done_k``;
  ``start_k - launch_k`` is time queued behind the previous bucket.
- ``comm_ms``      = the length of the union of the in-flight intervals: the
  wall time during which at least one collective was running.
- ``exposed_ms``   = the part of that union after backward_end: the
  communication the backward did not hide. When every launch precedes
  backward_end, that part is one interval, up to the last done. When the
  buckets wait for the end of the backward (no core free for the comm
  thread, see [Note: overlap needs a free core] in ``reducer/overlap_policy.py``),
  it is the sum of their runs, without the write-back between them.
  Communication "before" the backward (launched before backward_start) cannot
  happen in a synchronised iteration and is not counted.
- ``overlap_ratio`` = (comm_ms - exposed_ms) / comm_ms: the hidden fraction of
  the communication (1.0 when nothing was communicated).
- ``tail_ms``      = last written - backward_end: everything ``backward()`` spent
  after autograd finished (waiting for collectives *and* copying the reduced
  buckets into ``.grad``); ``tail_ms >= exposed_ms``.

Only complete iterations count (both backward marks and, for every launched
bucket, its done time). Summaries are medians over the *steady* iterations
(``steady_iterations``): every complete iteration whose bucket layout equals
the newest one's, leaving out iteration 0 when later ones exist (the
iteration before the bucket rebuild, and the first one, which also pays for
connecting the transport, must not blur the table), the newest ``last_n`` of
them when ``last_n`` > 0, all of those still in the ring buffer by default
(``STEADY_LAST_N``). A median shrugs off the odd step in which the OS
descheduled a rank -- common on a shared CPU machine, where a mean of ten
steps can exceed the median step time.

[Note: exposed communication]
One definition, in one function (``exposed_comm``), read by every report:
``ddp.overlap_stats()["exposed_ms"]``, the demo's "exposed communication",
``gradring explain``'s "exposed comm" row and ``gradring timeline``'s report.
Per rank: the median, over that rank's steady iterations, of each
iteration's ``exposed_ms`` (the in-flight time of collectives after
backward_end, defined above). Each report computes it from the same events,
the reducer's own ``perf_counter`` times (``record.rank_record`` keeps them
as they are, with the rank's clock offset beside them), so for one run and
one rank they give the same float. explain splits the figure into parts (waiting for
peers, the last bucket, earlier buckets), but those are medians of their own
and need not add up to it; the row above them is this figure.

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

import contextlib
import json
import os
import statistics
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


def _union_length(intervals: Iterable[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


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
        buckets.append(BucketTimes(b, ms(ready), ms(launch), ms(start), ms(done),
                                   float("nan") if written is None else ms(written)))
    last_done = max(x.done for x in buckets)
    written_all = [x.written for x in buckets if x.written == x.written]
    last_written = max(written_all) if written_all else last_done
    back = ms(be)
    return IterationTimes(
        iteration=it, t0=bs, backward_ms=back,
        comm_ms=_union_length((x.launch, x.done) for x in buckets),
        exposed_ms=_union_length((max(x.launch, back), x.done) for x in buckets
                                 if x.done > back),
        tail_ms=max(0.0, last_written - back),
        buckets=tuple(buckets),
    )


def _layout(it: IterationTimes) -> tuple[int, ...]:
    return tuple(b.bucket for b in it.buckets)


#: How many of the newest steady iterations the reports take; 0: every one recorded.
STEADY_LAST_N = 0


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
    """The iterations every report summarises (see [Note: what the overlap numbers
    mean]): same layout as the newest, iteration 0 left out, the newest ``last_n``
    (0: all)."""
    return recent(iterations, last_n)


class ExposedComm(NamedTuple):
    """The exposed communication of one rank ([Note: exposed communication])."""

    ms: float                            # median over the steady iterations
    iterations: tuple[int, ...]          # which iterations
    per_iteration_ms: tuple[float, ...]  # each one's exposed_ms, in that order


def exposed_comm(iterations: Sequence[IterationTimes],
                 last_n: int = STEADY_LAST_N) -> ExposedComm:
    """The one definition of exposed communication ([Note: exposed communication]):
    the median of ``exposed_ms`` over ``steady_iterations(iterations, last_n)``."""
    chosen = steady_iterations(iterations, last_n)
    per = tuple(it.exposed_ms for it in chosen)
    return ExposedComm(statistics.median(per) if per else 0.0,
                       tuple(it.iteration for it in chosen), per)


class BucketInfo(NamedTuple):
    """What the stats say about a bucket besides its timings."""

    nbytes: int
    params: tuple[str, ...]


def summarize(iterations: Sequence[IterationTimes], buckets: Sequence[BucketInfo] = (),
              last_n: int = STEADY_LAST_N) -> dict[str, Any]:
    """Medians over the steady iterations (newest ``last_n``; 0: all), plus a per-bucket table.

    ``buckets[k]`` describes bucket k (its size and parameter names); buckets
    without an entry get ``nbytes`` 0 and no names. Keys are documented in
    docs/overlap.md; all times are milliseconds.
    """
    chosen = steady_iterations(iterations, last_n)
    if not chosen:
        return {"iterations": 0, "backward_ms": 0.0, "comm_ms": 0.0, "exposed_ms": 0.0,
                "tail_ms": 0.0, "overlap_ratio": 1.0, "exposed_per_iteration_ms": [],
                "exposed_iterations": [], "buckets": []}
    med = statistics.median
    exposed = exposed_comm(iterations, last_n)
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
            "ready_ms": med([r.ready for r in rows]),
            "ready_to_launch_ms": med([r.wait_ms for r in rows]),
            "queued_ms": med([r.queue_ms for r in rows]),
            "run_ms": med([r.run_ms for r in rows]),
            "launch_to_done_ms": med([r.flight_ms for r in rows]),
            "finished_before_backward_end": 2 * hidden > len(rows),
            "hidden_fraction": hidden / len(rows),
        })
    return {
        "iterations": len(chosen),
        "backward_ms": med([it.backward_ms for it in chosen]),
        "comm_ms": med([it.comm_ms for it in chosen]),
        "exposed_ms": exposed.ms,
        "tail_ms": med([it.tail_ms for it in chosen]),
        "overlap_ratio": med([it.overlap_ratio for it in chosen]),
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
    """``summarize`` over a gradring DDP model's trace (what ``ddp.overlap_stats()`` returns),
    with ``launch_when_ready`` and ``launch_why``: whether buckets were launched as
    they became ready or all at the end of the backward, and why (see [Note:
    overlap needs a free core] in ``gradring/reducer/overlap_policy.py``)."""
    stats = summarize(iteration_times(list(ddp.reducer.trace.events)), bucket_infos(ddp), last_n)
    stats["launch_when_ready"] = bool(getattr(ddp.reducer, "launches_when_ready", True))
    stats["launch_why"] = str(getattr(ddp.reducer, "overlap_why", ""))
    return stats


def format_table(stats: dict[str, Any], *, max_names: int = 3) -> str:
    """The per-bucket table of ``summarize``'s result as fixed-width text."""
    head = (f"{'bucket':>6} {'KiB':>9} {'ready':>8} {'wait':>7} {'queued':>7} {'run':>7} "
            f"{'hidden':>6}  params")
    lines = [head]
    for b in stats["buckets"]:
        names = b["params"]
        shown = ", ".join(names[:max_names]) + (f", +{len(names) - max_names}"
                                                if len(names) > max_names else "")
        lines.append(f"{b['bucket']:>6} {b['nbytes'] / 1024:>9.1f} {b['ready_ms']:>8.2f} "
                     f"{b['ready_to_launch_ms']:>7.2f} {b['queued_ms']:>7.2f} {b['run_ms']:>7.2f} "
                     f"{b['hidden_fraction']:>6.0%}  {shown}")
    lines.append("(ms from backward start; wait = ready->launch, queued = launch->start, "
                 "run = start->done; hidden = finished before backward end)")
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
