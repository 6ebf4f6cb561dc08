"""Nothing of a torchrun job outlives it, whoever dies.

Each test starts a fresh ``torchrun --standalone`` job of this file (run as a
script it is the worker: ``--job NAME``), kills or stops some of its
processes, and checks what is left: the processes, the job's segments in
/dev/shm (the names carry the owner's pid: ``gradring-<pid>-...``), and what
the survivors printed. Events, names and order only, never durations.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))  # the repository
sys.path.insert(0, ROOT)

import pytest  # noqa: E402
import torch  # noqa: E402

TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
#: Seconds a worker idles after each step: the window in which the test kills ranks,
#: so that torchrun's SIGTERM reaches the survivors before their next collective.
IDLE_S = 3.0

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(not os.path.exists(TORCHRUN), reason="torchrun not installed")]


# ----------------------------------------------------------------------- job side
def _say(**report: object) -> None:
    # One write: the workers share torchrun's stdout, and print() may split a line.
    os.write(1, (json.dumps(report) + "\n").encode())


def _init() -> int:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    return dist.get_rank()


def job_train(a: argparse.Namespace) -> None:
    """DDP training (its buckets live in /dev/shm), idling ``IDLE_S`` after each step."""
    import gradring

    rank = _init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    ddp = gradring.DistributedDataParallel(model, bucket_cap_mb=0.005)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for step in range(100):
        opt.zero_grad()
        ddp(torch.randn(8, 16)).pow(2).mean().backward()
        opt.step()
        _say(rank=rank, pid=os.getpid(), step=step)
        time.sleep(IDLE_S)


def job_offmain(a: argparse.Namespace) -> None:
    """The group's context is made and shared memory connected in a thread of the
    user's (its first collective); then the main thread runs collectives."""
    from gradring import comm

    rank = _init()
    t = threading.Thread(target=lambda: comm.all_reduce(torch.ones(1000)))
    t.start()
    t.join()
    for step in range(100):
        comm.all_reduce(torch.ones(1000))
        _say(rank=rank, pid=os.getpid(), step=step)
        time.sleep(IDLE_S)


def job_lock(a: argparse.Namespace) -> None:
    """Rank 1 takes the group's lock and stops itself (SIGSTOP); rank 0's next
    collective must name it (GRADRING_TIMEOUT is short)."""
    import torch.distributed as dist

    from gradring import comm
    from gradring.comm.transports.shm.transport import live_transports

    rank = _init()
    comm.all_reduce(torch.ones(64))  # connects shared memory
    _say(rank=rank, pid=os.getpid(), step=0)
    if rank == 1:
        (t,) = live_transports()
        assert t._glock.acquire(time.monotonic() + 30)
    dist.barrier()  # torch's own: rank 0 starts its collective once rank 1 holds the lock
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    try:
        comm.all_reduce(torch.ones(64))
        _say(rank=rank, error=None)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        _say(rank=rank, error=f"{type(exc).__name__}: {exc}")
    time.sleep(60)  # until torchrun's SIGTERM (the test kills rank 1)


JOBS = {"train": job_train, "offmain": job_offmain, "lock": job_lock}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--job", required=True, choices=sorted(JOBS))
    ap.add_argument("--variant", default="")
    a = ap.parse_args()
    JOBS[a.job](a)


# ----------------------------------------------------------------------- test side
def _alive(pid: int) -> bool:
    """Exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2:stat.rindex(b")") + 3] not in (b"Z", b"X")


class Job:
    """A torchrun job of this file; its output is read by threads into lists."""

    def __init__(self, world: int, job: str, variant: str = "", **env: str) -> None:
        full = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, **env)
        for k in ("GRADRING_TRANSPORT", "GRADRING_ALGO", "GRADRING_CHECK"):
            full.pop(k, None)
        self.proc = subprocess.Popen(
            [TORCHRUN, "--standalone", f"--nproc-per-node={world}", "--monitor-interval=0.1",
             os.path.abspath(__file__), "--job", job, "--variant", variant],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full,
            start_new_session=True)
        self.world = world
        self.reports: list[dict] = []
        self.err: list[str] = []
        self._cond = threading.Condition()
        self._readers = [threading.Thread(target=self._read, args=(s, sink), daemon=True)
                         for s, sink in ((self.proc.stdout, None), (self.proc.stderr, self.err))]
        for r in self._readers:
            r.start()
        self.pids: dict[int, int] = {}

    def _read(self, stream, sink) -> None:  # noqa: ANN001
        for line in stream:
            with self._cond:
                if sink is not None:
                    sink.append(line)
                else:
                    for found in re.findall(r"\{[^{}]*\}", line):
                        try:
                            self.reports.append(json.loads(found))
                        except ValueError:
                            pass  # not one of ours
                self._cond.notify_all()

    def wait_for(self, pred, timeout: float = 90.0) -> None:  # noqa: ANN001
        """Wait until ``pred(reports)``; fail with the output so far otherwise."""
        end = time.monotonic() + timeout
        with self._cond:
            while not pred(self.reports):
                left = end - time.monotonic()
                assert left > 0 and self.proc.poll() is None or pred(self.reports), \
                    (self.reports, "".join(self.err)[-4000:])
                self._cond.wait(min(left, 0.5) if left > 0 else 0.01)

    def steps(self, n: int) -> dict[int, int]:
        """Wait until every rank finished step ``n``; their pids."""
        self.wait_for(lambda rs: {r["rank"] for r in rs if r.get("step") == n}
                      == set(range(self.world)))
        self.pids = {r["rank"]: r["pid"] for r in self.reports if "pid" in r}
        return self.pids

    def end(self, timeout: float = 90.0) -> str:
        """Wait for torchrun to exit; its stderr (workers' included)."""
        self.proc.wait(timeout=timeout)
        for r in self._readers:
            r.join(timeout)
        return "".join(self.err)

    def cleanup(self) -> None:
        for pid in [self.proc.pid, *self.pids.values()]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if self.proc.poll() is None:
            self.proc.wait(30)


def _left_in_dev_shm(pids) -> list[str]:  # noqa: ANN001
    return sorted(n for n in os.listdir("/dev/shm")
                  if any(n.startswith(f"gradring-{pid}-") for pid in pids))


def _sigterm_line(err: str, pid: int) -> str:
    lines = [ln for ln in err.splitlines() if f"gradring: SIGTERM on pid {pid}" in ln]
    assert len(lines) == 1, (pid, err[-4000:])
    return lines[0]


@pytest.mark.parametrize("victims", [[1], [1, 2]], ids=["one", "all_but_one"])
def test_killed_ranks_leave_nothing_and_survivors_name_them(victims) -> None:
    # W=3; kill -9 of rank 1 (or of ranks 1 and 2) while every rank idles between
    # steps: torchrun's SIGTERM reaches the survivors before their next collective, so
    # they never see the death themselves. Before, their SIGTERM handler printed
    # nothing (no collective in flight); now it names every dead rank. After torchrun
    # exits, /dev/shm holds nothing of the job (the last survivor unlinks the names of
    # its dead peers).
    job = Job(3, "train")
    try:
        pids = job.steps(0)
        for v in victims:
            os.kill(pids[v], signal.SIGKILL)
        err = job.end()
    finally:
        job.cleanup()
    assert job.proc.returncode != 0, err[-4000:]
    for rank in sorted(set(range(3)) - set(victims)):
        line = _sigterm_line(err, pids[rank])
        for v in victims:
            assert f"rank {v} (pid {pids[v]}) has exited (last started all_reduce #" in line, line
        assert "no collective was in flight here" in line, line
        for other in sorted(set(range(3)) - set(victims) - {rank}):  # a survivor: no cause
            assert f"rank {other} (pid {pids[other]})" not in line, line
    assert _left_in_dev_shm(pids.values()) == []


def test_killed_agent_takes_its_workers_along() -> None:
    # kill -9 of the torchrun agent itself. Before, the workers were reparented and
    # trained on (holding their segments); now each sees its parent change, says so,
    # removes its shared memory and ends with SIGTERM.
    job = Job(2, "train")
    try:
        pids = job.steps(0)
        os.kill(job.proc.pid, signal.SIGKILL)
        end = time.monotonic() + 60
        while any(_alive(p) for p in pids.values()) and time.monotonic() < end:
            time.sleep(0.2)
        lingering = [p for p in pids.values() if _alive(p)]
        for r in job._readers:
            r.join(10)
        err = "".join(job.err)
    finally:
        job.cleanup()
    assert lingering == [], ("orphaned workers still running", err[-4000:])
    for rank, pid in pids.items():
        assert (f"gradring: pid {pid} (rank {rank}): the torchrun agent that started this "
                f"worker (pid {job.proc.pid}) is gone") in err, err[-4000:]
    assert _left_in_dev_shm(pids.values()) == []


def test_sigterm_cleans_up_when_the_first_connect_was_off_the_main_thread() -> None:
    # The group's context and the shm connect are made in a user's thread. Before,
    # signal.signal could not be called there, no handler was ever installed, and
    # torchrun's SIGTERM left every segment of the job in /dev/shm; now the main
    # thread's next collective installs it.
    job = Job(2, "offmain")
    try:
        pids = job.steps(0)
        for pid in pids.values():
            os.kill(pid, signal.SIGTERM)
        job.end()
    finally:
        job.cleanup()
    assert _left_in_dev_shm(pids.values()) == []


def test_a_stopped_lock_holder_is_named() -> None:
    # Rank 1 holds the group's lock and is SIGSTOPped. Before, rank 0 timed out with
    # "waiting for the group's lock (held by a stopped rank?)" and "ranks [] did not
    # arrive"; now it names rank 1, its pid, and that it is stopped.
    job = Job(2, "lock", GRADRING_TIMEOUT="2")
    try:
        pids = job.steps(0)
        job.wait_for(lambda rs: any("error" in r for r in rs))
        err = next(r["error"] for r in job.reports if "error" in r)
        os.kill(pids[1], signal.SIGKILL)
        job.end()
    finally:
        job.cleanup()
    assert err is not None, job.reports
    assert f"rank 1 (pid {pids[1]}) holds it and is stopped" in err, err
    assert "ranks [1] did not arrive" in err, err
    assert _left_in_dev_shm(pids.values()) == []


if __name__ == "__main__":
    main()
