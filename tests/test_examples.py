"""The examples run as their docstrings say (the single-process form; torchrun forms
are exercised by tests/test_elastic.py and the multi-host harness)."""

import os
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
