"""Job side of ``tests/jobs/test_shm_hardening.py``: small jobs of real rank processes.

``python tests/support/shm_jobs.py launch --scenario NAME --world W --tmp DIR [--shm-size 8m]``
starts W ranks of this file (``rank`` mode), each in a fresh gloo process group
(with ``tests/support/jobs.py``, the harness of every fault job), and prints one
JSON object: every rank's reports (the JSON lines it printed),
exit status and stderr. With ``--shm-size`` the launcher first re-executes
itself under ``unshare --mount`` and mounts a tmpfs of that size on /dev/shm,
so the job sees a small /dev/shm and the mount vanishes with the job.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repository root

from tests.support import jobs  # noqa: E402


def say(**report: object) -> None:
    print(json.dumps(report), flush=True)


def launch(a: argparse.Namespace) -> None:
    if a.shm_size and not a.inside:
        cmd = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
               f"mount -t tmpfs -o size={a.shm_size},mode=1777 tmpfs /dev/shm && exec "
               f"\"$0\" \"$@\" --inside", sys.executable, os.path.abspath(__file__),
               *sys.argv[1:]]
        os.execvp(cmd[0], cmd)
    store = os.path.join(a.tmp, f"store-{a.scenario}-{time.monotonic_ns()}")
    procs = jobs.start(os.path.abspath(__file__), a.world,
                       lambda r: ["rank", "--scenario", a.scenario, "--rank", str(r),
                                  "--world", str(a.world), "--store", store, "--tmp", a.tmp],
                       jobs.job_env(drop=()))
    result = {"ranks": jobs.collect(procs, a.timeout, on_timeout="record")}
    if a.shm_size:
        result["leftover"] = sorted(n for n in os.listdir("/dev/shm")
                                    if n.startswith("gradring-"))
    print(json.dumps(result), flush=True)


def rank_main(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from tests.support import shm_scenarios

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(a.store, a.world), rank=a.rank,
                            world_size=a.world, timeout=timedelta(seconds=60))
    say(rank=a.rank, pid=os.getpid(), started=time.time())
    hard = getattr(shm_scenarios, a.scenario)(a.rank, a.world, a.tmp)
    if not hard:  # the normal way out: gradring's shutdown and exit hooks run
        sys.exit(0)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the process group may be wedged by a failed peer


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["launch", "rank"])
    p.add_argument("--scenario", required=True)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--store", default="")
    p.add_argument("--tmp", required=True)
    p.add_argument("--shm-size", default="")
    p.add_argument("--timeout", type=float, default=120)
    p.add_argument("--inside", action="store_true")
    a = p.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    (launch if a.mode == "launch" else rank_main)(a)


if __name__ == "__main__":
    main(sys.argv[1:])
