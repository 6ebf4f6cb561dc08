"""One rank's record of a live DDP: the facts explain needs and its events.

``facts_of`` reads the settings and sizes of a rank's DDP as plain data;
``rank_record`` adds the rank's trace events on the wall clock. ``explain``
analyses such records gathered from every rank, and
``overlap.export_chrome_trace`` stores its rank's record in the trace file
so ``gradring explain`` can read it back.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from gradring.step_model import has_free_core

if TYPE_CHECKING:
    from gradring.step_model import CommCurve

_CLOCK_OFFSET: float | None = None


def clock_offset() -> float:
    """``time.time() - time.perf_counter()``, sampled once per process ([Note:
    trace clocks] in ``overlap.py``)."""
    global _CLOCK_OFFSET
    if _CLOCK_OFFSET is None:
        # Bracket time.time() between two perf_counter reads and keep the
        # tightest of a few tries: a rank descheduled between the two reads
        # would otherwise be misaligned by a whole time slice.
        best = None
        for _ in range(7):
            a = time.perf_counter()
            wall = time.time()
            b = time.perf_counter()
            if best is None or b - a < best[0]:
                best = (b - a, wall - (a + b) / 2)
        _CLOCK_OFFSET = best[1]
    return _CLOCK_OFFSET


def facts_of(ddp: Any) -> dict[str, Any]:
    """The settings and sizes explain's findings need, from one rank's DDP (plain data)."""
    r = ddp.reducer
    comm = ddp.comm
    outside = r.grad_bytes_outside_buckets()
    buffers = [(n, b.numel() * b.element_size(), int(b._version))
               for n, b in ddp.module.named_buffers()]
    mode = getattr(r.mode, "name", str(r.mode))
    return {
        "rank": comm.rank, "world_size": comm.world_size,
        "device": str(ddp.device),
        "find_unused": bool(ddp.find_unused_parameters) and mode == "FIND_UNUSED",
        "unused_last": len(r.unused_in_last_forward()),
        "static_graph": bool(ddp.static_graph),
        "bucket_view": bool(ddp.gradient_as_bucket_view),
        "comm_hook": "" if r.comm_hook is None else
        getattr(r.comm_hook, "__qualname__", type(r.comm_hook).__name__),
        "sync_buffers": bool(ddp.forward_sync_buffers),
        "buffers": buffers,
        "num_forward": int(r.num_forward),
        "bucket_cap_bytes": int(r.bucket_cap_bytes),
        "sizes": [p.numel() * p.element_size() for p in r.params],
        "keys": [f"{p.dtype}/{p.device}" for p in r.params],
        "names": list(r.names),
        "bucket_params": [list(b.param_indices) for b in r.buckets],
        "bucket_bytes": [int(b.nbytes) for b in r.buckets],
        "grad_bytes_outside_buckets": int(outside),
        # bucket_cap_mb="auto": why it chose the cap ([Note: one rule for picking a cap])
        "auto_cap_why": str(getattr(getattr(r, "auto_cap", None), "why", "") or ""),
        # Whether a core was free for the collectives ([Note: auto on a host with no
        # free core] in reducer/autocap.py): explain then picks a cap as auto would.
        "free_core": has_free_core(comm, [p.device for p in r.params]),
    }


def rank_record(ddp: Any, curve: CommCurve | None = None) -> dict[str, Any]:
    """This rank's events, its facts and an optional measured curve.

    The events keep the reducer's own ``perf_counter`` times, the very floats
    ``ddp.overlap_stats()`` reads, so every report computes the same exposed
    time from them ([Note: exposed communication] in ``overlap.py``);
    ``clock_offset`` puts them on the wall clock, to line the ranks up. (Adding
    the offset first would round each time to about 0.2 us, the spacing of
    doubles near 1.7e9 seconds, and the figures would differ in the last digits.)"""
    return {"rank": ddp.comm.rank, "facts": facts_of(ddp),
            "events": [list(e) for e in list(ddp.reducer.trace.events)],
            "clock_offset": clock_offset(),
            "curve": None if curve is None else {"sizes": list(curve.sizes),
                                                 "times_ms": list(curve.times_ms)}}
