"""Timeline drawing from a real merged trace, the tuner's model, and the CLI entry points."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from gradring import step_model
from gradring.buckets import MIB
from gradring.observe.overlap import export_chrome_trace, merge_traces
from gradring.tools import timeline, tune, workloads

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _needs_matplotlib() -> None:
    """Skip, saying why, where the optional timeline dependency is not installed."""
    pytest.importorskip("matplotlib", reason="drawing the timeline needs matplotlib "
                                             "(pip install 'gradring[demo]')")


def train_and_export(rank: int, world: int, out_dir: str, steps: int) -> str:
    import gradring

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(512, 512) for _ in range(4)))
    x = torch.randn(4, 512)
    ddp = gradring.DistributedDataParallel(model, bucket_cap_mb=1)  # four buckets
    for _ in range(steps):
        ddp(x).pow(2).mean().backward()
    assert len(ddp.reducer.buckets) == 4
    return export_chrome_trace(ddp, os.path.join(out_dir, f"rank{rank}.json"))


def _distinct_colours(png: str, min_pixels: int = 300) -> int:
    import matplotlib.image

    img = matplotlib.image.imread(png)[..., :3]
    q = (img.reshape(-1, 3) * 255).round().astype("int64")
    keys = q[:, 0] * 65536 + q[:, 1] * 256 + q[:, 2]
    counts = torch.bincount(torch.from_numpy(keys))
    return int((counts >= min_pixels).sum())


def test_timeline_png_from_a_real_trace(pools, tmp_path) -> None:
    _needs_matplotlib()
    paths = pools.run(2, train_and_export, str(tmp_path), 6)
    merged = merge_traces(paths, str(tmp_path / "merged.json"))
    out = str(tmp_path / "timeline.png")
    assert timeline.main([merged, "-o", out, "--last", "2"]) == 0
    assert os.path.getsize(out) > 20_000
    # four bucket colours, the grey rest of the backward, white, black text
    assert _distinct_colours(out) >= 6
    spans = timeline.select_iterations(timeline._load(merged), 2)
    assert {e["pid"] for e in spans} == {0, 1}
    assert len({e["args"]["iteration"] for e in spans}) == 2


def test_timeline_rejects_a_trace_without_iterations(tmp_path) -> None:
    _needs_matplotlib()
    empty = tmp_path / "empty.json"
    empty.write_text('{"traceEvents": []}')
    assert timeline.main([str(empty), "-o", str(tmp_path / "x.png")]) == 1


@pytest.mark.parametrize("module", [timeline, tune])
def test_help(module, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        module.main(["--help"])
    assert exc.value.code == 0
    assert "usage" in capsys.readouterr().out


# ----------------------------------------------------------------- the tuner's model
def _profile() -> step_model.Profile:
    # Four 1 MiB gradients; the last-defined arrives first, 1 ms apart.
    return step_model.Profile(names=["a", "b", "c", "d"], sizes=[MIB] * 4, keys=["f32"] * 4,
                              ready_ms=[4.0, 3.0, 2.0, 1.0], backward_ms=5.0, step_ms=10.0)


CURVE = step_model.CommCurve([MIB, 4 * MIB], [1.0, 4.0])  # 1 ms per MiB


def test_comm_curve_interpolates_and_extrapolates() -> None:
    assert CURVE.time_ms(MIB // 2) == 1.0
    assert CURVE.time_ms(2 * MIB) == pytest.approx(2.0)
    assert CURVE.time_ms(8 * MIB) == pytest.approx(8.0)
    assert step_model.CommCurve([MIB], [2.0]).time_ms(3 * MIB) == pytest.approx(6.0)


def test_simulate_exact() -> None:
    p = _profile()
    one = step_model.simulate(p, CURVE, 1)       # one bucket per gradient: all hidden but the last
    assert one.buckets == [[3], [2], [1], [0]]
    assert one.done_ms == pytest.approx([2, 3, 4, 5])
    assert (one.exposed_ms, one.step_ms) == pytest.approx((0, 10))
    two = step_model.simulate(p, CURVE, 2)       # [1 MiB first, then 2 MiB]
    assert two.buckets == [[3], [2, 1], [0]]
    assert two.done_ms == pytest.approx([2, 5, 6])
    assert (two.exposed_ms, two.step_ms) == pytest.approx((1, 11))
    four = step_model.simulate(p, CURVE, 4)      # the rest never reaches 4 MiB: one bucket
    assert four.buckets == [[3], [2, 1, 0]]
    assert (four.exposed_ms, four.step_ms) == pytest.approx((2, 12))


def test_choose_prefers_the_largest_cap_among_near_ties() -> None:
    p = _profile()
    preds = [step_model.simulate(p, CURVE, c) for c in (0.5, 1, 2, 4)]
    assert step_model.choose(preds).cap_mb == 1          # 0.5 and 1 give the same buckets
    assert step_model.choose(preds, tolerance=0.15).cap_mb == 2


def test_per_bucket_cost_favours_fewer_buckets() -> None:
    p = _profile()
    preds = [step_model.simulate(p, CURVE, c, per_bucket_ms=1.5) for c in (1, 2, 4)]
    assert [q.step_ms for q in preds] == pytest.approx([16, 15.5, 15])  # 4, 3, 2 buckets
    assert step_model.choose(preds).cap_mb == 4


def _tiny_model() -> nn.Module:
    return nn.Linear(4, 2)


def _tiny_input() -> torch.Tensor:
    return torch.ones(3, 4)


def _tiny_loss(out: torch.Tensor) -> torch.Tensor:
    return out.sum()


def test_workloads_from_names_specs_and_parts() -> None:
    model, x, loss_fn = workloads.load_workload("gradring.tools.workloads:tiny")
    assert loss_fn(model(x)).ndim == 0
    parts = functools.partial(workloads.from_parts, _tiny_model, _tiny_input, _tiny_loss)
    model, x, loss_fn = workloads.load_workload(parts)
    assert loss_fn(model(x)).shape == ()
    with pytest.raises(ValueError, match="unknown workload"):
        workloads.load_workload("no_such_model")


def test_tune_rank_on_real_ranks(pools) -> None:
    results = pools.run(2, tune.tune_rank, "tiny", (0.25, 1.0), steps=2, rounds=1)
    r = results[0]
    assert results[1] is None
    assert [q.cap_mb for q in r.predictions] == [0.25, 1.0, 25.0]
    assert r.chosen.cap_mb in (0.25, 1.0, 25.0) and r.default.cap_mb == 25.0
    assert set(r.measured) == {r.chosen.cap_mb, 25.0}
    assert all(m["step_ms"] > 0 for m in r.measured.values())
    assert r.per_bucket_ms == r.curve.times_ms[0] > 0
    assert len(r.profile.ready_ms) == 8 and r.curve.sizes[-1] == MIB + 4 * 256 * 4
    text = tune.report(r, nproc=2, name="tiny")
    assert "chosen" in text and "default" in text


# ----------------------------------------------------------------- the demo, end to end
def test_demo_small_end_to_end(tmp_path) -> None:
    _needs_matplotlib()
    png, trace = tmp_path / "demo.png", tmp_path / "demo.json"
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, "-m", "gradring.tools.demo", "--small", "--timeline", str(png),
         "--trace", str(trace)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "matches one process on the global batches: True" in proc.stdout
    assert "exposed communication" in proc.stdout
    assert png.stat().st_size > 10_000 and trace.stat().st_size > 1_000
    # The demo's model spans several buckets and at least one all-reduce runs under the
    # backward: check the trace data behind the picture, rank by rank, iteration by iteration.
    spans = timeline.select_iterations(timeline._load(str(trace)), 3)
    back = {(e["pid"], e["args"]["iteration"]): (e["ts"], e["ts"] + e["dur"])
            for e in spans if e["name"] == "gradring::backward"}
    comm = [e for e in spans if e["name"].startswith("gradring::bucket_all_reduce#")]
    assert len({e["args"]["bucket"] for e in comm}) >= 3
    under = [e for e in comm if back[(e["pid"], e["args"]["iteration"])][0] <= e["ts"]
             < back[(e["pid"], e["args"]["iteration"])][1]]
    assert under, "no bucket's all-reduce started during its backward"
    # It ends with explain's summary, and says where its files are.
    assert "gradring explain: 2 rank(s)" in proc.stdout and "findings" in proc.stdout
    assert str(png) in proc.stdout and str(trace) in proc.stdout


def test_demo_writes_into_out_by_default(tmp_path) -> None:
    _needs_matplotlib()
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "gradring.tools.demo", "--small", "--out", "run1"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    files = sorted(p.name for p in (tmp_path / "run1").iterdir())
    assert files == ["explain.txt", "rank0.json", "rank1.json", "timeline.png", "trace.json"]
    for name in files:
        assert os.path.join("run1", name) in proc.stdout
    from gradring.tools import explain_record as explain

    # The folder is what `gradring explain` reads.
    assert explain.analyse(explain.load(str(tmp_path / "run1" / "trace.json"))).steps > 0


def test_iteration_labels_never_collide() -> None:
    # 50 iterations 1 ms apart on a 50 ms axis: "it 8it 9" came from labelling all of them.
    labels = timeline.iteration_labels([(float(k), k) for k in range(50)], 50.0)
    xs = [x for x, _ in labels]
    assert xs[0] == 0.0 and len(labels) < 50
    assert all(b - a >= 0.04 * 50 for a, b in zip(xs, xs[1:]))
    # Few long iterations keep every label.
    assert [t for _, t in timeline.iteration_labels([(0.0, 7), (10.0, 8)], 20.0)] == \
        [" it 7", " it 8"]


def _fake_result(chosen_buckets, chosen_ms, default_ms, spread) -> tune.TuneResult:
    from gradring.step_model import Prediction

    default = Prediction(25.0, [[0, 1]], 0.0, 10.0, [1.0])
    chosen = Prediction(1.0, chosen_buckets, 0.0, 9.0, [1.0])
    measured = {25.0: {"step_ms": default_ms, "exposed_ms": 0.0, "buckets": 1.0,
                       "spread_ms": spread},
                1.0: {"step_ms": chosen_ms, "exposed_ms": 0.0, "buckets": 2.0,
                      "spread_ms": spread}}
    return tune.TuneResult(None, None, [chosen, default], chosen, default, measured, 0.1)


def test_tune_recommends_only_a_gain_beyond_the_spread() -> None:
    # The same buckets: nothing to choose, whatever the clock said.
    r = _fake_result([[0, 1]], 9.0, 10.0, 0.1)
    assert "keep the default" in tune.recommendation(r)
    # Different buckets, but the gain is inside the rounds' spread: noise.
    r = _fake_result([[0], [1]], 9.5, 10.0, 0.8)
    assert "keep the default" in tune.recommendation(r)
    assert "within the rounds' spread" in tune.recommendation(r)
    # ... and where the measurement overrules the step model, it says what "auto",
    # which decides by the model alone, would take
    assert "bucket_cap_mb='auto'" in tune.recommendation(r)
    assert "would take 1 MiB" in tune.recommendation(r)
    # A gain beyond the spread is reported as one.
    r = _fake_result([[0], [1]], 8.0, 10.0, 0.5)
    assert tune.recommendation(r).startswith("recommendation: bucket_cap_mb=1:")


def test_tune_cli_finds_a_workload_in_the_current_folder(tmp_path) -> None:
    (tmp_path / "mymod.py").write_text(
        "import torch\n"
        "def workload():\n"
        "    torch.manual_seed(0)\n"
        "    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))\n"
        "    return m, torch.randn(4, 8), lambda out: out.pow(2).mean()\n")
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from gradring.tools.cli import main; "
         "sys.exit(main(sys.argv[1:]))", "tune", "mymod:workload", "--caps", "1", "--steps",
         "1", "--rounds", "2"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # Two tiny layers fit one bucket at any cap: the tuner says so and keeps the default.
    assert "all give the same 1 bucket(s)" in proc.stdout
    assert "recommendation: keep the default" in proc.stdout
