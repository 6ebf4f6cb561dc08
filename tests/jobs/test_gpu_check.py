"""scripts/gpu_check.py run as a user runs it, in fresh processes.

Without a GPU the script runs its CPU part (world 1 and 2 over gloo on CPU
tensors, the compile check), prints SKIP for what needs CUDA and a line
saying the GPU half was skipped, and exits 0. A difference it is made to see
(``--inject-fault``) must come out as FAIL with a non-zero exit. .ci/run runs
the plain command (the CPU part at its default sizes) as a step of its own.
The full GPU run is marked ``cuda``: run it on a machine with one,
``pytest -m cuda tests/jobs/test_gpu_check.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.py"
NO_CUDA = "needs a CUDA GPU: torch.cuda.is_available() is False"


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


def _checks() -> list[tuple[str, bool]]:
    """(name, CUDA only) of every check, from the script's own --list."""
    out = _run("--list", timeout=60).stdout.splitlines()
    return [(line.split()[0], line.endswith("(CUDA only)")) for line in out if line.strip()]


@pytest.mark.slow  # about 30 s on two idle cores
def test_cpu_part_passes_and_skips_what_needs_cuda():
    proc = _run("--cpu", "--quick", timeout=600)
    out = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    checks = _checks()
    assert len(checks) == 20
    for name, cuda_only in checks:
        want = f"SKIP {name}: needs CUDA" if cuda_only else f"PASS {name}: "
        assert any(line.startswith(want) for line in out), (name, proc.stdout)
    ran = sum(not c for _, c in checks)
    assert out[-2].startswith("GPU half skipped (") and \
        f": {len(checks) - ran} CUDA-only checks not run (" in out[-2], out[-2]
    assert out[-1].startswith(f"SUMMARY: {ran} passed, 0 failed, {len(checks) - ran} skipped"), \
        out[-1]
    assert any(line.startswith("PASS w2/plain: gradients and parameters bit-equal") for line in out)


def test_a_difference_is_reported_as_fail():
    proc = _run("--cpu", "--quick", "--only", "w2/plain", "--inject-fault", "w2/plain",
                timeout=300)
    out = proc.stdout.splitlines()
    assert proc.returncode == 1, proc.stdout + proc.stderr
    fails = [line for line in out if line.startswith("FAIL w2/plain: ")]
    assert len(fails) == 1, proc.stdout
    assert "step 0, gradients: 1 of " in fails[0] and "elements differ" in fails[0], fails[0]
    assert out[-2].startswith("GPU half skipped ("), out[-2]
    assert out[-1].startswith("SUMMARY: 0 passed, 1 failed, 0 skipped"), out[-1]
    assert out[-1].endswith("failed: w2/plain"), out[-1]


def test_bad_selection_is_refused():
    proc = _run("--only", "nothing/*", timeout=60)
    assert proc.returncode == 2 and "no check matches" in proc.stderr, proc.stderr
    proc = _run("--only", "w1/plain", "--inject-fault", "w2/plain", timeout=60)
    assert proc.returncode == 2 and "not one of the selected checks" in proc.stderr


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_full_script_on_one_gpu():
    proc = _run(timeout=840)
    out = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert out[-1].startswith("SUMMARY: 20 passed, 0 failed, 0 skipped"), out[-1]
    assert any(line.startswith("PASS w1/cost: ") for line in out)
