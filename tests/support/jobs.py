"""The one job harness: start a small job of fresh rank processes, collect their reports.

A job is ``world`` processes of one script, each started as
``python SCRIPT *args --rank R`` with its own arguments, stdout and stderr
captured. A rank reports by printing JSON objects, one a line; ``collect``
gives back every rank's reports, exit status and stderr. Used by the fault
jobs of tests/jobs/test_reliability.py and tests/jobs/test_comm_multiprocess.py
(which double as their job scripts) and by the launcher of
tests/support/shm_jobs.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

#: The repository root: job scripts import gradring and ``tests.<...>`` from it.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: gradring's per-collective knobs that a job does not inherit from the test's
#: environment unless the test sets them for the job.
KNOBS = ("GRADRING_TRANSPORT", "GRADRING_ALGO", "GRADRING_CHECK")


def job_env(env: dict[str, str] | None = None, *, drop: Sequence[str] = KNOBS) -> dict[str, str]:
    """The test's environment, one intra-op thread, ``env`` on top; the knobs in
    ``drop`` are left out unless ``env`` sets them."""
    full = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    for k in drop:
        if env is None or k not in env:
            full.pop(k, None)
    return full


def start(script: str, world: int, args: Callable[[int], Sequence[str]],
          env: dict[str, str]) -> list[subprocess.Popen]:
    """Start ``world`` ranks of ``script``: rank ``r`` gets ``args(r)``."""
    return [subprocess.Popen([sys.executable, script, *args(r)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
            for r in range(world)]


def reports_of(stdout: str) -> list[dict[str, Any]]:
    """The JSON objects a rank printed, one a line; other lines are not reports."""
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def collect(procs: list[subprocess.Popen], timeout: float, *,
            on_timeout: str = "raise") -> list[dict[str, Any]]:
    """Wait for every rank, for ``timeout`` seconds in all; each rank's
    ``{"reports", "code", "stderr"}``.

    A rank still running then is killed. ``on_timeout="raise"`` kills the
    whole job and raises ``subprocess.TimeoutExpired``; ``"record"`` keeps
    what the killed rank printed and notes the kill in its stderr."""
    deadline = time.monotonic() + timeout
    out: list[dict[str, Any]] = []
    try:
        for p in procs:
            try:
                stdout, stderr = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                if on_timeout == "raise":
                    raise
                p.kill()
                stdout, stderr = p.communicate()
                stderr += "\n[killed by the launcher: timed out]"
            out.append({"reports": reports_of(stdout), "code": p.returncode,
                        "stderr": stderr[-20000:]})
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return out
