"""Two or three independent jobs on one host never disturb each other (issue 31 §3).

Several small jobs (world 2, each with its own FileStore, fresh processes) run
at once, in three rolling slots: a job that ends makes room for the next, so
jobs start -- and every fresh process sweeps /dev/shm for stale segments at
its first connect (``segments.remove_stale_segments``) -- while others train.
A seeded RNG decides each job's steps, pace and fate: healthy, a rank killed
with ``kill -9``, or a rank raising. Meanwhile this process sweeps /dev/shm
itself every few milliseconds, as a hostile neighbour would.

Each job must get exactly its own result: a healthy job the right sums (a
per-job salt in every value, so another job's data would show) and no error;
a crashed job an error on the survivor naming the dead rank *of its own job*
(rank and pid) and no other job's pid. Every rank checks after each step that
the segments it owned at its first step (its staging set and a ``comm.empty``
buffer kept all job long) are still in /dev/shm, so a segment lost to another
job's sweep fails the test. This file doubles as the rank script
(``python tests/test_concurrent_jobs.py --job ...``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gradring import comm
from gradring.comm.transports.shm import segments

pytestmark = pytest.mark.timeout(240)

WORLD = 2
SLOTS = 3
SEED = 3131
#: Every fate, in an order the seeded RNG shuffles; healthy jobs train alongside the crashes.
FATES = ["healthy", "healthy", "kill", "kill", "raise"]


# ------------------------------------------------------------------ the rank side
def _mine() -> set[str]:
    return {n for n in os.listdir(segments.SHM_DIR) if n.startswith(f"gradring-{os.getpid()}-")}


def _say(report: dict[str, object]) -> None:
    print(json.dumps(report), flush=True)


def _rank_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    for name in ("job", "rank", "steps", "victim", "at", "salt"):
        p.add_argument(f"--{name}", type=int, required=True)
    p.add_argument("--store", required=True)
    p.add_argument("--fate", choices=("healthy", "kill", "raise"), required=True)
    p.add_argument("--pace", type=float, required=True)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(a.store, WORLD), rank=a.rank,
                            world_size=WORLD, timeout=timedelta(seconds=60))
    report: dict[str, object] = {"job": a.job, "rank": a.rank, "pid": os.getpid()}
    _say(report)  # the pid first: a killed rank says nothing more
    rng = random.Random(a.salt * 10 + a.rank)
    keep = comm.empty(20_000)  # lives the whole job: a data segment another sweep could take
    owned: set[str] = set()
    lost: set[str] = set()
    wrong = 0
    base = 1000.0 * a.salt
    try:
        for step in range(a.steps):
            if a.fate != "healthy" and a.rank == a.victim and step == a.at:
                if a.fate == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError(f"job {a.job} rank {a.rank}: injected failure at step {step}")
            x = comm.empty(3000) if step % 2 else torch.empty(3000)
            for t in (x, keep):
                t.fill_(base + a.rank + step)
                comm.all_reduce(t)
                wrong += int(not torch.all(t == WORLD * (base + step) + sum(range(WORLD))))
            if step == 0:  # x is ordinary memory here: what we own now lives all job long
                report["t_connect"] = time.time()
                owned = _mine()  # the staging set and `keep`
                report["segments"] = len(owned)
            del x  # a comm.empty one is freed: its segment goes, by its owner's hand
            lost |= owned - _mine()
            time.sleep(rng.uniform(0.5, 1.5) * a.pace)
        report["result"] = "ok"
    except RuntimeError as exc:
        if "injected failure" in str(exc):
            raise
        report["result"] = f"{type(exc).__name__}: {exc}"
    report.update(wrong=wrong, lost=sorted(lost), t_end=time.time())
    _say(report)
    comm.shutdown()
    if report["result"] != "ok":
        os._exit(0)  # the process group may be wedged by the dead peer
    dist.destroy_process_group()


# ------------------------------------------------------------------ the test side
@dataclass
class Job:
    """One job's plan (drawn from the seeded RNG) and, once ended, what its ranks said."""

    index: int
    steps: int
    fate: str
    victim: int
    at: int
    pace: float
    procs: list[subprocess.Popen] = field(default_factory=list)
    reports: list[list[dict]] = field(default_factory=list)
    stderr: list[str] = field(default_factory=list)

    @property
    def salt(self) -> int:
        return 7 + self.index

    def start(self, tmp: Path) -> None:
        folder = tmp / f"job{self.index}"
        folder.mkdir()
        env = dict(os.environ, OMP_NUM_THREADS="1", GRADRING_TRANSPORT="shm",
                   GRADRING_TIMEOUT="30")
        args = [f"--job={self.index}", f"--steps={self.steps}", f"--victim={self.victim}",
                f"--at={self.at}", f"--salt={self.salt}", f"--store={folder / 'store'}",
                f"--fate={self.fate}", f"--pace={self.pace}"]
        self.procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__),
                                        f"--rank={r}", *args], stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True, env=env)
                      for r in range(WORLD)]

    def collect(self) -> None:
        for p in self.procs:
            out, err = p.communicate(timeout=120)
            self.reports.append([json.loads(line) for line in out.splitlines()
                                 if line.startswith("{")])
            self.stderr.append(err)

    def pids(self) -> list[int]:
        return [r[0]["pid"] for r in self.reports if r]


def _plan(rng: random.Random, index: int, fate: str) -> Job:
    steps = rng.randrange(4, 16)
    return Job(index, steps, fate, victim=rng.randrange(WORLD), at=rng.randrange(1, steps),
               pace=rng.choice([0.05, 0.2, 0.4]))


class _Sweeper(threading.Thread):
    """This process sweeping /dev/shm in a loop, as every starting job does once."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.stop = threading.Event()
        self.removed: list[str] = []

    def run(self) -> None:
        while not self.stop.wait(0.005):
            self.removed += segments.remove_stale_segments()


def _overlaps(jobs: list[Job]) -> int:
    """How many connects (with their sweep) fell inside another job's training."""
    spans = {j.index: [(r[-1].get("t_connect"), r[-1].get("t_end")) for r in j.reports
                       if r and "t_end" in r[-1]] for j in jobs}
    n = 0
    for j in jobs:
        for t, _ in spans[j.index]:
            n += any(a is not None and a < t < b for k in jobs if k is not j
                     for a, b in spans[k.index] if t is not None)
    return n


def test_concurrent_jobs_get_their_own_results_and_keep_their_segments(tmp_path) -> None:
    rng = random.Random(SEED)
    plans = [_plan(rng, i, fate) for i, fate in enumerate(rng.sample(FATES, len(FATES)))]
    waiting, running, ended = list(plans), [], []
    sweeper = _Sweeper()
    sweeper.start()
    try:
        while waiting or running:
            while waiting and len(running) < SLOTS:
                job = waiting.pop(0)
                job.start(tmp_path)
                running.append(job)
            time.sleep(0.05)
            for job in [j for j in running if all(p.poll() is not None for p in j.procs)]:
                running.remove(job)
                job.collect()
                ended.append(job)
    finally:
        sweeper.stop.set()
        sweeper.join()
        for job in plans:
            for p in job.procs:
                if p.poll() is None:
                    p.kill()
    everyone = {pid for j in ended for pid in j.pids()}
    for job in ended:  # shown with -s, and by pytest on a failure
        print(f"job {job.index}: {job.fate} (rank {job.victim} at step {job.at}), "
              f"{job.steps} steps at {job.pace}s, pids {job.pids()}: "
              f"{[r[-1].get('result') for r in job.reports if r]}")
    print(f"{_overlaps(ended)} connects inside another job's training; this process's "
          f"sweep removed {len(sweeper.removed)} names: {sweeper.removed}")
    for job in ended:
        what = f"job {job.index} ({job.fate}, rank {job.victim} at step {job.at})"
        assert all(job.reports), (what, job.stderr)
        others = everyone - set(job.pids())
        survivors = range(WORLD) if job.fate == "healthy" else [1 - job.victim]
        for r in survivors:
            final = job.reports[r][-1]
            assert final["wrong"] == 0 and final["lost"] == [], (what, final)
            assert final["segments"] >= 2, (what, final)  # staging and `keep` at least
            if job.fate == "healthy":
                assert final["result"] == "ok", (what, final, job.stderr[r])
                assert job.procs[r].returncode == 0, (what, job.stderr[r])
                continue
            msg = final["result"]
            dead = job.reports[job.victim][0]["pid"]
            assert msg.startswith("CollectiveError") and \
                f"rank {job.victim} (pid {dead})" in msg, (what, msg)
            assert not [q for q in others if f"pid {q})" in msg], (what, msg)
        if job.fate == "kill":
            assert job.procs[job.victim].returncode == -signal.SIGKILL, what
        elif job.fate == "raise":
            assert job.procs[job.victim].returncode == 1, what
            assert "injected failure" in job.stderr[job.victim], what
    assert {j.fate for j in ended} == {"healthy", "kill", "raise"}
    assert _overlaps(ended) >= 1, "no job started while another trained"
    left = [n for n in os.listdir(segments.SHM_DIR)
            if (owner := segments.owner_of(n)) is not None and owner[0] in everyone]
    assert left == [], left


# ------------------------------------------- the sweep's rules, deterministically
def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_pid_reused_during_the_sweep_keeps_its_new_owners_segments(
        tmp_path, monkeypatch) -> None:
    # A dead peer's pid goes to another job's rank, whose first transport has the same
    # prefix, between the two steps of remove_dead_owners: the newcomer's names stay.
    pid, ns = _dead_pid(), segments.pid_namespace()
    base = segments.segment_base(pid, ns, 0)
    (tmp_path / f"{base}-0dead").touch()  # what the dead peer left
    reused = []
    listdir = os.listdir

    def listdir_while_the_pid_is_reused(path: str) -> list[str]:
        if not reused:
            reused.append(True)
            (tmp_path / f"{base}-1live").touch()  # the newcomer's fresh segment
        return listdir(path)

    monkeypatch.setattr(segments.os, "listdir", listdir_while_the_pid_is_reused)
    monkeypatch.setattr(segments, "pid_alive", lambda p: bool(reused) if p == pid else True)
    assert segments.remove_dead_owners(base, str(tmp_path)) == []
    assert segments.remove_stale_segments(str(tmp_path)) == []
    assert sorted(os.listdir(tmp_path)) == [f"{base}-0dead", f"{base}-1live"]
    monkeypatch.setattr(segments, "pid_alive", lambda p: False)  # the newcomer ends too
    assert sorted(segments.remove_dead_owners(base, str(tmp_path))) == \
        [f"{base}-0dead", f"{base}-1live"]


def test_no_sweep_where_the_pid_namespace_is_unknown(tmp_path, monkeypatch) -> None:
    # Without /proc/self/ns/pid every process says namespace 0, whichever it is in: a pid
    # dead here may be alive in another namespace that shares /dev/shm.
    name = f"{segments.segment_base(_dead_pid(), 0, 0)}-00"
    (tmp_path / name).touch()
    monkeypatch.setattr(segments, "pid_namespace", lambda: 0)
    assert segments.remove_stale_segments(str(tmp_path)) == []
    assert os.listdir(tmp_path) == [name]


if __name__ == "__main__":
    _rank_main(sys.argv[1:])
