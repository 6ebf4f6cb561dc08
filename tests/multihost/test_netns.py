"""gradring across two "hosts" (network namespaces, 2 ranks each) under torchrun.

Needs root and ``ip netns``/``unshare``; otherwise every test here is skipped
with the reason. Two torchrun launches (each about 20 s on a 2-core VM):

- ``train``: DDP over 2 hosts x 2 ranks (hierarchical all-reduce: shared memory
  inside a host, gloo point-to-point across) equals one process on the global
  batch; the hierarchical and the flat ring all-reduce give equal gradients;
  the topology really is two hosts (own hostname and /dev/shm on each side).
- ``kill``: one rank SIGKILLs itself mid-training; the other host's ranks fail
  with an error naming it and every torchrun exits non-zero, well before
  the time cap.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.multihost.netns_harness import TwoHosts, describe, records, unavailable

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")
CAP_S = 180.0  # per launch: generous, 4 ranks + 2 agents on a 2-core VM

_WHY = unavailable()
pytestmark = [pytest.mark.skipif(_WHY is not None, reason=f"multi-host harness: {_WHY}"),
              pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def hosts():
    with TwoHosts() as h:
        yield h


def test_ddp_across_two_hosts_matches_oracle(hosts):
    runs = hosts.torchrun(WORKER, ["train", "--steps", "4"], nproc_per_node=2, timeout=CAP_S)
    assert all(r.returncode == 0 for r in runs), describe(runs)
    res = sorted(records(runs, "MH_RESULT"), key=lambda d: d["rank"])
    assert [d["rank"] for d in res] == [0, 1, 2, 3], describe(runs)
    # Two hosts of two ranks, each rank on the host whose hostname it reports.
    for d in res:
        assert d["topology"] is not None and d["topology"].startswith("2 host(s)"), d
        assert f"{d['host']}: ranks" in d["topology"], d
    by_host: dict[str, list[int]] = {}
    for d in res:
        by_host.setdefault(d["host"], []).append(d["rank"])
    assert sorted(len(v) for v in by_host.values()) == [2, 2], by_host
    for d in res:
        assert d["param_diff"] < 1e-10, d  # float64 model vs single-process oracle
        assert d["grad_diff"] < 1e-12, d  # hierarchical vs flat ring, float64 DDP grads
        assert d["sum_diff"] < 1e-4, d  # ... float32 all-reduce of 786k elements
        assert d["sum_err"] < 1e-4, d


def test_killed_rank_fails_the_other_host(hosts):
    victim = 3
    runs = hosts.torchrun(WORKER, ["kill", "--victim", str(victim), "--at-step", "3",
                                   "--steps", "100000"],
                          nproc_per_node=2, timeout=CAP_S, env={"GRADRING_TIMEOUT": "60"})
    text = describe(runs)
    assert all(r.returncode is not None for r in runs), "a host hung:\n" + text
    assert all(r.returncode != 0 for r in runs), text
    (killed,) = records(runs, "MH_VICTIM")
    assert killed["rank"] == victim
    other = next(r for r in runs if r.host.hostname != killed["host"])
    errors = [json.loads(line) for line in other.lines("MH_ERROR")]
    assert errors, "no error reported on the other host:\n" + text
    assert any(f"rank {victim}" in e["error"] for e in errors), text
