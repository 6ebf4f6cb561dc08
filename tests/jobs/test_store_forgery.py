"""A forged store value in a real job: the wait ends with an error naming the key.

Any local process that can reach a job's store can write a rank's board key.
``"42"`` there used to kill rank 0's watchdog thread (``TypeError: 'int'
object is not subscriptable``), and rank 0 then waited with no deadline at
all. Here rank 1 plays that other process: after a first all-reduce it writes
raw bytes to its own board key through the store and stays away from the next
collective; rank 0 must fail that collective with an error that names the key,
and exit. gradring's deadline (``GRADRING_TIMEOUT``) and torch's own are
longer than the test's limit, so a rank 0 that only stopped at a deadline
fails the test (see [Note: the store is not trusted] in gradring/comm/board.py).

This file doubles as the job script:
``python tests/jobs/test_store_forgery.py --rank R --store PATH --value V``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repository root

from tests.support import jobs  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

#: gradring's deadline in the job: far beyond the test's wait for the job.
DEADLINE_S = "600"
#: How long the test waits for the whole job (a broken rank 0 is killed then).
JOB_LIMIT_S = 150.0
#: The board key of rank 1 in the first board generation of the default group.
KEY = "gradring/board/0/1"


# ----------------------------------------------------------------------- job side
def _say(**report: object) -> None:
    print(json.dumps(report), flush=True)


def _wait_for(path: str, limit_s: float = 120.0) -> None:
    """Block until ``path`` exists; ``limit_s`` only bounds a broken job's wait."""
    give_up = time.monotonic() + limit_s
    while not os.path.exists(path) and time.monotonic() < give_up:
        time.sleep(0.01)


def _job_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--store", required=True)
    p.add_argument("--value", required=True)
    a = p.parse_args(argv)

    import torch
    import torch.distributed as dist

    from gradring import comm
    from gradring.comm.store import group_store

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(a.store, 2), rank=a.rank,
                            world_size=2, timeout=timedelta(seconds=int(DEADLINE_S)))
    comm.all_reduce(torch.ones(4))  # both ranks: settings agreed, boards attached
    if a.rank == 1:
        group_store(dist.group.WORLD).set(KEY, a.value.encode())
        _say(rank=1, forged=KEY)
        open(f"{a.store}.forged", "w").close()
        _wait_for(f"{a.store}.failed")  # stay away from rank 0's next collective
        os._exit(0)
    _wait_for(f"{a.store}.forged")
    try:
        comm.all_reduce(torch.ones(4))
        _say(rank=0, error=None)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        _say(rank=0, error=f"{type(exc).__name__}: {exc}")
    open(f"{a.store}.failed", "w").close()
    os._exit(0)  # the process group is wedged by the collective rank 1 never joined


# ---------------------------------------------------------------------- test side
FORGERIES = [
    ("42", "is a JSON int"),
    ('{"state": "waiting"}', "seq None"),
    ("\u00ff not json", "is not JSON"),
]


@pytest.mark.parametrize("env", [{"GRADRING_ALGO": "native"}, {"GRADRING_TRANSPORT": "torch"}],
                         ids=["native", "torch"])
@pytest.mark.parametrize("value,problem", FORGERIES, ids=["int", "fields", "bytes"])
def test_forged_board_value_fails_rank0_naming_the_key(tmp_path, env, value, problem) -> None:
    store = str(tmp_path / "store")
    procs = jobs.start(os.path.abspath(__file__), 2,
                       lambda r: ["--rank", str(r), "--store", store, "--value", value],
                       jobs.job_env({"GRADRING_TIMEOUT": DEADLINE_S, **env}))
    ranks = jobs.collect(procs, JOB_LIMIT_S)  # kills the job if it outlives the limit
    assert [r["code"] for r in ranks] == [0, 0], [r["stderr"] for r in ranks]
    (report,) = [r for r in ranks[0]["reports"] if "error" in r]
    err = report["error"]
    assert err is not None, "the collective succeeded without rank 1"
    assert f"StoreValueError: gradring: the value of store key '{KEY}'" in err, err
    assert problem in err and "all_reduce #2" in err, err
    assert "timed out" not in err, err
    assert "Traceback" not in ranks[0]["stderr"], ranks[0]["stderr"]  # no thread died


if __name__ == "__main__":
    _job_main(sys.argv[1:])
