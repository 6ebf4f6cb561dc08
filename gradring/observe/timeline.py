"""``gradring timeline``: draw a merged trace as a Gantt chart of compute and communication.

    gradring timeline merged.json -o timeline.png            # the last 3 iterations
    gradring timeline merged.json -o all.png --last 0        # every iteration in the file

The input is a Chrome trace written by ``gradring.observe.overlap.merge_traces`` (or
one rank's ``export_chrome_trace``). Each rank gets two lanes, like the
chapter's figure of the overlapped backward: *compute*, where the backward is cut at the moments
buckets became ready and each piece has its bucket's colour (the work that
produced that bucket's gradients), and *comm*, where each bucket's all-reduce
is drawn in the same colour. Whatever of the comm lane sticks out past the
end of the backward is the exposed communication; the hatched box on the
compute lane (``finalize``) is the time ``backward()`` spent waiting for it and
copying the results into ``.grad``. See docs/overlap.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

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


def draw_timeline(trace: str | dict[str, Any], out: str, *, last: int = 3,
                  title: str | None = None) -> str:
    """Render ``trace`` (a path or a loaded Chrome-trace dict) to the image ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
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
    fig, ax = plt.subplots(figsize=(12, max(2.5, fig_h)))
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
    for x, _it in starts:
        ax.axvline(x, color="#888888", linestyle=":", linewidth=0.8)
    for x, text in iteration_labels(starts, max((e["ts"] + e["dur"] - t0) / 1e3 for e in spans)):
        ax.text(x, top + 0.2, text, fontsize=7, va="bottom", color="#555555")
    ax.set_yticks(yticks, ylabels)
    ax.set_xlabel("time (ms)")
    ax.set_title(title or "gradring: backward compute vs bucket all-reduce")
    handles = [Patch(facecolor=colour[b], label=f"bucket {b}") for b in buckets[:20]]
    handles += [Patch(facecolor=REST_COLOUR, label="rest of backward"),
                Patch(facecolor="none", edgecolor=FINALIZE_COLOUR, hatch="///",
                      label="after backward: wait + copy to .grad")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8,
              frameon=False)
    ax.grid(axis="x", linewidth=0.3, alpha=0.5)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gradring timeline", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace",
                    help="merged Chrome-trace JSON (gradring.observe.overlap.merge_traces)")
    ap.add_argument("-o", "--output", default="timeline.png", help="image to write (PNG)")
    ap.add_argument("--last", type=int, default=3,
                    help="draw the newest N iterations (0: all; default 3)")
    ap.add_argument("--title", default=None)
    a = ap.parse_args(argv)
    try:
        draw_timeline(a.trace, a.output, last=a.last, title=a.title)
    except (OSError, ValueError, KeyError) as exc:
        print(f"gradring timeline: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {a.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
