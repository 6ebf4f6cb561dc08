"""A live job sweeps what a job whose ranks were all killed -9 left in /dev/shm (see
[Note: a live job sweeps too] in gradring/comm/transports/shm/segments.py).

Two jobs of this file (run as a script it is a rank: ``--job doomed|live``): the
doomed job maps segments and idles; the live job connects before the doomed one is
killed (so its connect-time sweep cannot be what removes them), then runs
collectives whose waits sleep. The test kills every rank of the doomed job with
SIGKILL, checks that their segments stay (nobody of their job is left to remove
them), and then that the live job's ranks, still running, see them gone.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))  # the repository
sys.path.insert(0, ROOT)

import pytest  # noqa: E402

from tests.support import jobs  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def _left_by(pids: list[int]) -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm")
                  if any(n.startswith(f"gradring-{p}-") for p in pids))


def _wait_for(path: str, timeout: float = 90.0) -> None:
    end = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.05)


# ----------------------------------------------------------------------- job side
def _rank(a: argparse.Namespace) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from gradring import comm
    from gradring.comm.transports.shm import segments

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(a.store, 2), rank=a.rank,
                            world_size=2, timeout=timedelta(seconds=60))
    comm.all_reduce(torch.ones(100_000))  # connects shm, and stages: a data segment
    held = comm.empty(10_000)  # another
    comm.all_reduce(held)
    with open(os.path.join(a.tmp, f"{a.job}-{a.rank}.ready"), "w") as f:
        f.write(str(os.getpid()))
    if a.job == "doomed":
        time.sleep(600)  # until the test kills it
        return
    _wait_for(os.path.join(a.tmp, "killed"))
    with open(os.path.join(a.tmp, "killed")) as f:
        doomed = json.load(f)
    segments.SWEEP_S = 0.2  # a minute by default: this test cannot wait that long
    for _ in range(8):
        if a.rank == 1:
            time.sleep(0.12)  # rank 0 waits for it a whole sleeping slice or more
        comm.all_reduce(torch.ones(2))
    print(json.dumps({"rank": a.rank, "left": _left_by(doomed)}), flush=True)
    comm.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------- test side
def _start(job: str, tmp: str) -> list:
    store = os.path.join(tmp, f"store-{job}")
    return jobs.start(os.path.abspath(__file__), 2,
                      lambda r: ["--job", job, "--rank", str(r), "--store", store, "--tmp", tmp],
                      jobs.job_env())


def test_a_live_job_sweeps_what_a_killed_job_left(tmp_path) -> None:
    from gradring.comm.transports.shm import segments

    tmp = str(tmp_path)
    doomed = _start("doomed", tmp)
    live = _start("live", tmp)
    pids: list[int] = []
    try:
        for job in ("doomed", "live"):
            for r in (0, 1):
                _wait_for(os.path.join(tmp, f"{job}-{r}.ready"))
        pids = [p.pid for p in doomed]
        for p in doomed:
            os.kill(p.pid, signal.SIGKILL)
        for p in doomed:
            p.wait(timeout=30)
        left = _left_by(pids)
        assert left, "the doomed job mapped no segment of its own"
        with open(os.path.join(tmp, "killed.tmp"), "w") as f:
            json.dump(pids, f)
        os.rename(os.path.join(tmp, "killed.tmp"), os.path.join(tmp, "killed"))
        out = jobs.collect(live, 120)
        for r, rank in enumerate(out):
            assert rank["code"] == 0, rank["stderr"]
            (report,) = rank["reports"]
            assert report["rank"] == r
        # Rank 0's waits slept: it swept while its job was live.
        assert out[0]["reports"][0]["left"] == [], (left, out[0]["reports"])
    finally:
        for p in doomed + live:
            if p.poll() is None:
                p.kill()
                p.wait()
        segments.remove_stale_segments()


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--job", choices=["doomed", "live"], required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--store", required=True)
    p.add_argument("--tmp", required=True)
    _rank(p.parse_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
