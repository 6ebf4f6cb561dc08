"""The trace model ``gradring explain`` analyses: what one DDP run did, step by step, per rank.

Two readers fill it: ``read_profiler`` from torch.profiler Chrome traces (torch's
DDP or gradring's, gloo or NCCL, CPU or CUDA) and, for gradring's own step
record, ``tools/explain_record.py``'s record reader. ``analysis`` turns it into an
``Explanation``. Plain data: nothing here reads files or measures.

Times are microseconds on the rank's own clock; ``RankTrace.offset_us`` puts a rank
on the common clock (``[Note: aligning ranks]`` in ``read_profiler.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

#: A finding's predicted saving must reach both of these to be reported.
MIN_SAVING_MS = 0.1
MIN_SAVING_FRACTION = 0.02


class Finding(NamedTuple):
    """One finding of ``gradring explain``: what to change and what it saves per step."""

    key: str           # find_unused | bucket_cap | last_bucket | comm_hook | bucket_view |
                       # forward_sync_buffers | straggler | first_bucket |
                       # gradring_collectives
    title: str
    change: str
    saving_ms: float
    evidence: str


#: The rows of a step; per rank and step they add up to ``step``.
STEP_ROWS = ("forward", "backward", "exposed_comm", "copy", "optimizer", "other")
#: The parts of ``exposed_comm``; they add up to it.
EXPOSED_ROWS = ("wait", "last_bucket", "earlier_buckets")


class BucketRun(NamedTuple):
    """One bucket's all-reduce in one step of one rank."""

    index: int                      # launch order in the backward, from 0
    nbytes: int | None              # from the op's input dims / message size; None: unknown
    launch_us: float                # when this rank launched it
    done_us: float | None           # when it finished on this rank, where the trace says
    exposed: tuple[tuple[float, float], ...]  # the spans the rank waited for it after autograd
    events: tuple[str, ...]         # the event names it was read from


class Grad(NamedTuple):
    """One parameter's gradient as autograd produced it (``AccumulateGrad``)."""

    nbytes: int
    ready_us: float


class StepTrace(NamedTuple):
    """One ``ProfilerStep#N`` of one rank, cut into spans (all us, this rank's clock)."""

    number: int
    start_us: float
    end_us: float
    forward_ms: float
    backward_start_us: float
    backward_end_us: float
    tail_end_us: float              # the last write into .grad (or the last collective)
    copy_ms: float
    optimizer_ms: float
    search_ms: float                # find_unused_parameters' graph walk
    broadcast_ms: float             # the buffer broadcast before the forward
    buckets: tuple[BucketRun, ...]
    grads: tuple[Grad, ...]
    forward_us: tuple[tuple[float, float], ...] = ()    # the DDP forward span(s)
    optimizer_us: tuple[tuple[float, float], ...] = ()  # the optimizer.step() spans
    #: find_unused_parameters' used-parameter map: its launch's own time and the waiting
    #: for it after the buckets' collectives ended (ms; part of exposed comm)
    map_ms: float = 0.0


@dataclass
class RankTrace:
    rank: int
    host: str
    steps: list[StepTrace]
    offset_us: float = 0.0           # add to this rank's times for the common clock
    kernels: list[Any] = field(default_factory=list)   # gpu_trace.Kernel, on GPU traces
    events: list[dict[str, Any]] = field(default_factory=list)  # the raw events, for GPU work
    files: list[str] = field(default_factory=list)


@dataclass
class TraceModel:
    source: str                      # "torch.profiler" | "gradring"
    ddp: str                         # "torch" | "gradring"
    device: str                      # "cpu" | "cuda"
    backend: str                     # "gloo" | "nccl" | ...
    world_size: int
    ranks: dict[int, RankTrace]
    facts: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
