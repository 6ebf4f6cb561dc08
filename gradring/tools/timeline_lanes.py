"""The vocabulary of ``gradring timeline``: the phases a step is tiled into, their colours
and rows, and the report a drawing is made from. gradring's record (timeline.py) and
torch.profiler traces (profile_timeline.py) both fill a :class:`TimelineReport`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from gradring.observe.overlap import ExposedComm

# ------------------------------------------------------------------ phases of the step
#: The phases a step is cut into, in drawing order, and their colours. Every instant of
#: a step (one forward's start to the next one's) belongs to exactly one of them; they
#: are explain's rows ([Note: the step breakdown] in explain.py), with its exposed comm
#: shown as its two kinds of time: waiting for peers, and a collective running.
PHASES = ("forward", "backward", "exposed: waiting for peers", "exposed: collective running",
          "copy into .grad", "optimizer", "other")
PHASE_COLOUR = {"forward": "#4c72b0", "backward": "#55a868",
                "exposed: waiting for peers": "#e5ae38",
                "exposed: collective running": "#c44e52", "copy into .grad": "#8172b2",
                "optimizer": "#64b5cd", "other": "#e8e8e8"}
#: explain's rows (RankStep fields) that make up each phase.
PHASE_ROWS = {"forward": ("forward",), "backward": ("backward",),
              "exposed: waiting for peers": ("wait",),
              "exposed: collective running": ("last_bucket", "earlier_buckets"),
              "copy into .grad": ("copy",), "optimizer": ("optimizer",), "other": ("other",)}
#: The comm lane's all-reduces: a hue no phase of the step lane uses, alternating
#: shades so that neighbouring buckets stay apart.
COMM_COLOURS = ("#8c6d46", "#c9a66b")
#: The GPU lane's kernels, by kind (gpu_trace.kernel_kind).
GPU_COLOUR = {"compute": "#2f4b7c", "comm": "#d45087", "memory": "#ffa600", "other": "#999999"}
#: What "other" holds (it is labelled so in the legend and the report).
OTHER_MEANS = "other: loss, zero_grad, data, autograd before the first gradient, gaps"
#: Up to this many iterations the timeline draws every event; beyond, a summary.
GANTT_MAX = 8
#: The summary draws at most this many bars per rank (iterations binned beyond it).
SUMMARY_MAX_BARS = 64


class Segment(NamedTuple):
    """One piece of one rank's step: ``phase`` from ``t0`` to ``t1`` (seconds, the rank's
    own clock); ``bucket`` is the bucket whose gradients a backward piece produced (-1:
    none, or work after the last bucket was ready)."""

    iteration: int
    phase: str
    t0: float
    t1: float
    bucket: int = -1


def _tile(f0: float, f1: float, marked: Sequence[tuple[int, float, float, str, int]]
          ) -> list[tuple[float, float, str, int]]:
    """Cut [f0, f1) into pieces, each taking the highest-priority mark covering it (lower
    number first), "other" where none does; neighbours with one label merge."""
    cuts = sorted({f0, f1, *(min(max(x, f0), f1) for m in marked for x in m[1:3])})
    out: list[tuple[float, float, str, int]] = []
    for a, b in zip(cuts, cuts[1:]):
        if b <= a:
            continue
        mid = (a + b) / 2
        cover = [m for m in marked if m[1] <= mid < m[2]]
        label, bucket = (min(cover)[3], min(cover)[4]) if cover else ("other", -1)
        if out and out[-1][2] == label and out[-1][3] == bucket and out[-1][1] == a:
            out[-1] = (out[-1][0], b, label, bucket)
        else:
            out.append((a, b, label, bucket))
    return out


class TimelineReport(NamedTuple):
    """What ``timeline_report`` found: how the image is drawn and what each rank's step is."""

    mode: str                                      # "gantt" (every event) or "summary"
    iterations: list[int]                          # drawn (common to every rank)
    segments: dict[int, dict[int, list[Segment]]]  # rank -> iteration -> its tiled step
    offsets: dict[int, float]                      # rank -> clock offset (s) to the wall clock
    exposed: dict[int, ExposedComm]                # rank -> [Note: exposed communication]
    phase_ms: dict[int, dict[str, float]]          # rank -> phase -> mean ms over the drawn steps
    step_ms: dict[int, float]                      # rank -> mean step over the drawn steps
    comm: dict[int, list[tuple[int, int, float, float]]]  # rank -> (it, bucket, start, done)
    #: rank -> the device's kernels (start s, end s, kind) on GPU traces of torch.profiler
    gpu: dict[int, list[tuple[float, float, str]]] = {}
    #: where the figures agree: "overlap_stats() and gradring explain" for gradring's record
    agrees_with: str = "overlap_stats() and gradring explain"

    def shares(self, rank: int) -> dict[str, float]:
        """Each phase's share of the drawn steps on ``rank`` (sums to 1)."""
        whole = self.step_ms[rank] or 1.0
        return {k: v / whole for k, v in self.phase_ms[rank].items()}

    def drawn_phases(self) -> list[str]:
        """The phases that take any time in the drawn steps, in ``PHASES`` order."""
        seen = {s.phase for per in self.segments.values() for it in self.iterations
                for s in per[it] if s.t1 > s.t0}
        return [p for p in PHASES if p in seen]

    @property
    def text(self) -> str:
        lines = [f"timeline: {len(self.iterations)} iteration(s) drawn as "
                 + ("every event" if self.mode == "gantt" else
                    "a summary (one bar per iteration or bin, and the mean step)")]
        for rank in sorted(self.segments):
            ex = self.exposed[rank]
            lines.append(f"rank {rank}: exposed communication {ex.ms:.2f} ms/step (mean over "
                         f"{len(ex.iterations)} step(s), as {self.agrees_with}); the drawn "
                         f"steps: mean {self.step_ms[rank]:.2f} ms")
            shares = self.shares(rank)
            lines.append("  " + ", ".join(f"{k} {shares[k]:.0%}" for k in PHASES))
        lines.append(f"({OTHER_MEANS})")
        return "\n".join(lines)
