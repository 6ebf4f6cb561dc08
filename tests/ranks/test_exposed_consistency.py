"""One run, every report, one set of figures: ``ddp.overlap_stats()``, the demo's summary,
``gradring explain`` (its text and ``--json``) and ``gradring timeline`` summarise the same
steps with the same means, and every breakdown adds up to its total ([Note: which steps
the reports summarise] and [Note: exposed communication] in gradring/observe/overlap.py),
on a run with one bucket and on one with several.

Before they shared one definition, one run printed "exposed comm 7.72" above parts
"wait 0.37 + last bucket 3.73 + earlier 0.00" (medians of parts, over 18 steps against
19 iterations), and the demo's bucket table said "run 11.67" where explain said
"last bucket 8.22"."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from torch import nn

from gradring.tools import explain_record as ex
from gradring.tools import timeline
from tests.support.explain_rows import assert_rows_add_up, printed_rows

STEPS = 14


def record_run(rank: int, world: int, out_dir: str, cap_mb: float) -> dict:
    """Train an MLP (with an optimizer), then collect every report's figure."""
    return _record_run(rank, out_dir, cap_mb)


def _record_run(rank: int, out_dir: str, cap_mb: float) -> dict:
    import gradring

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 256))
    ddp = gradring.DistributedDataParallel(model, bucket_cap_mb=cap_mb)
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
    with torch.no_grad():
        ddp(x)  # one more forward: the last step is complete
    stats = ddp.overlap_stats()
    live = gradring.explain(ddp, measure=False)
    path = export_chrome_trace(ddp, os.path.join(out_dir, f"rank{rank}.json"))
    paths = ddp.comm.all_gather_object(path)
    if rank == 0:
        merge_traces(paths, os.path.join(out_dir, "merged.json"))
    ddp.comm.all_gather_object(rank)  # rank 0 has merged before anyone returns
    return {"stats": stats, "live_parts": live.parts[rank], "live_text": live.text,
            "live_keys": live.keys(), "buckets": len(ddp.reducer.buckets)}


def _printed(pattern: str, text: str) -> str:
    m = re.search(pattern, text)
    assert m, f"{pattern!r} not in:\n{text}"
    return m.group(1)


@pytest.mark.parametrize("cap_mb", [25.0, 0.2], ids=["one-bucket", "many-buckets"])
def test_every_report_gives_the_same_figures_and_they_add_up(pools, tmp_path, cap_mb,
                                                              capsys) -> None:
    res = pools.run(2, record_run, str(tmp_path), cap_mb, timeout=180)
    merged = str(tmp_path / "merged.json")
    one = cap_mb == 25.0
    assert (res[0]["buckets"] == 1) if one else (res[0]["buckets"] >= 3)
    offline = ex.analyse(ex.load(merged))
    from gradring.tools import explain as cli
    from gradring.tools.demo import _overlap_summary

    assert cli.main([merged, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    # The same printed figure: the demo's line, explain's row, the timeline's line ...
    demo = "\n".join(_overlap_summary({"overlap": res[0]["stats"], "step_ms": 10.0}))
    shown = f"{res[0]['stats']['exposed_ms']:.2f}"
    assert _printed(r"exposed communication (\S+) ms/step", demo) == shown
    rows = printed_rows(offline.text)
    assert f"{rows['exposed comm'][0]:.2f}" == shown, offline.text
    # the backward too: a figure two reports print is printed alike
    assert _printed(r"backward (\S+) ms", demo) == f"{rows['backward'][0]:.2f}"
    assert timeline.main([merged, "-o", str(tmp_path / "t.png")]) == 0
    out = capsys.readouterr().out
    assert _printed(r"rank 0: exposed communication (\S+) ms/step", out) == shown
    report = timeline.timeline_report(merged, 3)
    assert report is not None
    # ... one set of steps, named once in the header ...
    header = offline.text.splitlines()[0]
    assert f"means over {res[0]['stats']['iterations']} step(s)" in header, header
    assert "iteration" not in header, header
    for rank in (0, 1):
        stats, parts = res[rank]["stats"], offline.parts[rank]
        # ... the same float, every way round ...
        figure = stats["exposed_ms"]
        assert stats["iterations"] == len(stats["exposed_per_iteration_ms"]) >= STEPS - 2
        assert parts["steps"] == stats["iterations"]
        assert res[rank]["live_parts"]["exposed_comm"] == figure
        assert parts["exposed_comm"] == figure
        assert doc["parts"][str(rank)]["exposed_comm"] == figure
        assert report.exposed[rank].ms == figure
        assert list(report.exposed[rank].iterations) == stats["exposed_iterations"]
        # ... and every breakdown adds up to its total: the buckets' exposed runs, ...
        table = stats["buckets"]
        assert sum(b["exposed_ms"] for b in table) == pytest.approx(figure, abs=1e-9)
        # ... explain's parts of the exposed time and the rows of the step, ...
        assert parts["wait"] + parts["last_bucket"] + parts["earlier_buckets"] == \
            pytest.approx(figure, abs=1e-9)
        assert sum(parts[k] for k in ex.STEP_ROWS) == pytest.approx(parts["step"], abs=1e-9)
        assert_rows_add_up(rows, rank)
        # ... the last bucket is the table's last bucket, less its wait for the peers ...
        assert parts["last_bucket"] <= table[-1]["exposed_ms"] + 1e-9
        if one:
            assert parts["earlier_buckets"] == pytest.approx(0.0, abs=1e-9)
            assert parts["wait"] + parts["last_bucket"] == \
                pytest.approx(table[0]["exposed_ms"], abs=1e-9)
        # ... and the timeline's phases are explain's rows, step by step.
        steps = {s.iteration: s for s in ex.all_rank_steps(ex.load(merged))[rank]}
        for it in report.iterations:
            drawn = {p: 0.0 for p in timeline.PHASES}
            for seg in report.segments[rank][it]:
                drawn[seg.phase] += (seg.t1 - seg.t0) * 1e3
            for phase, keys in timeline.PHASE_ROWS.items():
                want = sum(getattr(steps[it], k) for k in keys)
                assert drawn[phase] == pytest.approx(want, abs=1e-6), (phase, it)
    # the demo's bucket table shows the exposed column the figures add up from
    assert "exposed" in demo.splitlines()[2]
    # the live answer is the file's answer
    assert res[0]["live_text"].splitlines()[1:12] == offline.text.splitlines()[1:12]
