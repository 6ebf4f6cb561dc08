"""``gradring timeline``: draw a merged trace: every phase of the step, and the buckets.

From the step records a trace carries (``gradring.observe.overlap.merge_traces``
or one rank's ``export_chrome_trace``), every instant of a step (one forward's
start to the next one's) is cut into one of ``PHASES`` (``step_segments``):
explain's rows ([Note: the step breakdown] in explain.py), with the exposed
communication drawn as its two kinds of time, waiting for peers and a
collective running. Up to ``GANTT_MAX`` steps each rank gets two lanes: the
*step*, with the backward split where each bucket's gradients became ready,
and *comm*, each bucket's all-reduce from start to done, in colours no phase
uses. Longer runs are drawn as a summary: one stacked bar per step (or bin of
steps) and the mean step, in a figure of fixed size. The command also prints
each rank's exposed communication, the figure of [Note: exposed
communication] in ``overlap.py``, and each phase's share of the drawn steps.
Traces without step records (a stand-in DDP) get the backward and bucket
lanes alone. See docs/overlap.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from gradring.observe.overlap import (
    exposed_comm,
    forward_starts,
    iteration_times,
    mean,
    split_exposed,
    steady_steps,
    step_bounds,
)
from gradring.observe.trace import Event
from gradring.tools.timeline_lanes import (  # noqa: F401  (re-exported: timeline.GANTT_MAX ...)
    COMM_COLOURS,
    GANTT_MAX,
    GPU_COLOUR,
    OTHER_MEANS,
    PHASE_COLOUR,
    PHASE_ROWS,
    PHASES,
    SUMMARY_MAX_BARS,
    Segment,
    TimelineReport,
    _tile,
)

REST_COLOUR = "#c8c8c8"      # backward after the last bucket was ready
FINALIZE_COLOUR = "#333333"  # the tail after the backward: exposed communication + copies


def _load(trace: str | dict[str, Any]) -> list[dict[str, Any]]:
    if isinstance(trace, dict):
        return list(trace["traceEvents"])
    with open(trace) as f:
        doc = json.load(f)
    return list(doc["traceEvents"] if isinstance(doc, dict) else doc)


def _bucket_of(e: dict[str, Any]) -> int | None:
    b = e.get("args", {}).get("bucket")
    return int(b) if b is not None else None


def select_iterations(events: Sequence[dict[str, Any]], last: int) -> list[dict[str, Any]]:
    """The complete-span events of the newest ``last`` iterations all ranks have (0: all)."""
    spans = [e for e in events if e.get("ph") == "X" and "iteration" in e.get("args", {})]
    per_rank: dict[Any, set[int]] = {}
    for e in spans:
        per_rank.setdefault(e["pid"], set()).add(e["args"]["iteration"])
    if not per_rank:
        return []
    common = sorted(set.intersection(*per_rank.values()))
    keep = set(common[-last:] if last > 0 else common)
    return [e for e in spans if e["args"]["iteration"] in keep]


def iteration_labels(starts: Sequence[tuple[float, int]], width: float,
                     min_gap: float = 0.04) -> list[tuple[float, str]]:
    """Labels for the iteration starts ``(x, iteration)`` on an axis ``width`` wide: one
    every time the previous label is at least ``min_gap`` of the width away, so that
    with many short iterations (``--last 0``) labels thin out instead of colliding."""
    out: list[tuple[float, str]] = []
    last = float("-inf")
    for x, it in sorted(starts):
        if x - last >= min_gap * max(width, 1e-9):
            out.append((x, f" it {it}"))
            last = x
    return out


def step_segments(events: Sequence[Event], gates: dict[tuple[int, int], float] | None = None
                  ) -> dict[int, list[Segment]]:
    """Iteration -> its step tiled into ``PHASES``, for the steps explain summarises
    (``explain_record.rank_steps``; ``gates`` as there).

    Where marks overlap, the first of these wins: waiting for peers, a collective
    running after the backward (the pieces of ``overlap.split_exposed``), the
    backward, the forward, the optimizer, copying into .grad (the rest of
    ``backward()`` after autograd), then "other". Each phase's length is explain's
    row of the same step."""
    from gradring.tools.explain_record import _first_after, _gates_ms, _sorted_times

    fwd = forward_starts(events)
    fwd_e = _sorted_times(events, "forward_end")
    opt_s, opt_e = _sorted_times(events, "optimizer_start"), _sorted_times(events, "optimizer_end")
    out: dict[int, list[Segment]] = {}
    for it in steady_steps(events):
        bounds = step_bounds(it, fwd)
        if bounds is None:
            continue
        f0, f1 = bounds
        t0, back, written = it.t0, it.t0 + it.backward_ms / 1e3, it.end
        fe = _first_after(fwd_e, f0, t0) or f0
        at = lambda ms, t0=t0: t0 + ms / 1e3  # noqa: E731
        marks: list[tuple[int, float, float, str, int]] = []
        for piece in split_exposed(it, _gates_ms(it, gates)):
            marks.append((0 if piece.waiting else 1, at(piece.t0), at(piece.t1),
                          PHASES[2] if piece.waiting else PHASES[3], piece.bucket))
        prev = 0.0
        for b in sorted(it.buckets, key=lambda x: x.ready):
            end = min(max(b.ready, prev), it.backward_ms)
            marks.append((2, at(prev), at(end), "backward", b.bucket))
            prev = end
        marks.append((2, at(prev), back, "backward", -1))
        marks.append((3, f0, fe, "forward", -1))
        for s in opt_s:
            if written <= s < f1:
                e = _first_after(opt_e, s, f1)
                if e is not None:
                    marks.append((4, s, e, "optimizer", -1))
        marks.append((5, back, written, "copy into .grad", -1))
        out[it.iteration] = [Segment(it.iteration, label, a, b, bucket)
                             for a, b, label, bucket in _tile(f0, f1, marks)]
    return out


def _records(doc: Any) -> list[dict[str, Any]]:
    other = doc.get("otherData", {}) if isinstance(doc, dict) else {}
    got = other.get("gradring_explain")
    if not got:
        return []
    return list(got) if isinstance(got, list) else [got]


def timeline_report(trace: str | dict[str, Any], last: int = 3) -> TimelineReport | None:
    """Every rank's steps tiled into phases, from the step records in ``trace`` (None
    when it carries none: traces of stand-ins, or written before the records)."""
    from gradring.tools.explain_record import all_rank_steps, launched_by_all, record_events

    if isinstance(trace, dict):
        doc = trace
    else:
        with open(trace) as f:
            doc = json.load(f)
    records = _records(doc)
    if not records:
        return None
    events = record_events(records)
    offset = {r["rank"]: float(r.get("clock_offset", 0.0)) for r in records}
    gates = launched_by_all(records, events)
    segs = {rank: step_segments(evs, gates[rank] or None) for rank, evs in events.items()}
    steps = all_rank_steps(records)
    common = sorted(set.intersection(*(set(v) for v in segs.values())))
    chosen = common[-last:] if last > 0 else common
    if not chosen:
        return None
    phase_ms: dict[int, dict[str, float]] = {}
    step_ms: dict[int, float] = {}
    for rank, per in steps.items():
        drawn = [s for s in per if s.iteration in set(chosen)]
        phase_ms[rank] = {p: mean([sum(getattr(s, k) for k in PHASE_ROWS[p]) for s in drawn])
                          for p in PHASES}
        step_ms[rank] = mean([s.step for s in drawn])
    comm = {r: [(it.iteration, b.bucket, it.t0 + b.start / 1e3, it.t0 + b.done / 1e3)
                for it in iteration_times(events[r]) if it.iteration in set(chosen)
                for b in it.buckets] for r in events}
    return TimelineReport("gantt" if len(chosen) <= GANTT_MAX else "summary", chosen,
                          {r: {it: segs[r][it] for it in chosen} for r in segs}, offset,
                          {r: exposed_comm(steady_steps(events[r])) for r in events},
                          phase_ms, step_ms, comm)


def draw_timeline(trace: str | dict[str, Any], out: str, *, last: int = 3,
                  title: str | None = None) -> str:
    """Render ``trace`` (a path or a loaded Chrome-trace dict) to the image ``out``:
    every phase of the newest ``last`` steps (0: all), as a Gantt chart up to
    ``GANTT_MAX`` steps and as a summary beyond (``timeline_report`` says which)."""
    report = timeline_report(trace, last)
    if report is None:
        return _draw_spans(trace, out, last=last, title=title)
    return draw_report(report, out, title)


def draw_report(report: TimelineReport, out: str, title: str | None = None) -> str:
    """Render a ``TimelineReport`` to the image ``out`` (a Gantt chart or a summary)."""
    fig = gantt_figure(report, title) if report.mode == "gantt" else \
        summary_figure(report, title)
    import matplotlib.pyplot as plt

    try:
        _save(fig, out, dpi=120 if report.mode == "gantt" else 100)
    finally:
        plt.close(fig)
    return out


def _save(fig: Any, out: str, dpi: int) -> None:
    """Write ``fig`` to the image ``out`` without following a link planted there (see
    [Note: output files in folders other users can reach] in safe_files.py);
    the format is the name's extension (PNG without one)."""
    from gradring.safe_files import open_output

    ext = os.path.splitext(out)[1].lstrip(".").lower()
    if ext and ext not in fig.canvas.get_supported_filetypes():
        raise ValueError(f"{out}: matplotlib cannot write .{ext} images")
    with open_output(out, "wb") as f:
        fig.savefig(f, dpi=dpi, format=ext or "png")


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _legend(fig: Any, phases: Sequence[str], extra: Sequence[Any] = ()) -> Any:
    """The figure's legend, right of the plot: ``extra`` entries, then ``phases``."""
    from matplotlib.patches import Patch

    names = {"other": OTHER_MEANS}
    handles = list(extra) + [Patch(facecolor=PHASE_COLOUR[p], edgecolor="#999999",
                                   label=names.get(p, p)) for p in phases]
    return fig.legend(handles=handles, loc="outside right upper", fontsize=8, frameon=False)


def _label_iterations(ax: Any, starts: Sequence[tuple[float, int]], width: float) -> None:
    """Dotted lines at the iterations' starts, labelled on an axis of their own above the
    plot, where the layout keeps the title clear of them (``iteration_labels`` thins
    them out so that they never collide with each other)."""
    for x, _it in starts:
        ax.axvline(x, color="#888888", linestyle=":", linewidth=0.8)
    labels = iteration_labels(starts, width)
    top = ax.secondary_xaxis("top")
    top.set_xticks([x for x, _ in labels], [t.strip() for _, t in labels], fontsize=7,
                   color="#555555")
    top.tick_params(length=0, pad=2)
    top.set_gid("iteration labels")


def gantt_figure(report: TimelineReport, title: str | None = None) -> Any:
    """Two lanes per rank: the step cut into its phases (the backward split where each
    bucket's gradients were ready, each piece labelled with its bucket where it fits) and
    each bucket's all-reduce, in the comm colours, labelled the same way."""
    plt = _pyplot()
    from matplotlib.patches import Patch

    ranks = sorted(report.segments)
    wall = {r: [(s.t0 + report.offsets[r], s.t1 + report.offsets[r], s)
                for it in report.iterations for s in report.segments[r][it]] for r in ranks}
    t0 = min(a for r in ranks for a, _, _ in wall[r])
    t_end = max(b for r in ranks for _, b, _ in wall[r])
    width = (t_end - t0) * 1e3
    min_label = 0.025 * width  # narrower pieces go unlabelled
    lane_h, gap = 0.8, 0.6
    lanes = 3 if report.gpu else 2
    fig_h = 1.6 + len(ranks) * lanes * (lane_h + 0.25) + (len(ranks) - 1) * gap
    fig, ax = plt.subplots(figsize=(13, max(3.0, fig_h)), layout="constrained")
    yticks, ylabels = [], []
    for i, rank in enumerate(ranks):
        base = (len(ranks) - 1 - i) * (lanes * (lane_h + 0.25) + gap)
        if report.gpu:
            y_gpu, base = base, base + lane_h + 0.25
            yticks.append(y_gpu + lane_h / 2)
            ylabels.append(f"rank {rank} GPU")
            for a, b, kind in report.gpu.get(rank, []):
                ax.broken_barh([((a + report.offsets[rank] - t0) * 1e3, (b - a) * 1e3)],
                               (y_gpu, lane_h), facecolors=GPU_COLOUR.get(kind, "#999999"),
                               edgecolor="none", gid=f"gpu:{kind}")
        y_comm, y_comp = base, base + lane_h + 0.25
        yticks += [y_comp + lane_h / 2, y_comm + lane_h / 2]
        ylabels += [f"rank {rank} step", f"rank {rank} comm"]
        for a, b, s in wall[rank]:
            x, w = (a - t0) * 1e3, (b - a) * 1e3
            ax.broken_barh([(x, w)], (y_comp, lane_h), facecolors=PHASE_COLOUR[s.phase],
                           edgecolor="white" if s.phase == "backward" else "none",
                           linewidth=0.6, gid=f"phase:{s.phase}")
            if s.phase == "backward" and s.bucket >= 0 and w >= min_label:
                ax.text(x + w / 2, y_comp + lane_h / 2, f"b{s.bucket}", fontsize=6,
                        ha="center", va="center", color="white")
        for _it, b, a, d in report.comm[rank]:
            x, w = (a + report.offsets[rank] - t0) * 1e3, (d - a) * 1e3
            ax.broken_barh([(x, w)], (y_comm, lane_h),
                           facecolors=COMM_COLOURS[b % len(COMM_COLOURS)], edgecolor="black",
                           linewidth=0.4, gid=f"comm:bucket {b}")
            if w >= min_label:
                ax.text(x + w / 2, y_comm + lane_h / 2, f"b{b}", fontsize=6, ha="center",
                        va="center", color="black")
    top = len(ranks) * lanes * (lane_h + 0.25) + (len(ranks) - 1) * gap
    ax.set_ylim(-0.3, top + 0.2)
    starts = [((min(s.t0 for s in report.segments[ranks[0]][it]) + report.offsets[ranks[0]]
                - t0) * 1e3, it) for it in report.iterations]
    _label_iterations(ax, starts, width)
    ax.set_yticks(yticks, ylabels)
    ax.set_xlabel("time (ms)")
    ex = report.exposed[ranks[0]]
    ax.set_title(title or f"gradring: every phase of the step; rank {ranks[0]}'s exposed "
                 f"communication {ex.ms:.2f} ms/step")
    comm = Patch(facecolor=COMM_COLOURS[0], edgecolor="black",
                 label="comm lane: a bucket's all-reduce, start to done (bN: bucket N)")
    gpu = [Patch(facecolor=c, label=f"GPU lane: {k} kernel") for k, c in GPU_COLOUR.items()
           if report.gpu and any(x[2] == k for v in report.gpu.values() for x in v)]
    _legend(fig, report.drawn_phases(), [comm, *gpu])
    ax.grid(axis="x", linewidth=0.3, alpha=0.5)
    return fig


def summary_figure(report: TimelineReport, title: str | None = None) -> Any:
    """Per rank, one stacked bar per iteration (bins of iterations beyond
    ``SUMMARY_MAX_BARS``: their mean per phase), then the mean step's bar (each phase's
    mean over the drawn steps). The figure's size does not grow with the run."""
    plt = _pyplot()

    ranks = sorted(report.segments)
    its = report.iterations
    per_bin = -(-len(its) // SUMMARY_MAX_BARS)
    bins = [its[k:k + per_bin] for k in range(0, len(its), per_bin)]
    fig, axes = plt.subplots(len(ranks), 1, figsize=(13, 1.2 + 2.4 * len(ranks)), squeeze=False,
                             layout="constrained")
    for ax, rank in zip(axes[:, 0], ranks):
        rows = []
        for group in bins:
            acc = dict.fromkeys(PHASES, 0.0)
            for it in group:
                for s in report.segments[rank][it]:
                    acc[s.phase] += (s.t1 - s.t0) * 1e3 / len(group)
            rows.append(acc)
        rows.append(dict(report.phase_ms[rank]))
        xs = list(range(len(bins))) + [len(bins) + 1]
        bottom = [0.0] * len(rows)
        for phase in PHASES:
            h = [r[phase] for r in rows]
            ax.bar(xs, h, bottom=bottom, color=PHASE_COLOUR[phase], width=0.85,
                   edgecolor="none", gid=f"phase:{phase}")
            bottom = [b + v for b, v in zip(bottom, h)]
        # a few descheduled steps must not flatten the rest: clip at 3 mean steps, say so
        top = 3 * report.step_ms[rank]
        if max(bottom) > top > 0:
            ax.set_ylim(0, top * 1.08)
            for x, total in zip(xs, bottom):
                if total > top:
                    ax.text(x, top * 1.01, f"{total:.0f}", fontsize=6, ha="center",
                            va="bottom", color="#444444")
        labels = [str(g[0]) if per_bin == 1 else f"{g[0]}-{g[-1]}" for g in bins]
        step = max(1, len(bins) // 16)
        ax.set_xticks([x for x in xs[:-1]][::step] + [xs[-1]],
                      labels[::step] + ["mean"], fontsize=7)
        ex = report.exposed[rank]
        ax.set_ylabel(f"rank {rank}\nms per step")
        ax.set_title(f"rank {rank}: exposed communication {ex.ms:.2f} ms/step (mean over "
                     f"{len(ex.iterations)} steps), mean step of those drawn "
                     f"{report.step_ms[rank]:.2f} ms", fontsize=9)
        ax.grid(axis="y", linewidth=0.3, alpha=0.5)
    _legend(fig, report.drawn_phases())
    axes[-1, 0].set_xlabel("iteration" + ("" if per_bin == 1 else f" (bins of {per_bin})"))
    fig.suptitle(title or f"gradring: {len(its)} steps, every phase per step")
    return fig


def _draw_spans(trace: str | dict[str, Any], out: str, *, last: int = 3,
                title: str | None = None) -> str:
    """The backward and bucket spans alone: traces that carry no step record."""
    plt = _pyplot()
    from matplotlib.patches import Patch

    spans = select_iterations(_load(trace), last)
    if not spans:
        raise ValueError("the trace holds no complete gradring iterations")
    t0 = min(e["ts"] for e in spans)
    ranks = sorted({e["pid"] for e in spans})
    buckets = sorted({b for e in spans if (b := _bucket_of(e)) is not None})
    cmap = plt.get_cmap("tab10" if len(buckets) <= 10 else "tab20")
    colour = {b: cmap(i % cmap.N) for i, b in enumerate(buckets)}
    lane_h, gap = 0.8, 0.6
    fig_h = 1.2 + len(ranks) * 2 * (lane_h + 0.25) + (len(ranks) - 1) * gap
    fig, ax = plt.subplots(figsize=(12, max(3.0, fig_h)), layout="constrained")
    yticks, ylabels = [], []
    starts: list[tuple[float, int]] = []  # rank 0's backward starts, to label iterations
    for i, rank in enumerate(ranks):
        base = (len(ranks) - 1 - i) * (2 * (lane_h + 0.25) + gap)
        y_comm, y_comp = base, base + lane_h + 0.25
        yticks += [y_comp + lane_h / 2, y_comm + lane_h / 2]
        ylabels += [f"rank {rank} compute", f"rank {rank} comm"]
        for e in spans:
            if e["pid"] != rank:
                continue
            x, w = (e["ts"] - t0) / 1e3, e["dur"] / 1e3
            name, b = e["name"], _bucket_of(e)
            if name.startswith("gradring::grads_for_bucket"):
                ax.broken_barh([(x, w)], (y_comp, lane_h), facecolors=colour[b],
                               edgecolor="white", linewidth=0.3)
            elif name == "gradring::backward_rest":
                ax.broken_barh([(x, w)], (y_comp, lane_h), facecolors=REST_COLOUR)
            elif name == "gradring::finalize":
                ax.broken_barh([(x, w)], (y_comp, lane_h), facecolors="none",
                               edgecolor=FINALIZE_COLOUR, hatch="///", linewidth=0.8)
            elif name.startswith("gradring::bucket_all_reduce"):
                ax.broken_barh([(x, w)], (y_comm, lane_h), facecolors=colour[b],
                               edgecolor="black", linewidth=0.4)
            if name == "gradring::backward":
                if rank == ranks[0]:
                    starts.append((x, e["args"]["iteration"]))
                end = x + w
                ax.plot([end, end], [y_comm - 0.1, y_comp + lane_h + 0.1], color="black",
                        linewidth=0.9)
    top = len(ranks) * 2 * (lane_h + 0.25) + (len(ranks) - 1) * gap
    ax.set_ylim(-0.3, top + 0.2)
    _label_iterations(ax, starts, max((e["ts"] + e["dur"] - t0) / 1e3 for e in spans))
    ax.set_yticks(yticks, ylabels)
    ax.set_xlabel("time (ms)")
    ax.set_title(title or "gradring: backward compute vs bucket all-reduce")
    handles = [Patch(facecolor=colour[b], label=f"bucket {b}") for b in buckets[:20]]
    handles += [Patch(facecolor=REST_COLOUR, label="rest of backward"),
                Patch(facecolor="none", edgecolor=FINALIZE_COLOUR, hatch="///",
                      label="after backward: wait + copy to .grad")]
    fig.legend(handles=handles, loc="outside right upper", fontsize=8, frameon=False)
    ax.grid(axis="x", linewidth=0.3, alpha=0.5)
    try:
        _save(fig, out, dpi=120)
    finally:
        plt.close(fig)
    return out


def parser() -> argparse.ArgumentParser:
    """``gradring timeline``'s command line."""
    from gradring.tools.helpfmt import command_parser

    ap = command_parser(
        "gradring timeline",
        "Draw a training run's steps as a picture: per rank, one lane for what the "
        "training thread does (forward, backward, waiting for communication, copying "
        "gradients, optimizer) and one for each bucket's all-reduce. A few steps are "
        "drawn event by event; many as one stacked bar per step. Also prints each "
        "rank's exposed communication and each phase's share of the step.",
        [("gradring timeline run/trace.json -o timeline.png",
          "the last 3 steps of a merged trace"),
         ("gradring timeline run/trace.json -o all.png --last 0",
          "every step in the file, as a summary when there are more than 8")],
        "The trace comes from gradring.observe.overlap.export_chrome_trace (one rank) "
        "and merge_traces (all ranks); `gradring demo` writes one. See docs/overlap.md.")
    ap.add_argument("trace", help="a merged trace (JSON) or one rank's trace")
    ap.add_argument("-o", "--output", default="timeline.png", metavar="FILE",
                    help="image to write; its extension picks the format")
    ap.add_argument("--last", type=int, default=3, metavar="N",
                    help="draw the newest N steps; 0 draws every step in the file")
    ap.add_argument("--title", default=None, metavar="TEXT",
                    help="the picture's title (default: one naming rank 0's exposed "
                         "communication)")
    from gradring.tools.trace_file import add_limit_flag
    add_limit_flag(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if a.last < 0:
        print("gradring timeline: --last must be 0 (every step) or more", file=sys.stderr)
        return 2
    from gradring.tools.trace_file import TraceFileError, read_json
    try:
        from gradring.tools.profile_timeline import load_model, profile_timeline_report
        from gradring.tools.read_profiler import ProfilerTraceError
        from gradring.tools.trace_file import trace_files

        try:
            files = trace_files(a.trace)
        except TraceFileError:
            files = [a.trace]  # read_json says what is wrong with it
        try:
            model = load_model(files, a.max_trace_bytes)
        except ProfilerTraceError as exc:
            print(f"gradring timeline: {exc}", file=sys.stderr)
            return 2
        if model is not None:  # a torch.profiler trace: explain's reader, the same lanes
            report = profile_timeline_report(model, a.last)
            draw_report(report, a.output, a.title)
            print(report.text)
            print(f"wrote {a.output}")
            return 0
        doc = read_json(a.trace, max_bytes=a.max_trace_bytes)
        draw_timeline(doc, a.output, last=a.last, title=a.title)
        report = timeline_report(doc, a.last)
    except TraceFileError as exc:
        print(f"gradring timeline: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError, KeyError) as exc:
        print(f"gradring timeline: {exc}", file=sys.stderr)
        return 1
    if report is not None:
        print(report.text)
    print(f"wrote {a.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
