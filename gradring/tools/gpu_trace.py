"""GPU lanes of a torch.profiler (Kineto) trace: kernels, and where the device's time went.

``read_kernels`` takes the ``traceEvents`` of a Chrome trace and returns its GPU
kernels, memory copies and memsets, each tied to the CPU time of the runtime call
that launched it (the trace's correlation ids). Over those kernels:

- ``device_breakdown``: on one device's timeline within a window, the time some
  compute kernel ran, the time some communication (NCCL) kernel ran, the
  communication time with no compute kernel beside it (exposed), and the time no
  kernel of any kind ran (idle);
- ``overlap_pct``: the share of the communication-kernel time during which a
  compute kernel also ran;
- ``phase_ms``: kernel time per phase of the CPU op that launched each kernel;
- ``assign_steps`` and ``step_windows``: the ProfilerStep each kernel was
  launched in, and each step's window on the device's timeline (the windows
  tile it, so per-step breakdowns add up to the whole); ``device_breakdowns``
  takes many windows at the cost of one.

[Note: kernel kinds as HTA counts them]
The figures are meant to agree with Holistic Trace Analysis (HTA, the
``holistictraceanalysis`` package), which users already run on these traces.
HTA sorts a device event by its name into one of four kinds:

- communication: the name starts with ``nccl`` and has ``Kernel`` later in it
  (``ncclKernel_AllReduce_...``, ``ncclDevKernel_...``);
- memory: the name starts with ``Memcpy``, ``Memset`` or ``dma``;
- other: the name has ``Memcpy`` or ``Sync`` anywhere in it;
- computation: every other kernel.

Each kind's intervals are merged over every stream of the device (a kernel on
stream 7 and one on stream 20 that overlap count once), so multiple streams
never add up to more than wall time. Idle is the time no event of any kind
runs: a memory copy keeps the device busy but is neither compute nor
communication. ``overlap_pct`` is HTA's ``get_comm_comp_overlap``: the measure of
(merged communication) intersected with (merged computation), over the measure of
merged communication. HTA's temporal breakdown (idle, compute, non-compute) is
``device_breakdown`` over the window from the first kernel's start to the last
kernel's end: its non-compute time is the window less compute less idle.

Two HTA conventions are the caller's to apply, not this module's: HTA leaves out
the kernels launched from the last ``ProfilerStep`` on (``kernels_before``
gives that set), and it rounds timestamps with nanosecond fractions inward to
whole microseconds (which shortens each kernel by up to a microsecond). Two
differences remain: HTA merges every device of a rank's file into one timeline
where this module keeps devices apart (``by_device``; a DDP rank drives one),
and HTA also counts as device activity any other event that carries a GPU
stream (a ``cuda_sync`` event's wait, for one), where this module reads
kernels, copies and memsets only. On HTA's own test traces
(tests/data/hta) the figures are equal once the timestamps are rounded as HTA
rounds them.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import re
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import numpy as np


class Kernel(NamedTuple):
    """One kernel, memory copy or memset on a GPU stream; times in microseconds."""

    start_us: float
    dur_us: float
    name: str
    stream: int
    device: int
    is_comm: bool
    launch_us: float | None
    correlation: int | None


# Kineto's categories for device activity; traces of older torch versions wrote
# them capitalised ("Kernel", "Memcpy", "Memset").
_DEVICE_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "memcpy", "memset"})

_COMM_NAME = re.compile(r"nccl.*Kernel")
_MEMORY_NAME = re.compile(r"Memcpy|Memset|dma")
_OTHER_NAME = re.compile(r".*(?:Memcpy|Sync)")

COMPUTE = "compute"
COMM = "comm"
MEMORY = "memory"
OTHER = "other"


@functools.lru_cache(maxsize=8192)  # a trace repeats a few hundred kernel names
def kernel_kind(name: str) -> str:
    """The kind of a device event by its name: "comm", "memory", "other" or "compute".

    See [Note: kernel kinds as HTA counts them].
    """
    if _COMM_NAME.match(name):
        return COMM
    if _MEMORY_NAME.match(name):
        return MEMORY
    if _OTHER_NAME.match(name):
        return OTHER
    return COMPUTE


_NEITHER, _DEVICE, _LAUNCH = 0, 1, 2


def _role(cat: object) -> int:
    """What an event of category ``cat`` is to ``read_kernels``."""
    if not isinstance(cat, str):
        return _NEITHER
    low = cat.lower()
    if low in _DEVICE_CATS:
        return _DEVICE
    # cuda_runtime / cuda_driver (and hip_*, "Runtime" in older traces): the CPU
    # side of a launch, carrying the correlation id the kernel carries.
    if low.endswith("runtime") or low.endswith("driver"):
        return _LAUNCH
    return _NEITHER


def _number(value: object, what: str, index: int, name: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"GPU event #{index} ({name!r}) has no numeric {what}: {value!r}")
    out = float(value)
    if out != out or out in (float("inf"), float("-inf")):
        raise ValueError(f"GPU event #{index} ({name!r}) has a {what} that is not finite")
    return out


def _int_or(value: object, default: int | None) -> int | None:
    if isinstance(value, bool):
        return default
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            return default
    return default


@contextlib.contextmanager
def _gc_paused():
    """Pause the cyclic garbage collector while building many acyclic objects.

    With a parsed trace of a million events alive, each collection the new
    objects trigger walks all of them: this halves ``read_kernels``' time on
    such a trace. Nothing built here holds a cycle, so nothing is left to leak.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def read_kernels(events: Sequence[dict]) -> list[Kernel]:
    """The GPU kernels, memory copies and memsets of a Chrome trace's ``traceEvents``.

    Each carries the CPU timestamp of the runtime call (``cudaLaunchKernel``,
    ``cudaMemcpyAsync``, ...) that has the same ``correlation`` id, or None where
    the trace holds no such call. Sorted by start time. An event of a device
    category without a numeric ``ts`` or ``dur`` raises ValueError naming it.
    """
    with _gc_paused():
        return _read_kernels(events)


def _read_kernels(events: Sequence[dict]) -> list[Kernel]:
    launches: dict[int, float] = {}
    found: list[tuple[int, dict]] = []
    roles: dict[object, int] = {}  # one look-up per event: most are CPU ops and flows
    for index, event in enumerate(events):
        if not isinstance(event, dict):
            continue
        cat = event.get("cat")
        try:
            role = roles[cat]
        except KeyError:
            role = roles[cat] = _role(cat)
        except TypeError:  # an unhashable "cat"
            continue
        if role == _NEITHER:
            continue
        if role == _DEVICE:
            if event.get("ph", "X") == "X":
                found.append((index, event))
            continue
        args = event.get("args")
        if isinstance(args, dict):
            corr = _int_or(args.get("correlation"), None)
            ts = event.get("ts")
            if corr is not None and isinstance(ts, (int, float)):
                launches[corr] = float(ts)
    kinds: dict[str, bool] = {}
    kernels: list[Kernel] = []
    for index, event in found:
        name = event.get("name")
        name = name if isinstance(name, str) else str(name)
        start = _number(event.get("ts"), "ts", index, name)
        dur = _number(event.get("dur"), "dur", index, name)
        if dur < 0:
            raise ValueError(f"GPU event #{index} ({name!r}) has a negative dur: {dur}")
        args = event.get("args")
        args = args if isinstance(args, dict) else {}
        stream = _int_or(args.get("stream"), None)
        if stream is None:
            stream = _int_or(event.get("tid"), -1)
        device = _int_or(args.get("device"), None)
        if device is None:
            device = _int_or(event.get("pid"), -1)
        corr = _int_or(args.get("correlation"), None)
        is_comm = kinds.get(name)
        if is_comm is None:
            is_comm = kinds[name] = kernel_kind(name) == COMM
        kernels.append(Kernel(start, dur, name, stream, device, is_comm,
                              launches.get(corr) if corr is not None else None, corr))
    kernels.sort(key=lambda k: k.start_us)
    return kernels


def by_device(kernels: Iterable[Kernel]) -> dict[int, list[Kernel]]:
    """The kernels grouped by device, each list in the order given."""
    out: dict[int, list[Kernel]] = {}
    for k in kernels:
        out.setdefault(k.device, []).append(k)
    return out


# ---- interval measure ------------------------------------------------------------

class _Intervals(NamedTuple):
    """Disjoint intervals sorted by start (microseconds)."""

    starts: np.ndarray
    ends: np.ndarray

    def measure(self) -> float:
        return float(np.sum(self.ends - self.starts))


def _merge(starts: np.ndarray, ends: np.ndarray) -> _Intervals:
    """The union of [starts[i], ends[i]) as disjoint sorted intervals, in O(n log n).

    Intervals that touch (one starts where another ends) are joined, as HTA does.
    """
    keep = ends > starts
    starts, ends = starts[keep], ends[keep]
    if starts.size == 0:
        empty = np.empty(0, dtype=np.float64)
        return _Intervals(empty, empty)
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], ends[order]
    reach = np.maximum.accumulate(ends)
    first = np.empty(starts.size, dtype=bool)
    first[0] = True
    first[1:] = starts[1:] > reach[:-1]
    heads = np.flatnonzero(first)
    tails = np.append(heads[1:] - 1, starts.size - 1)
    return _Intervals(starts[heads], reach[tails])


def _union(a: _Intervals, b: _Intervals) -> _Intervals:
    return _merge(np.concatenate([a.starts, b.starts]), np.concatenate([a.ends, b.ends]))


_CODES = {COMPUTE: 0, COMM: 1, MEMORY: 2, OTHER: 3}


class _Timeline:
    """One device's kernels as arrays sorted by start: the windows' figures come from
    binary searches, so many windows over one timeline cost O(n log n) in all."""

    def __init__(self, kernels: Sequence[Kernel]) -> None:
        n = len(kernels)
        starts = np.fromiter((k.start_us for k in kernels), dtype=np.float64, count=n)
        durs = np.fromiter((k.dur_us for k in kernels), dtype=np.float64, count=n)
        cache: dict[str, int] = {}
        kinds = np.empty(n, dtype=np.int8)
        for i, k in enumerate(kernels):
            if k.is_comm:  # a kernel the reader (or a caller) marked as communication
                kinds[i] = 1
                continue
            code = cache.get(k.name)
            if code is None:
                code = cache[k.name] = _CODES[kernel_kind(k.name)]
            kinds[i] = code
        order = np.argsort(starts, kind="stable")
        self.starts = starts[order]
        self.ends = self.starts + durs[order]
        self.kinds = kinds[order]
        self.longest = float(durs.max()) if n else 0.0

    def merged(self, lo: float | None = None,
               hi: float | None = None) -> dict[str, _Intervals]:
        """The merged intervals of compute, comm and every kernel, clipped to [lo, hi)."""
        first, last = 0, self.starts.size
        if hi is not None:
            last = int(np.searchsorted(self.starts, hi, side="left"))
        if lo is not None:  # nothing starting before lo - longest can reach lo
            first = min(last, int(np.searchsorted(self.starts, lo - self.longest, side="left")))
        starts, ends = self.starts[first:last], self.ends[first:last]
        kinds = self.kinds[first:last]
        if lo is not None:
            starts, ends = np.maximum(starts, lo), np.maximum(ends, lo)
        if hi is not None:
            ends = np.minimum(ends, hi)
        return {
            COMPUTE: _merge(starts[kinds == 0], ends[kinds == 0]),
            COMM: _merge(starts[kinds == 1], ends[kinds == 1]),
            "any": _merge(starts, ends),
        }

    def breakdown(self, lo: float, hi: float) -> dict[str, float]:
        if not hi >= lo:
            raise ValueError(f"device_breakdown: the window ends ({hi}) before it starts ({lo})")
        merged = self.merged(lo, hi)
        compute = merged[COMPUTE].measure()
        either = _union(merged[COMPUTE], merged[COMM]).measure()
        return {
            "compute_ms": compute / 1e3,
            "comm_ms": merged[COMM].measure() / 1e3,
            "exposed_comm_ms": (either - compute) / 1e3,
            "idle_ms": ((hi - lo) - merged["any"].measure()) / 1e3,
        }


# [Note: one timeline for many windows]
# A caller often asks for one window per step over the same list of a device's
# kernels. Sorting and classifying the list costs O(n log n) in Python each time,
# so a trace of many steps would cost O(steps x n). The timeline of the last list
# given is kept, with a copy of the list: a later call with a list equal to it
# (element by element, by identity first, in C) reuses it. A list changed in
# between compares unequal and is read afresh. device_breakdowns does the same
# without the kept copy.
_last_timeline: list = [None, None]  # [copy of the kernels, their _Timeline]


def _timeline_of(kernels: Sequence[Kernel]) -> _Timeline:
    copy, timeline = _last_timeline
    listed = kernels if isinstance(kernels, list) else list(kernels)
    if copy is not None and len(copy) == len(listed) and copy == listed:
        return timeline
    timeline = _Timeline(listed)
    _last_timeline[:] = [list(listed), timeline]
    return timeline


def device_breakdown(kernels: Sequence[Kernel], start_us: float,
                     end_us: float) -> dict[str, float]:
    """Where one device's time went within [start_us, end_us), in milliseconds.

    - ``compute_ms``: time some compute kernel ran (merged over streams);
    - ``comm_ms``: time some communication kernel ran;
    - ``exposed_comm_ms``: communication time during which no compute kernel ran;
    - ``idle_ms``: time no kernel, copy or memset ran.

    Pass the kernels of one device (see ``by_device``). Kernels reaching outside
    the window count only for their part inside it. Calls for several windows
    over the same list sort it once ([Note: one timeline for many windows]).
    """
    return _timeline_of(kernels).breakdown(start_us, end_us)


def device_breakdowns(kernels: Sequence[Kernel], windows: Iterable[tuple[float, float] | None]
                      ) -> list[dict[str, float] | None]:
    """``device_breakdown`` for each window (None stays None), sorting the kernels once."""
    timeline = _Timeline(kernels)
    return [None if w is None else timeline.breakdown(w[0], w[1]) for w in windows]


def overlap_pct(kernels: Sequence[Kernel]) -> float:
    """Percent of the merged communication-kernel time during which a compute kernel ran.

    HTA's ``get_comm_comp_overlap`` for one rank, over every kernel given. 0.0
    when no communication kernel ran (HTA gives NaN there).
    """
    merged = _Timeline(kernels).merged()
    comm = merged[COMM].measure()
    if comm <= 0.0:
        return 0.0
    compute = merged[COMPUTE].measure()
    both = comm + compute - _union(merged[COMPUTE], merged[COMM]).measure()
    return 100.0 * both / comm


def phase_ms(kernels: Sequence[Kernel], phase_at: Callable[[float], str]) -> dict[str, float]:
    """Kernel milliseconds per phase of the CPU op that launched each kernel.

    ``phase_at(launch_us)`` names the phase the CPU was in at the launch;
    kernels whose launch the trace does not hold go to "unknown". Durations are
    summed, not merged: two kernels of one phase on two streams count twice.
    """
    out: dict[str, float] = {}
    for k in kernels:
        phase = "unknown" if k.launch_us is None else phase_at(k.launch_us)
        out[phase] = out.get(phase, 0.0) + k.dur_us / 1e3
    return out


def device_window(kernels: Sequence[Kernel]) -> tuple[float, float] | None:
    """From the first kernel's start to the last kernel's end, or None without kernels."""
    if not kernels:
        return None
    return (min(k.start_us for k in kernels), max(k.start_us + k.dur_us for k in kernels))


def kernels_before(kernels: Iterable[Kernel], t_us: float) -> list[Kernel]:
    """The kernels launched (on the CPU) before ``t_us``; those of unknown launch are left out.

    HTA analyses the kernels launched before the last ``ProfilerStep`` began:
    ``kernels_before(kernels, last_step_start)`` is that set.
    """
    return [k for k in kernels if k.launch_us is not None and k.launch_us < t_us]


def assign_steps(kernels: Sequence[Kernel],
                 steps: Sequence[tuple[float, float]]) -> list[int | None]:
    """For each kernel, the index of the CPU step span [start, end) it was launched in.

    ``steps`` are sorted by start and do not overlap. None for a kernel launched
    outside every step, or whose launch the trace does not hold.
    """
    starts = np.array([s for s, _ in steps], dtype=np.float64)
    ends = np.array([e for _, e in steps], dtype=np.float64)
    launch = np.array([np.nan if k.launch_us is None else k.launch_us for k in kernels],
                      dtype=np.float64)
    idx = np.searchsorted(starts, launch, side="right") - 1
    ok = ~np.isnan(launch) & (idx >= 0)
    ok[ok] &= launch[ok] < ends[idx[ok]]
    return [int(i) if good else None for i, good in zip(idx.tolist(), ok.tolist())]


def step_windows(kernels: Sequence[Kernel],
                 steps: Sequence[tuple[float, float]]) -> list[tuple[float, float] | None]:
    """Each CPU step's window on the device's timeline.

    ``steps`` are the CPU spans [start, end) of the ``ProfilerStep``s, sorted by
    start. A kernel belongs to the step during which it was launched
    (``assign_steps``). A step's device window runs from the start of its first
    kernel to the start of the next step's first kernel (the last step's to the
    end of its last kernel), so the windows tile the device timeline and their
    breakdowns add up to the breakdown of the whole. None for a step that
    launched no kernel.
    """
    first: list[float | None] = [None] * len(steps)
    last: list[float | None] = [None] * len(steps)
    for k, i in zip(kernels, assign_steps(kernels, steps)):
        if i is None:
            continue
        end = k.start_us + k.dur_us
        first[i] = k.start_us if first[i] is None else min(first[i], k.start_us)
        last[i] = end if last[i] is None else max(last[i], end)
    out: list[tuple[float, float] | None] = []
    following: float | None = None
    for i in reversed(range(len(steps))):
        lo = first[i]
        if lo is None:
            out.append(None)
            continue
        hi = max(following, lo) if following is not None else last[i]
        out.append((lo, hi))
        following = lo
    out.reverse()
    return out
