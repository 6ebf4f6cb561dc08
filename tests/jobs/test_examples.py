"""The examples run as their docstrings say (the single-process form; torchrun forms
are exercised by tests/jobs/test_elastic.py and the multi-host harness)."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_quickstart_single_process():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "quickstart.py")],
                          capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("done on 1 rank(s)")
    assert float(last.rsplit(" ", 1)[1]) < 0.5  # it learned something


def _cli(args, capsys):
    """``gradring ARGS`` in this process (argparse's --help exits): (exit code, stdout)."""
    from gradring.tools.cli import main

    try:
        code = main(list(args))
    except SystemExit as exc:
        code = exc.code or 0
    return code, capsys.readouterr().out


def test_cli_help(capsys):
    for args in (["--help"], ["bench"]):
        _, out = _cli(args, capsys)
        assert "usage" in out


def test_every_subcommand_help_names_the_real_command(capsys, monkeypatch):
    import runpy

    from gradring.tools.cli import COMMANDS

    for name in COMMANDS:
        if name == "bench":
            continue
        code, out = _cli([name, "--help"], capsys)
        assert code == 0 and out.startswith(f"usage: gradring {name} "), out
    # The source checkout's developer benchmarks show how to run them.
    for script in ("ddp_against.py", "ddp_floor.py", "ddp_rung.py", "handoff.py",
                   "allreduce_crossover.py"):
        path = os.path.join(ROOT, "benchmarks", script)
        monkeypatch.setattr(sys, "argv", [path, "--help"])
        with pytest.raises(SystemExit) as exc:
            runpy.run_path(path, run_name="__main__")
        assert exc.value.code == 0, script
        assert capsys.readouterr().out.startswith(f"usage: python benchmarks/{script} ")


def test_bench_help_names_the_real_command(capsys):
    for name in ("allreduce", "ddp", "hooks"):
        code, out = _cli(["bench", name, "--help"], capsys)
        assert code == 0 and out.startswith(f"usage: gradring bench {name} "), out
    code, out = _cli(["bench", "nope"], capsys)
    assert code == 2 and "unknown benchmark 'nope'" in out


def test_bench_runs_from_the_package_alone(tmp_path):
    # Only the gradring package, as pip would install it: no benchmarks/, no tests/.
    shutil.copytree(os.path.join(ROOT, "gradring"), tmp_path / "gradring",
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "gradring.tools.cli", "bench", "allreduce",
                           "--nproc", "2", "--sizes", "4K", "--reps", "1",
                           "--variants", "shm-empty,gloo"],
                          capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.strip().startswith("4 KiB")]
    assert len(rows) == 2, proc.stdout
    assert "gradring-shm (comm.empty)" in rows[0] and "gloo native" in rows[1], proc.stdout


TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


@pytest.mark.skipif(not os.path.exists(TORCHRUN), reason="torchrun not installed in this env")
def test_elastic_crash_recipe_crashes_again_when_rerun(tmp_path):
    # The docstring's crash recipe, twice with the same paths: the second run must not
    # resume the first run's finished checkpoint (that skipped the crash entirely).
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node=2", "--max-restarts=1",
           os.path.join(ROOT, "examples", "elastic_train.py"), "--steps", "9", "--every", "3",
           "--ckpt", str(tmp_path / "ckpt.pt"), "--out", str(tmp_path / "final.pt"),
           "--crash-at", "4", "--crash-rank", "1"]
    logs = []
    for _ in range(2):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        logs.append(proc.stdout + proc.stderr)
    for log in logs:
        assert "exitcode: -9" in log and "resuming from step 3" in log, log
    assert "removed the checkpoint of an earlier launch" in logs[1]


def test_hook_cost_benchmark_prints_each_cost_per_parameter():
    # docs/collectives.md quotes it; a tiny run must still produce every row.
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "hook_cost.py"),
                           "--params", "20", "--numel", "8", "--steps", "10"],
                          capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    rows = [line.split()[:2] for line in proc.stdout.splitlines()[1:]]
    assert [r[0] for r in rows] == ["noop", "copy", "gradring"], proc.stdout
