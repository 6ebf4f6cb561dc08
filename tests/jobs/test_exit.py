"""How a job that uses gradring exits: the status its script chose, never a SIGABRT.

The reproduction of the exit deaths (see [Note: how a gradring process exits] in
``gradring/comm/leaving.py``): rank 0 starts an asynchronous all-reduce of 65,536
floats and calls ``sys.exit(3)`` 0.3 s later while rank 1 sleeps, with
``GRADRING_TIMEOUT=4``; and its variants: each transport, an error exit, an
uncaught exception and a clean exit, with and without ``destroy_process_group()``,
ranks forked, spawned, or started by torchrun. The jobs are
``benchmarks/exit_stress.py``'s; each asserts every rank's exit status and that no
rank printed "terminate called". The forked variants run in one fresh process
(``--batch``: torch is imported once, the ranks are forked from it); the spawned
and torchrun ones are in the slow suite. ``script`` ranks are forked too but end
as a script's main module does, with the interpreter's finalization, where the
deaths happened.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support import jobs

SCRIPT = os.path.join(jobs.ROOT, "benchmarks", "exit_stress.py")


def _batch(specs: list[dict], timeout: float, parallel: int = 2) -> list[dict]:
    proc = subprocess.run([sys.executable, SCRIPT, "--batch", json.dumps(specs),
                           "--parallel", str(parallel)],
                          capture_output=True, text=True, timeout=timeout,
                          env=jobs.job_env(), cwd=jobs.ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(out) == len(specs), proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def _check(results: list[dict]) -> None:
    for r in results:
        assert "error" not in r, r
        assert "terminate called" not in r["stderr"], (r["job"], r["stderr"])
        assert not r["died"] and not r["hung"], (r["job"], r["codes"], r["stderr"])
        assert r["codes"] == r["expected"] or r["as_chosen"], (r["job"], r["codes"],
                                                               r["stderr"])
        if (":error" in r["job"] or ":raise" in r["job"]) and ":torchrun" not in r["job"]:
            # (torchrun ends the survivor with SIGTERM as soon as rank 0 exits.)
            # The survivor got an error naming the rank that left, not a hang.
            line = [x for x in r["stderr"].splitlines() if x.startswith("rank 1 error:")]
            assert line and "rank 0" in line[0], (r["job"], r["stderr"])


@pytest.mark.timeout(180)
def test_exit_with_collectives_in_flight_forked_ranks() -> None:
    # Rank 1 sleeps past rank 0's deadline: before the fix, rank 0's gloo wait timed
    # out while its interpreter finalized (SIGABRT); its exit must not wait for it.
    base = {"launcher": "script", "peer_sleep": 5.0, "timeout": "4"}
    specs = [
        dict(base, transport="torch", ending="error", env={"GRADRING_DEBUG": "exit"}),
        dict(base, transport="shm", ending="error"),
        dict(base, transport="torch", ending="clean"),
        dict(base, transport="shm", ending="clean", destroy=True),
        dict(base, transport="torch", ending="raise", launcher="fork", peer_sleep=1.0),
    ]
    results = _batch(specs, timeout=150, parallel=5)
    _check(results)
    # GRADRING_DEBUG=exit: a line for each thread, group and pending collective alive at
    # exit, and for the wait that kept the interpreter from finalizing.
    rank0 = results[0]["stderr"].split("[rank 1]")[0]
    said = [x.split("): ", 1)[1] for x in rank0.splitlines() if x.startswith("gradring exit (pid")]
    assert any(x.startswith("thread gradring-comm-0 alive, in a gloo wait to ") for x in said), \
        said
    assert "group 0 (rank 0 of 2) alive, 1 collectives queued or running" in said, said
    assert any(x.startswith("collective all_reduce #2 (262144 bytes") and x.endswith("pending "
               "(started)") for x in said), said
    assert any(x.startswith("thread gradring-comm-0 is still in a gloo wait") for x in said), said


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_exit_with_collectives_in_flight_spawned_and_torchrun() -> None:
    base = {"peer_sleep": 2.0, "timeout": "4"}
    specs = [dict(base, launcher=launcher, transport=t, ending=ending, destroy=destroy)
             for launcher in ("spawn", "torchrun")
             for t in ("shm", "torch")
             for ending, destroy in (("error", False), ("clean", False), ("clean", True))]
    specs.append(dict(base, kind="floor", launcher="spawn", ending="clean", destroy=True))
    specs.append(dict(base, launcher="script", transport="torch", ending="raise", peer_sleep=5.0))
    specs.append(dict(base, launcher="spawn", transport="torch", ending="raise", peer_sleep=5.0))
    _check(_batch(specs, timeout=560))
