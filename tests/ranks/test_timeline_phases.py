"""``gradring timeline`` draws every phase of the step (forward, backward, waiting for
peers, exposed communication, copies into .grad, optimizer, a labelled "other"), and
long runs as a summary whose size does not grow with the run."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from gradring.observe.overlap import export_chrome_trace, merge_traces
from gradring.tools import timeline


def _needs_matplotlib() -> None:
    pytest.importorskip("matplotlib", reason="drawing the timeline needs matplotlib "
                                             "(pip install 'gradring[demo]')")


def train_steps(rank: int, world: int, out_dir: str, steps: int, width: int) -> str:
    """``steps`` full training steps (forward, loss, backward, optimizer), buckets launched
    when ready; every step has exposed communication (the last bucket's, the largest)."""
    import gradring

    torch.set_num_threads(1)
    torch.manual_seed(0)
    # The first layer, whose bucket is the last to launch, is the widest: its
    # all-reduce outlasts what is left of the backward.
    model = nn.Sequential(nn.Linear(width, 16 * width), nn.ReLU(), nn.Linear(16 * width, width))
    ddp = gradring.DistributedDataParallel(model, bucket_cap_mb=0.1)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    x = torch.randn(4, width)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        ddp(x).pow(2).mean().backward()
        opt.step()
    ddp(x)
    path = export_chrome_trace(ddp, os.path.join(out_dir, f"rank{rank}.json"))
    paths = ddp.comm.all_gather_object(path)
    if rank == 0:
        merge_traces(paths, os.path.join(out_dir, "merged.json"))
    ddp.comm.all_gather_object(rank)
    return path


def test_tile_covers_the_step_with_labelled_other() -> None:
    # forward 0-2, backward 3-8 over an exposed 7-9 (exposed wins), a gap 9-10
    running = "exposed: collective running"
    pieces = timeline._tile(0.0, 10.0, [(3, 0.0, 2.0, "forward", -1),
                                       (2, 3.0, 8.0, "backward", -1),
                                       (1, 7.0, 9.0, running, -1)])
    assert [(a, b, p) for a, b, p, _ in pieces] == [
        (0.0, 2.0, "forward"), (2.0, 3.0, "other"), (3.0, 7.0, "backward"),
        (7.0, 9.0, running), (9.0, 10.0, "other")]


def test_every_phase_of_a_recorded_run_is_drawn(pools, tmp_path, capsys) -> None:
    _needs_matplotlib()
    pools.run(2, train_steps, str(tmp_path), 8, 256, timeout=120)
    merged = str(tmp_path / "merged.json")
    report = timeline.timeline_report(merged, 3)
    assert report is not None and report.mode == "gantt" and len(report.iterations) == 3
    running = "exposed: collective running"
    for rank in (0, 1):
        for it in report.iterations:
            segs = report.segments[rank][it]
            # one forward's start to the next one's, without a hole or an overlap
            assert all(a.t1 == b.t0 for a, b in zip(segs, segs[1:]))
            assert {s.phase for s in segs} <= set(timeline.PHASES)
            for phase in ("forward", "backward", "optimizer"):
                assert any(s.phase == phase and s.t1 > s.t0 for s in segs), (phase, segs)
        # Buckets launch when ready: whether the last one's collective outlasts the
        # backward in a given step is the machine's timing, so some step shows it.
        assert any(s.phase == running and s.t1 > s.t0 for it in report.iterations
                   for s in report.segments[rank][it]), report.segments[rank]
        shares = report.shares(rank)
        assert sum(shares.values()) == pytest.approx(1.0)
        # What is not a named phase is labelled "other". Its share is a duration and
        # grows when a loaded machine deschedules a rank, so it is not asserted.
        assert set(shares) <= set(timeline.PHASES), shares
    out = str(tmp_path / "t.png")
    assert timeline.main([merged, "-o", out]) == 0
    text = capsys.readouterr().out
    for phase in timeline.PHASES:
        assert phase in text
    assert "drawn as every event" in text and os.path.getsize(out) > 20_000


def test_a_long_run_is_drawn_as_a_bounded_summary(pools, tmp_path, capsys) -> None:
    _needs_matplotlib()
    import matplotlib.image

    pools.run(2, train_steps, str(tmp_path), 130, 32, timeout=180)
    merged = str(tmp_path / "merged.json")
    report = timeline.timeline_report(merged, 0)
    assert report is not None and report.mode == "summary"
    assert len(report.iterations) >= 128
    out = str(tmp_path / "all.png")
    assert timeline.main([merged, "-o", out, "--last", "0"]) == 0
    assert "drawn as a summary" in capsys.readouterr().out
    # the same figure size as any summary (13 x 6 inches at 100 dpi for two ranks),
    # whatever the number of iterations, and a small file
    h, w = matplotlib.image.imread(out).shape[:2]
    assert (w, h) == (1300, 600)
    assert os.path.getsize(out) < 250_000
    few = str(tmp_path / "few.png")
    assert timeline.main([merged, "-o", few, "--last", str(timeline.GANTT_MAX + 1)]) == 0
    assert matplotlib.image.imread(few).shape[:2] == (h, w)


def train_many_buckets(rank: int, world: int, out_dir: str) -> str:
    """Eight 256x256 layers in buckets of about one layer, launched when ready."""
    import gradring

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(256, 256) for _ in range(8)))
    ddp = gradring.DistributedDataParallel(model, bucket_cap_mb=0.2)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    x = torch.randn(4, 256)
    for _ in range(8):
        opt.zero_grad(set_to_none=True)
        ddp(x).pow(2).mean().backward()
        opt.step()
    with torch.no_grad():
        ddp(x)
    path = export_chrome_trace(ddp, os.path.join(out_dir, f"rank{rank}.json"))
    paths = ddp.comm.all_gather_object(path)
    if rank == 0:
        merge_traces(paths, os.path.join(out_dir, "merged.json"))
    ddp.comm.all_gather_object(rank)
    return path


def _overlaps(a, b) -> bool:  # noqa: ANN001
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


@pytest.mark.parametrize("case", ["at-the-end", "many-buckets"])
def test_the_picture_reads_as_drawn(pools, tmp_path, case) -> None:
    """What a reader could misread: iteration labels over the title, all-reduces in the
    backward's colour, a legend naming phases the picture does not show."""
    _needs_matplotlib()
    import matplotlib.colors as mcolors
    import matplotlib.pyplot as plt

    if case == "at-the-end":
        pools.run(2, train_steps, str(tmp_path), 8, 256, timeout=120)
    else:
        pools.run(2, train_many_buckets, str(tmp_path), timeout=120)
    report = timeline.timeline_report(str(tmp_path / "merged.json"), 3)
    assert report is not None and report.mode == "gantt"
    fig = timeline.gantt_figure(report)
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        [ax] = [a for a in fig.axes if a.get_title()]
        title = ax.title.get_window_extent(renderer)
        [labels] = [a for a in ax.child_axes if a.get_gid() == "iteration labels"]
        ticks = [t for t in labels.get_xticklabels() if t.get_text()]
        assert [t.get_text() for t in ticks][:1] == [f"it {report.iterations[0]}"]
        for t in ticks:
            assert not _overlaps(t.get_window_extent(renderer), title), t.get_text()
        # the comm lane's colours are no phase's colour, the backward's least of all
        by_gid: dict[str, set[str]] = {}
        for c in ax.collections:
            for face in c.get_facecolor():
                by_gid.setdefault(c.get_gid(), set()).add(mcolors.to_hex(face))
        comm = set().union(*(v for k, v in by_gid.items() if k.startswith("comm:")))
        assert len({k for k in by_gid if k.startswith("comm:")}) >= 2
        phases = set().union(*(v for k, v in by_gid.items() if k.startswith("phase:")))
        assert mcolors.to_hex(timeline.PHASE_COLOUR["backward"]) in phases
        assert comm and not comm & phases, (comm, phases)
        # the legend lists what is drawn, and only that
        drawn = {k.split(":", 1)[1] for k in by_gid if k.startswith("phase:")}
        legend = [t.get_text() for t in fig.legends[0].get_texts()]
        names = [timeline.OTHER_MEANS if p == "other" else p for p in timeline.PHASES
                 if p in drawn]
        assert legend[1:] == names, legend
        assert legend[0].startswith("comm lane")
    finally:
        plt.close(fig)
