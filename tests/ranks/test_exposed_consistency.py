"""One run, four reports, one exposed time: ``ddp.overlap_stats()``, the demo's summary,
``gradring explain`` and ``gradring timeline`` give the same exposed communication
for the same rank ([Note: exposed communication] in gradring/observe/overlap.py).

Before they shared one definition, one run printed "exposed communication 6.98
ms/step" in the demo and "exposed comm 8.45" in explain: a median over the newest
10 iterations against a sum of three medians over the newest 20."""

from __future__ import annotations

import os
import re

import pytest
import torch
from torch import nn

from gradring.observe import explain as ex
from gradring.observe import timeline
from gradring.observe.trace import Event
from tests.support.env import environ

STEPS = 14


def record_run(rank: int, world: int, out_dir: str, overlap: str) -> dict:
    """Train a 3-bucket MLP (with an optimizer), then collect every report's figure."""
    with environ(GRADRING_OVERLAP=overlap):
        return _record_run(rank, out_dir)


def _record_run(rank: int, out_dir: str) -> dict:
    import gradring

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 256))
    ddp = gradring.DistributedDataParallel(model, bucket_cap_mb=0.2)
    return _train_and_report(rank, ddp, out_dir)


def _train_and_report(rank: int, ddp: nn.Module, out_dir: str) -> dict:
    import gradring
    from gradring.observe.overlap import export_chrome_trace, merge_traces

    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    x = torch.randn(4, 256)
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        ddp(x).pow(2).mean().backward()
        opt.step()
    ddp(x)  # one more forward: the last step is complete for explain too
    stats = ddp.overlap_stats()
    live = gradring.explain(ddp, measure=False)
    path = export_chrome_trace(ddp, os.path.join(out_dir, f"rank{rank}.json"))
    paths = ddp.comm.all_gather_object(path)
    if rank == 0:
        merge_traces(paths, os.path.join(out_dir, "merged.json"))
    ddp.comm.all_gather_object(rank)  # rank 0 has merged before anyone returns
    return {"stats": stats, "live_exposed": live.parts[rank].get("exposed_total"),
            "live_text": live.text, "live_keys": live.keys(),
            "buckets": len(ddp.reducer.buckets),
            "overlap": ddp.reducer.launches_when_ready}


def _printed(pattern: str, text: str) -> str:
    m = re.search(pattern, text)
    assert m, f"{pattern!r} not in:\n{text}"
    return m.group(1)


@pytest.mark.parametrize("overlap", ["1", "0"], ids=["launch-when-ready", "at-the-end"])
def test_four_reports_agree_on_the_exposed_time(pools, tmp_path, overlap, capsys) -> None:
    res = pools.run(2, record_run, str(tmp_path), overlap, timeout=180)
    merged = str(tmp_path / "merged.json")
    assert res[0]["buckets"] >= 2 and res[0]["overlap"] == (overlap == "1")
    offline = ex.analyse(ex.load(merged))
    from gradring.tools.demo import _overlap_summary

    # The same printed figure: the demo's line, explain's row, the timeline's line ...
    demo = "\n".join(_overlap_summary({"overlap": res[0]["stats"], "step_ms": 10.0}))
    shown = f"{res[0]['stats']['exposed_ms']:.2f}"
    assert _printed(r"exposed communication (\S+) ms/step", demo) == shown
    row = next(line for line in offline.text.splitlines() if line.startswith("exposed comm"))
    assert row.split()[2] == shown, offline.text
    assert timeline.main([merged, "-o", str(tmp_path / "t.png")]) == 0
    out = capsys.readouterr().out
    assert _printed(r"rank 0: exposed communication (\S+) ms/step", out) == shown
    report = timeline.timeline_report(merged, 3)
    assert report is not None
    for rank in (0, 1):
        stats = res[rank]["stats"]
        # ... and the same float, every way round
        figure = stats["exposed_ms"]
        assert stats["iterations"] == len(stats["exposed_per_iteration_ms"]) >= STEPS - 2
        assert res[rank]["live_exposed"] == figure
        assert offline.parts[rank]["exposed_total"] == figure
        assert report.exposed[rank].ms == figure
        assert list(report.exposed[rank].iterations) == stats["exposed_iterations"]
    # the live answer is the file's answer
    assert res[0]["live_text"].splitlines()[1:11] == offline.text.splitlines()[1:11]
    # reduced after the backward: explain says so as a finding, with a saving
    if overlap == "0":
        assert "at_the_end" in offline.keys(), offline.text
        assert "buckets were reduced after the backward" in offline.text
        assert "would be left exposed" in offline.text
    else:
        assert "at_the_end" not in offline.keys()


def test_at_the_end_finding_names_the_reason_and_the_saving() -> None:
    """Synthetic: three buckets ready at 2, 5 and 8 ms of a 10 ms backward, each
    reduced after it for 2 ms. Launched when ready they would end at 4, 7 and 10:
    nothing exposed; reduced at the end, 6 ms are: launching when ready would save 6 ms."""
    evs: list[Event] = []
    for it in range(4):
        t = 100.0 + it * 0.03
        ms = lambda x, t=t: t + x / 1e3  # noqa: E731
        evs += [Event(it, "forward_start", -1, ms(0)), Event(it, "module_start", -1, ms(0.1)),
                Event(it, "module_end", -1, ms(0.5)), Event(it, "forward_end", -1, ms(0.6)),
                Event(it, "backward_start", -1, ms(1))]
        evs += [Event(it, "ready", b, ms(1 + r)) for b, r in enumerate((2, 5, 8))]
        evs.append(Event(it, "backward_end", -1, ms(11)))
        for b in range(3):
            evs += [Event(it, "launch", b, ms(11 + 2 * b)),
                    Event(it, "comm_done", b, ms(13 + 2 * b)),
                    Event(it, "written", b, ms(13 + 2 * b))]
    why = "GRADRING_OVERLAP=0"
    facts = {"rank": 0, "world_size": 2, "device": "cpu", "find_unused": False,
             "unused_last": 0, "static_graph": False, "bucket_view": True, "comm_hook": "",
             "sync_buffers": False, "buffers": [], "num_forward": 4,
             "bucket_cap_bytes": 1 << 20, "sizes": [4096] * 3, "keys": ["f"] * 3,
             "names": ["a", "b", "c"], "bucket_params": [[0], [1], [2]],
             "bucket_bytes": [4096] * 3, "grad_bytes_outside_buckets": 0,
             "overlap": False, "overlap_why": why}
    x = ex.analyse([{"rank": 0, "facts": facts, "curve": None,
                     "events": [list(e) for e in evs]}])
    assert x.parts[0]["exposed_total"] == pytest.approx(6.0)
    [f] = [f for f in x.findings if f.key == "at_the_end"]
    assert f.title == "buckets were reduced after the backward (GRADRING_OVERLAP=0)"
    assert f.saving_ms == pytest.approx(6.0)
    assert "0.00 ms would be left exposed" in f.evidence
    assert "expected saving 6.00 ms/step" in x.text
