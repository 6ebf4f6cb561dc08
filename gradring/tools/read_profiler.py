"""Read torch.profiler Chrome traces of a DDP run into the trace model.

Works on what ``torch.profiler`` writes for torch's DDP and for gradring's
(``export_chrome_trace`` or ``tensorboard_trace_handler``, one file per rank or
one file), gloo or NCCL, CPU or CUDA. docs/explain.md lists which events make
each row.

[Note: the events of a profiled DDP step]
A step is a ``ProfilerStep#N`` span (``prof.step()``). Inside it, on the
rank's threads:

- forward: the ``DistributedDataParallel.forward`` span (torch) or
  ``gradring::forward`` (gradring); inside it ``c10d::broadcast_`` (the buffer
  broadcast) and ``torch.distributed.ddp.reducer::search_unused_parameters``
  (find_unused_parameters' walk). A trace without the forward span (older
  torch) counts the forward from the step's start to the backward's start.
- backward: from the first to the end of the last
  ``autograd::engine::evaluate_function: ...`` after the forward (any thread:
  on CUDA autograd runs on its own thread).
- the tail: after autograd, DDP waits for the buckets' collectives and copies
  results into ``.grad`` (``torch.distributed.ddp.reducer::copy_bucket_to_grad``;
  gradring: ``gradring::bucket_wait#k`` and ``gradring::bucket_write_grads#k``).
  It ends with the last copy (or, without copies, the last collective's end).
  copy = the copy spans in it; exposed comm = the rest of it.
- buckets: each all-reduce launched in the backward (``c10d::allreduce_``, or
  ``gradring::bucket_all_reduce#k``) is one bucket, in launch order; its
  collective is the next ``gloo:all_reduce`` / ``nccl:all_reduce`` span after the
  launch, whose end is when it finished (gradring: the end of its
  ``bucket_wait#k``). Its bytes come from the input dims and type, or the
  ``In msg nelems`` and ``dtype`` arguments. An all-reduce of integers is
  find_unused_parameters' used-parameter map, not a bucket.
- optimizer: ``Optimizer.step#...`` spans after the tail.
- gradients: each ``torch::autograd::AccumulateGrad`` in the backward is one
  parameter's gradient, ready at its end, its bytes from its input dims.

[Note: aligning ranks]
Ranks on different hosts have different clocks. A collective ends at the
same moment on every rank, so each rank's offset is the median, over the
collectives both ranks recorded (step number and bucket index), of the
reference rank's end minus its own. Where the trace gives no collective's end
(gradring's shared-memory collectives), ranks of one host share the clock and
other hosts' are left as they are, with a note.
"""

from __future__ import annotations

import bisect
import math
import re
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from gradring.tools.trace_model import BucketRun, Grad, RankTrace, StepTrace, TraceModel

STEP_PREFIX = "ProfilerStep#"
FORWARD_NAMES = ("DistributedDataParallel.forward", "gradring::forward")
AUTOGRAD_PREFIX = "autograd::engine::evaluate_function"
COPY_NAMES = ("torch.distributed.ddp.reducer::copy_bucket_to_grad",)
GRADRING_COPY = "gradring::bucket_write_grads#"
GRADRING_WAIT = "gradring::bucket_wait#"
GRADRING_LAUNCH = "gradring::bucket_all_reduce#"
TORCH_LAUNCH = "c10d::allreduce_"
COMM_NAMES = ("gloo:all_reduce", "nccl:all_reduce")
OPTIMIZER_PREFIX = "Optimizer.step#"
SEARCH_NAME = "torch.distributed.ddp.reducer::search_unused_parameters"
BROADCAST_NAMES = ("c10d::broadcast_", "gradring::broadcast_buffers")
#: The broadcast's collective itself (the forward waits for it).
BROADCAST_COMMS = ("gloo:broadcast", "nccl:broadcast")
ACCUMULATE = "torch::autograd::AccumulateGrad"
PARAM_COMMS = "record_param_comms"

#: Bytes per element of the type names traces use.
_DTYPE_BYTES = {"float": 4, "float32": 4, "double": 8, "float64": 8, "c10::half": 2,
                "half": 2, "float16": 2, "c10::bfloat16": 2, "bfloat16": 2, "int": 4,
                "int32": 4, "long int": 8, "long": 8, "int64": 8, "short int": 2,
                "signed char": 1, "unsigned char": 1, "bool": 1, "byte": 1, "char": 1}
_INT_TYPES = ("int", "long", "short", "char", "bool", "byte")

HOW_TO_STEP = ("call prof.step() after every training step, inside torch.profiler.profile("
               "schedule=torch.profiler.schedule(wait=1, warmup=2, active=6), "
               "on_trace_ready=torch.profiler.tensorboard_trace_handler(DIR))")


class ProfilerTraceError(ValueError):
    """A torch.profiler trace that explain cannot read; the message is one line."""


class _Span:
    __slots__ = ("name", "ts", "end", "tid", "args")

    def __init__(self, name: str, ts: float, dur: float, tid: Any, args: dict[str, Any]) -> None:
        self.name, self.ts, self.end, self.tid, self.args = name, ts, ts + dur, tid, args


def is_profiler_trace(doc: Any) -> bool:
    """Whether ``doc`` looks like a torch.profiler Chrome trace (and not gradring's record)."""
    if isinstance(doc, list):
        return any(isinstance(e, dict) and str(e.get("name", "")).startswith(STEP_PREFIX)
                   for e in doc[:100000])
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        return False
    other = doc.get("otherData")
    if isinstance(other, dict) and "gradring_explain" in other:
        return False
    return True


def _events(doc: Any) -> list[dict[str, Any]]:
    evs = doc.get("traceEvents") if isinstance(doc, dict) else doc
    return [e for e in evs if isinstance(e, dict)] if isinstance(evs, list) else []


def _spans(events: Iterable[dict[str, Any]]) -> list[_Span]:
    out = []
    for e in events:
        if e.get("ph") != "X":
            continue
        try:
            ts, dur = float(e["ts"]), float(e.get("dur", 0.0))
        except (KeyError, TypeError, ValueError):
            continue
        if not (math.isfinite(ts) and math.isfinite(dur)) or dur < 0:
            continue
        if str(e.get("cat", "")).lower() in ("kernel", "gpu_memcpy", "gpu_memset",
                                              "gpu_user_annotation"):
            continue  # device-side: gpu_trace reads these
        args = e.get("args")
        out.append(_Span(str(e.get("name", "")), ts, dur, e.get("tid"),
                         args if isinstance(args, dict) else {}))
    out.sort(key=lambda s: (s.ts, -s.end))
    return out


def _union_ms(intervals: Iterable[tuple[float, float]], lo: float = -math.inf,
              hi: float = math.inf) -> float:
    """Length (ms) of the union of ``intervals`` (us) clipped to [lo, hi]."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted((max(s, lo), min(e, hi)) for s, e in intervals):
        if e <= s:
            continue
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total / 1e3


def _dtype_bytes(name: Any) -> int | None:
    if not isinstance(name, str):
        return None
    return _DTYPE_BYTES.get(name.strip().lower())


def _numel(dims: Any) -> int | None:
    """Elements of the first tensor in an ``Input Dims`` entry ([n, m] or [[n, m]])."""
    while isinstance(dims, list) and dims and isinstance(dims[0], list):
        dims = dims[0]
    if not isinstance(dims, list) or not all(isinstance(d, int) for d in dims):
        return None
    n = 1
    for d in dims:
        n *= d
    return n


def _is_int_op(s: _Span) -> bool:
    types = s.args.get("Input type")
    t = types[0] if isinstance(types, list) and types else s.args.get("dtype")
    return isinstance(t, str) and any(k in t.lower() for k in _INT_TYPES) and \
        "float" not in t.lower()


def _op_bytes(*spans: _Span | None) -> int | None:
    """Bytes of a collective's tensor, from any of its spans' arguments."""
    numel, size = None, None
    for s in spans:
        if s is None:
            continue
        a = s.args
        if isinstance(a.get("In msg nelems"), int):
            numel = numel or a["In msg nelems"]
            size = size or _dtype_bytes(a.get("dtype"))
        dims = a.get("Input Dims")
        if isinstance(dims, list) and dims:
            numel = numel or _numel(dims[0])
        types = a.get("Input type")
        if isinstance(types, list) and types:
            size = size or _dtype_bytes(types[0])
    if numel is None:
        return None
    return numel * (size or 4)


def _launch_numel(s: _Span) -> int | None:
    dims = s.args.get("Input Dims")
    return _numel(dims[0]) if isinstance(dims, list) and dims else None


def _comm_numel(s: _Span) -> int | None:
    if isinstance(s.args.get("In msg nelems"), int):
        return int(s.args["In msg nelems"])
    return _launch_numel(s)


def _index_of(name: str, prefix: str) -> int | None:
    m = re.fullmatch(re.escape(prefix) + r"(\d+)", name)
    return int(m.group(1)) if m else None


def _read_step(number: int, s0: float, s1: float, spans: Sequence[_Span],
               main_tid: Any) -> StepTrace | None:
    """One step ([Note: the events of a profiled DDP step]); None without a backward.
    ``spans``: the spans that start in [s0, s1), in start order."""
    inside = spans
    fwd = [s for s in inside if s.name in FORWARD_NAMES]
    auto = [s for s in inside if s.name.startswith(AUTOGRAD_PREFIX)]
    if fwd:
        fwd_end = max(s.end for s in fwd)
        auto = [s for s in auto if s.ts >= fwd_end]
    if not auto:
        return None
    opt_all = [s for s in inside if s.name.startswith(OPTIMIZER_PREFIX)]
    b0 = min(s.ts for s in auto)
    # autograd ends before the first optimizer step that follows it
    opt_after = [s.ts for s in opt_all if s.ts > b0]
    limit = min(opt_after) if opt_after else s1
    auto = [s for s in auto if s.ts < limit]
    b1 = max(s.end for s in auto)
    forward_ms = _union_ms([(s.ts, s.end) for s in fwd]) if fwd else (b0 - s0) / 1e3
    copies = [s for s in inside if (s.name in COPY_NAMES or s.name.startswith(GRADRING_COPY))
              and b1 - 1 <= s.ts < limit]
    waits = {k: s for s in inside if s.name.startswith(GRADRING_WAIT)
             and (k := _index_of(s.name, GRADRING_WAIT)) is not None and b0 <= s.ts < limit}
    # the buckets: launches during the backward (and its tail), in order
    launches: list[tuple[int, _Span]] = []
    gradring_launch = [s for s in inside if s.name.startswith(GRADRING_LAUNCH) and b0 <= s.ts]
    if gradring_launch:
        for s in gradring_launch:
            k = _index_of(s.name, GRADRING_LAUNCH)
            if k is not None and s.ts < limit:
                launches.append((k, s))
    else:
        for s in inside:
            if s.name == TORCH_LAUNCH and b0 <= s.ts < limit:
                launches.append((len(launches), s))
    comms = [s for s in inside if s.name in COMM_NAMES and s.tid != main_tid and s.ts >= b0]
    if not gradring_launch:
        comms_main = [s for s in inside if s.name in COMM_NAMES and s.ts >= b0]
    else:
        comms_main = []
    params = [s for s in inside if s.name == PARAM_COMMS and s.ts >= b0]
    runs: list[tuple[int, _Span, _Span | None, int | None, float | None]] = []
    maps: list[tuple[float, float, float | None]] = []
    used: set[int] = set()
    for k, launch in launches:
        comm = None
        if not gradring_launch:
            # the collective's own span: the first unused one from the launch on, of the
            # launch's size (the profiler drops some of these spans: a launch whose span
            # is missing must not take the next bucket's)
            want = _launch_numel(launch)
            for i, c in enumerate(comms):
                if i in used or c.ts < launch.ts - 1:
                    continue
                got = _comm_numel(c)
                if want is None or got is None or got == want:
                    comm, _ = c, used.add(i)
                    break
        nested = [c for c in comms_main + params if launch.ts <= c.ts <= launch.end]
        if comm is not None and _is_int_op(comm) or any(_is_int_op(c) for c in nested):
            # find_unused_parameters' used-parameter map
            maps.append((launch.ts, launch.end, comm.end if comm is not None else None))
            continue
        nbytes = _op_bytes(comm, *nested, launch)
        if gradring_launch:
            w = waits.get(k)
            done = w.end if w is not None else None
        else:
            done = comm.end if comm is not None and comm.tid != main_tid else None
        runs.append((k, launch, comm, nbytes, done))
    copy_end = max((s.end for s in copies), default=b1)
    dones = [d for *_, d in runs if d is not None]
    tail_end = copy_end if copies else max([b1] + [d for d in dones if d < limit])
    tail_end = max(tail_end, max((s.end for s in waits.values()), default=b1))
    tail_end = min(max(tail_end, b1), limit if limit > b1 else s1)
    copy_ms = _union_ms([(s.ts, s.end) for s in copies], b1, tail_end)
    # the waiting spans of the tail: not autograd, not copying
    gaps = _gaps(b1, tail_end, [(s.ts, s.end) for s in copies])
    buckets = []
    prev_done = -math.inf
    gap_ends = [b for _, b in gaps]  # gaps are sorted and apart: so are their ends
    ordered = sorted(runs, key=lambda r: r[1].ts)
    for j, (_k, launch, comm, nbytes, done) in enumerate(ordered):
        last = j == len(ordered) - 1
        # waiting ends with this bucket's end; a bucket whose end the trace lost takes
        # none of it (the next bucket with a known end, or the last, takes it)
        hi = math.inf if last else prev_done if done is None else max(done, prev_done)
        lo_i = bisect.bisect_left(gap_ends, prev_done)  # gaps ending before it: none
        picked = []
        for a, b in gaps[lo_i:]:
            if a >= hi:
                break
            if min(b, hi) > max(a, prev_done):
                picked.append((max(a, prev_done), min(b, hi)))
        mine = tuple(picked)
        if done is not None:
            prev_done = max(prev_done, done)
        names = (launch.name,) + ((comm.name,) if comm is not None else ())
        buckets.append(BucketRun(j, nbytes, launch.ts, done, mine, names))
    opt_ms = _union_ms([(s.ts, s.end) for s in opt_all if s.ts >= tail_end - 1])
    search_ms = _union_ms([(s.ts, s.end) for s in inside if s.name == SEARCH_NAME])
    bcast = [s for s in inside if (s.name in BROADCAST_NAMES or s.name in BROADCAST_COMMS)
             and any(f.ts <= s.ts <= f.end for f in fwd)]
    bcast_ms = _union_ms([(s.ts, s.end) for s in bcast])
    grads = tuple(Grad(n, s.end) for s in inside if s.name == ACCUMULATE and b0 <= s.ts < b1
                  for n in [_op_bytes(s)] if n)
    if buckets and grads and all(b.nbytes is None for b in buckets):
        buckets = _bytes_from_grads(buckets, grads)
    fwd_spans = tuple((s.ts, s.end) for s in fwd) if fwd else ((s0, b0),)
    # the map's cost: its launch on the training thread, and the waiting in the tail after
    # the buckets' last end until the map's end
    map_ms = sum((e - a) / 1e3 for a, e, _ in maps)
    ends = [d for _, _, d in maps if d is not None]
    if ends and dones:
        lo, hi = max(max(dones), b1), min(max(ends), tail_end)
        map_ms += sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in gaps) / 1e3
    opt_spans = tuple((s.ts, s.end) for s in opt_all if s.ts >= tail_end - 1)
    return StepTrace(number, s0, s1, forward_ms, b0, b1, tail_end, copy_ms, opt_ms,
                     search_ms, bcast_ms, tuple(buckets), grads, fwd_spans, opt_spans, map_ms)


def _bytes_from_grads(buckets: list[BucketRun], grads: Sequence[Grad]) -> list[BucketRun]:
    """Buckets' bytes where their events carry none (gradring's): each gradient belongs to
    the first bucket launched when it was ready or later (a bucket launches once its last
    gradient is ready), the last bucket taking the rest."""
    got = [0] * len(buckets)
    for g in grads:
        k = next((b.index for b in buckets if b.launch_us >= g.ready_us - 1), buckets[-1].index)
        got[k] += g.nbytes
    return [b._replace(nbytes=got[b.index] or None) for b in buckets]


def _gaps(lo: float, hi: float, busy: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    out, t = [], lo
    for s, e in sorted(busy):
        if s > t:
            out.append((t, min(s, hi)))
        t = max(t, e)
        if t >= hi:
            break
    if t < hi:
        out.append((t, hi))
    return [(a, b) for a, b in out if b > a]


def read_rank(doc: Any, path: str, fallback_rank: int) -> tuple[int, RankTrace, dict[str, Any]]:
    """One rank's file: (rank, its steps, what the file says about the run)."""
    events = _events(doc)
    info = doc.get("distributedInfo") if isinstance(doc, dict) else None
    info = info if isinstance(info, dict) else {}
    rank = info.get("rank", fallback_rank)
    rank = rank if isinstance(rank, int) else fallback_rank
    spans = _spans(events)
    steps_spans = [s for s in spans if s.name.startswith(STEP_PREFIX)]
    if not steps_spans:
        raise ProfilerTraceError(f"{path}: a torch.profiler trace without ProfilerStep spans, "
                                 f"so explain cannot tell where steps start: {HOW_TO_STEP}")
    main_tid = steps_spans[0].tid
    steps = []
    starts = [s.ts for s in spans]  # sorted: each step reads its own slice
    for s in steps_spans:
        number = _index_of(s.name, STEP_PREFIX)
        window = spans[bisect.bisect_left(starts, s.ts):bisect.bisect_left(starts, s.end)]
        st = _read_step(number if number is not None else len(steps), s.ts, s.end, window,
                        main_tid)
        if st is not None:
            steps.append(st)
    names = {s.name for s in spans}
    gradring = any(n.startswith("gradring::") for n in names)
    ddp = any(n in FORWARD_NAMES or n in COPY_NAMES or n.startswith(GRADRING_LAUNCH)
              for n in names) or any(st.buckets for st in steps)
    device = "cuda" if any(str(e.get("cat", "")).lower() == "kernel" for e in events) \
        else "cpu"
    meta = {"backend": str(info.get("backend", "") or ""),
            "world_size": info.get("world_size") if isinstance(info.get("world_size"), int)
            else None,
            "ddp": "gradring" if gradring else "torch", "has_ddp": ddp, "device": device,
            "find_unused": SEARCH_NAME in names,
            "broadcast": any(st.broadcast_ms > 0 for st in steps),
            "copies": any(n in COPY_NAMES or n.startswith(GRADRING_COPY) for n in names),
            "has_step_spans": True}
    host = str(doc.get("host_name", "")) if isinstance(doc, dict) else ""
    return rank, RankTrace(rank, host, steps, events=events if device == "cuda" else [],
                           files=[path]), meta


def read_profiler(docs: Sequence[tuple[str, Any]]) -> TraceModel:
    """The trace model of a run from its files' parsed JSON ((path, doc) per file)."""
    ranks: dict[int, RankTrace] = {}
    metas = []
    for i, (path, doc) in enumerate(docs):
        rank, rt, meta = read_rank(doc, path, i)
        if rank in ranks:
            raise ProfilerTraceError(f"{path}: rank {rank} appears in two files "
                                     f"({ranks[rank].files[0]} and {path}); give one run's "
                                     "files")
        ranks[rank] = rt
        metas.append(meta)
    if not any(m["has_ddp"] for m in metas):
        raise ProfilerTraceError(
            f"{docs[0][0]}: this trace holds no DDP step (no DistributedDataParallel.forward, "
            "no bucket all-reduce, no copy into .grad): explain reads runs of torch's or "
            "gradring's DistributedDataParallel")
    if not any(rt.steps for rt in ranks.values()):
        raise ProfilerTraceError(f"{docs[0][0]}: no ProfilerStep holds a DDP backward: profile "
                                 f"whole training steps ({HOW_TO_STEP})")
    m0 = metas[0]
    model = TraceModel("torch.profiler", m0["ddp"], m0["device"], m0["backend"],
                       m0["world_size"] or len(ranks), ranks,
                       facts={"find_unused": any(m["find_unused"] for m in metas),
                              "broadcast": any(m["broadcast"] for m in metas),
                              "copies": any(m["copies"] for m in metas)})
    align_clocks(model)
    return model


def align_clocks(model: TraceModel) -> None:
    """Set each rank's ``offset_us`` ([Note: aligning ranks])."""
    ranks = sorted(model.ranks)
    if len(ranks) < 2:
        return
    ref = model.ranks[ranks[0]]

    def ends(rt: RankTrace) -> dict[tuple[int, int], float]:
        return {(st.number, b.index): b.done_us for st in rt.steps for b in st.buckets
                if b.done_us is not None}

    ref_ends = ends(ref)
    trusted = model.ddp == "torch" and model.device == "cpu"
    hosts = {model.ranks[r].host for r in ranks}
    for r in ranks[1:]:
        rt = model.ranks[r]
        mine = ends(rt)
        diffs = [ref_ends[k] - mine[k] for k in mine if k in ref_ends]
        if trusted and diffs:
            rt.offset_us = statistics.median(diffs)
    if not trusted and len(hosts) > 1:
        model.notes.append("the ranks ran on different hosts and the trace gives no "
                           "collective's end to align their clocks on: waiting for peers "
                           "is measured on unaligned clocks")
