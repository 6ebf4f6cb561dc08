"""Two or three independent jobs on one host never disturb each other.

Several small jobs (world 2, each with its own FileStore, fresh processes) run
at once. A healthy *anchor* job connects first and trains until every other
job has ended; the others run two at a time, a job that ends making room for
the next. So every other job starts -- and each fresh process sweeps /dev/shm
for stale segments at its first connect (``segments.remove_stale_segments``)
-- while the anchor and usually another job train. A seeded RNG decides the
other jobs' steps, pace and fate: healthy, a rank killed with ``kill -9``, or
a rank raising. Meanwhile this process sweeps /dev/shm itself every few
milliseconds, as a hostile neighbour would.

Each job must get exactly its own result: a healthy job the right sums (a
per-job salt in every value, so another job's data would show) and no error;
a crashed job an error on the survivor naming the dead rank *of its own job*
(rank and pid) and no other job's pid. Every rank checks after each step that
every segment it has owned is still in /dev/shm unless it unlinked it itself
(a freed ``comm.empty`` buffer, a staging set that grew), so a segment lost to
another job's sweep fails the test. This file doubles as the rank script
(``python tests/jobs/test_concurrent_jobs.py --job ...``).
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
SLOTS = 2  # besides the anchor
SEED = 3131
#: The other jobs' fates, in an order the seeded RNG shuffles.
FATES = ["healthy", "kill", "kill", "raise"]


# ------------------------------------------------------------------ the rank side
def _mine() -> set[str]:
    return {n for n in os.listdir(segments.SHM_DIR) if n.startswith(f"gradring-{os.getpid()}-")}


def _say(report: dict[str, object]) -> None:
    print(json.dumps(report), flush=True)


def _record_own_unlinks() -> set[str]:
    """The names this process unlinks itself from now on (every own unlink goes through
    ``segments.unlink_quietly``): freed, not lost."""
    released: set[str] = set()
    unlink = segments.unlink_quietly

    def recording(name: str, owner_pid: int | None = None) -> None:
        if owner_pid is None or owner_pid == os.getpid():
            released.add(name)  # before the unlink: whoever sees it gone sees it here
        unlink(name, owner_pid)

    segments.unlink_quietly = recording
    return released


def _rank_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    for name in ("job", "rank", "steps", "victim", "at", "salt"):
        p.add_argument(f"--{name}", type=int, required=True)
    p.add_argument("--store", required=True)
    p.add_argument("--until", default="", help="train until this file exists (the anchor)")
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
    released = _record_own_unlinks()
    owned: set[str] = set()
    lost: set[str] = set()
    wrong = 0
    base = 1000.0 * a.salt
    try:
        for step in range(a.steps):
            if a.until:  # both ranks stop at the same step: either one seeing the file
                flag = torch.tensor([float(os.path.exists(a.until))])
                comm.all_reduce(flag)
                if flag.item():
                    break
            if a.fate != "healthy" and a.rank == a.victim and step == a.at:
                if a.fate == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError(f"job {a.job} rank {a.rank}: injected failure at step {step}")
            x = comm.empty(3000) if step % 2 else torch.empty(3000)
            for t in (x, keep):
                t.fill_(base + a.rank + step)
                comm.all_reduce(t)
                wrong += int(not torch.all(t == WORLD * (base + step) + sum(range(WORLD))))
            if step == 0:
                report["t_connect"] = time.time()
                report["segments"] = len(_mine())  # the staging set and `keep` at least
                _say({"connected": report["t_connect"]})
            del x  # a comm.empty one is freed: its segment goes, by its owner's hand
            present = _mine()
            lost |= owned - present - released  # ours, gone, and not by our hand
            owned |= present
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
    until: str = ""
    procs: list[subprocess.Popen] = field(default_factory=list)
    reports: list[list[dict]] = field(default_factory=list)
    stderr: list[str] = field(default_factory=list)
    connected: list[float | None] = field(default_factory=list)  # per rank, wall clock

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
                f"--fate={self.fate}", f"--pace={self.pace}", f"--until={self.until}"]
        self.procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__),
                                        f"--rank={r}", *args], stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True, env=env)
                      for r in range(WORLD)]

    def wait_connected(self) -> None:
        """Until rank 0 has trained its first step (or ended)."""
        out = self.procs[0].stdout
        assert out is not None
        self._head = [out.readline()]
        while self._head[-1] and "connected" not in self._head[-1]:
            self._head.append(out.readline())

    def collect(self) -> None:
        for r, p in enumerate(self.procs):
            out, err = p.communicate(timeout=120)
            said = [json.loads(line) for line in
                    (getattr(self, "_head", []) if r == 0 else []) + out.splitlines()
                    if line.startswith("{")]
            self.reports.append([d for d in said if "connected" not in d])
            self.connected.append(next((d["connected"] for d in said if "connected" in d), None))
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


def _connects_inside(jobs: list[Job], anchor: Job) -> tuple[int, int]:
    """How many other jobs' ranks connected (and swept) while the anchor trained, and of
    how many that connected at all."""
    starts = [t for j in jobs if j is not anchor for t in j.connected if t is not None]
    spans = [(t, r[-1].get("t_end", 0.0)) for t, r in zip(anchor.connected, anchor.reports)]
    if not spans or None in anchor.connected or len(anchor.reports) < WORLD:
        return 0, len(starts)
    return sum(all(a < t < b for a, b in spans) for t in starts), len(starts)


def test_concurrent_jobs_get_their_own_results_and_keep_their_segments(tmp_path) -> None:
    rng = random.Random(SEED)
    stop = tmp_path / "stop"
    anchor = Job(0, 100_000, "healthy", victim=0, at=0, pace=0.05, until=str(stop))
    plans = [anchor] + [_plan(rng, i + 1, fate)
                        for i, fate in enumerate(rng.sample(FATES, len(FATES)))]
    waiting, running, ended = plans[1:], [anchor], []
    sweeper = _Sweeper()
    sweeper.start()
    try:
        anchor.start(tmp_path)
        anchor.wait_connected()
        while waiting or running:
            while waiting and len(running) < SLOTS + 1:
                job = waiting.pop(0)
                job.start(tmp_path)
                running.append(job)
            time.sleep(0.05)
            if running == [anchor]:
                stop.touch()
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
    inside, connects = _connects_inside(ended, anchor)
    print(f"{inside} of {connects} other ranks connected while the anchor trained; this "
          f"process's sweep removed {len(sweeper.removed)} names: {sweeper.removed}")
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
    assert inside == connects == 2 * len(FATES), (inside, connects)
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
