"""The examples run as their docstrings say (the single-process form; torchrun forms
are exercised by tests/test_elastic.py and the multi-host harness)."""

import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quickstart_single_process():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "quickstart.py")],
                          capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("done on 1 rank(s)")
    assert float(last.rsplit(" ", 1)[1]) < 0.5  # it learned something


def test_cli_help():
    for args in (["--help"], ["bench"]):
        proc = subprocess.run([sys.executable, "-m", "gradring.tools.cli", *args],
                              capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert "usage" in proc.stdout


def test_bench_help_names_the_real_command():
    for name in ("allreduce", "ddp", "hooks"):
        proc = subprocess.run([sys.executable, "-m", "gradring.tools.cli", "bench", name,
                               "--help"], capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith(f"usage: gradring bench {name} "), proc.stdout
    proc = subprocess.run([sys.executable, "-m", "gradring.tools.cli", "bench", "nope"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and "unknown benchmark 'nope'" in proc.stdout


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
