"""``gradring timeline`` draws every phase of the step (forward, backward, waiting for
peers, exposed communication, copies into .grad, optimizer, a labelled "other"), and
long runs as a summary whose size does not grow with the run."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from gradring.observe import timeline
from gradring.observe.overlap import export_chrome_trace, merge_traces
from tests.support.env import environ


def _needs_matplotlib() -> None:
    pytest.importorskip("matplotlib", reason="drawing the timeline needs matplotlib "
                                             "(pip install 'gradring[demo]')")


def train_steps(rank: int, world: int, out_dir: str, steps: int, width: int) -> str:
    with environ(GRADRING_OVERLAP="0"):
        return _train_steps(rank, world, out_dir, steps, width)


def _train_steps(rank: int, world: int, out_dir: str, steps: int, width: int) -> str:
    """``steps`` full training steps (forward, loss, backward, optimizer), buckets
    reduced after the backward so that every step has exposed communication."""
    import gradring

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
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
    for rank in (0, 1):
        for it in report.iterations:
            segs = report.segments[rank][it]
            # one forward's start to the next one's, without a hole or an overlap
            assert all(a.t1 == b.t0 for a, b in zip(segs, segs[1:]))
            assert {s.phase for s in segs} <= set(timeline.PHASES)
            for phase in ("forward", "backward", "exposed: collective running", "optimizer"):
                assert any(s.phase == phase and s.t1 > s.t0 for s in segs), (phase, segs)
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
