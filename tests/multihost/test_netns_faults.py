"""Hierarchical groups under faults, across two namespace "hosts" of 2 ranks each.

Same harness and skip rules as ``test_netns.py`` (root, ``ip netns``). Asserts
events and what errors name, never durations:

- ``small /dev/shm``: host b's /dev/shm holds its control segments but no
  staging buffer. Its ranks drop shared memory in the same collective and run
  their intra-host phases over the process group; training still equals the
  single-process oracle, host b prints the /dev/shm warning, host a keeps
  shared memory (see [Note: a host without room in /dev/shm] in
  ``gradring/comm/algos/hierarchical.py``).
- ``raise``: rank 1 raises inside the intra-host phase of an all-reduce; its
  host peer fails naming the exception *before* rank 1 exits (rank 1's
  failure fails its host's shared memory), every other rank fails naming a
  failed rank, none by timeout.
- ``raise-late``: rank 1 raises after the all-gather barrier (the data work
  after the last barrier); its host peer fails that same collective instead
  of returning success (the closing barrier of the intra-host phases).

A killed rank is ``test_netns.py``'s ``kill`` case.

In the fault runs every rank waits (``--linger``) after its error before it
exits, so "failed because a peer failed" is told apart from "failed because
a peer exited".
"""

from __future__ import annotations

import json
import os
import re

import pytest

from tests.multihost.netns_harness import TwoHosts, describe, records, unavailable

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")
CAP_S = 180.0  # per launch: generous, 4 ranks + 2 agents on a 2-core VM
#: Two control segments of 2 ranks (2 x 2052 KiB) fit; a 64 KiB staging buffer does not.
SMALL_SHM = "4160k"
LINGER_S = "4"

_WHY = unavailable()
pytestmark = [pytest.mark.skipif(_WHY is not None, reason=f"multi-host harness: {_WHY}"),
              pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def hosts():
    with TwoHosts() as h:
        yield h


def _events(run) -> list[tuple[str, dict]]:
    """``(tag, record)`` of the MH_ERROR and MH_EXIT lines of one host, in output order."""
    out = []
    for line in run.output.splitlines():
        for tag in ("MH_ERROR", "MH_EXIT"):
            if line.startswith(tag + " "):
                out.append((tag, json.loads(line[len(tag):])))
    return out


def _error_before_exit(run, rank: int, other: int) -> dict:
    """Rank ``rank``'s error, asserted to come before rank ``other`` exits (same host)."""
    events = _events(run)
    err = [i for i, (t, d) in enumerate(events) if t == "MH_ERROR" and d["rank"] == rank]
    gone = [i for i, (t, d) in enumerate(events) if t == "MH_EXIT" and d["rank"] == other]
    assert err, f"rank {rank} reported no error"
    assert not gone or err[0] < gone[0], f"rank {rank} failed only after rank {other} exited"
    return events[err[0]][1]


def test_small_dev_shm_on_one_host_falls_back_and_trains(hosts):
    runs = hosts.torchrun(WORKER, ["train", "--steps", "4"], nproc_per_node=2, timeout=CAP_S,
                          shm_sizes={1: SMALL_SHM})
    text = describe(runs)
    assert all(r.returncode == 0 for r in runs), text
    res = sorted(records(runs, "MH_RESULT"), key=lambda d: d["rank"])
    assert [d["rank"] for d in res] == [0, 1, 2, 3], text
    small = hosts.hosts[1].hostname
    for d in res:
        # Still hierarchical on both hosts; only the small host gave shared memory up.
        assert d["topology"] is not None and d["topology"].startswith("2 host(s)"), d
        assert d["shared_memory"] is (d["host"] != small), d
        assert d["param_diff"] < 1e-10, d
        assert d["grad_diff"] < 1e-12, d
        assert d["sum_diff"] < 1e-4, d
        assert d["sum_err"] < 1e-4, d
    a, b = runs
    assert "is too small for gradring's shared-memory transport" in b.output, text
    assert "intra-host phases on host" in b.output, text
    # One warning per rank of the small host, with one figure for the job's need.
    needs = re.findall(r"these 2 rank\(s\) need about (\d+) MiB", b.output)
    assert len(needs) == 2 and len(set(needs)) == 1, text
    assert "gradring warning" not in a.output, text


def test_raise_in_intra_host_phase_fails_every_rank_naming_it(hosts):
    victim = 1  # host a: ranks 0, 1; host b: ranks 2, 3
    runs = hosts.torchrun(WORKER, ["raise", "--victim", str(victim), "--at-step", "3",
                                   "--steps", "100000", "--linger", LINGER_S],
                          nproc_per_node=2, timeout=CAP_S, env={"GRADRING_TIMEOUT": "60"})
    text = describe(runs)
    assert all(r.returncode is not None and r.returncode != 0 for r in runs), text
    errors = {d["rank"]: d["error"] for d in records(runs, "MH_ERROR")}
    assert sorted(errors) == [0, 1, 2, 3], text
    assert "injected fault" in errors[victim], text
    # The host peer names the exception, and before the victim exited.
    peer = _error_before_exit(runs[0], 0, victim)
    assert "injected fault in the intra-host phase on rank 1" in peer["error"], text
    assert "timed out" not in peer["error"], text
    for r in (2, 3):
        assert "timed out" not in errors[r], text
        assert "rank 1" in errors[r] or "rank 0" in errors[r], text


def _collective(error: str) -> str:
    """The collective an error is about (its first ``all_reduce #N``)."""
    m = re.search(r"all_reduce #\d+", error)
    assert m, error
    return m.group(0)


def test_raise_after_gather_barrier_fails_the_same_collective_on_the_host(hosts):
    """The closing agreement of the intra-host phases: rank 1 fails after the last
    barrier of the all-gather; its host peer must fail that same collective, not
    return success and fail the next one."""
    victim = 1
    runs = hosts.torchrun(WORKER, ["raise-late", "--victim", str(victim), "--at-step", "3",
                                   "--steps", "100000", "--linger", LINGER_S],
                          nproc_per_node=2, timeout=CAP_S, env={"GRADRING_TIMEOUT": "60"})
    text = describe(runs)
    assert all(r.returncode is not None and r.returncode != 0 for r in runs), text
    errors = {d["rank"]: d["error"] for d in records(runs, "MH_ERROR")}
    assert sorted(errors) == [0, 1, 2, 3], text
    assert "injected fault after the all-gather barrier" in errors[victim], text
    peer = _error_before_exit(runs[0], 0, victim)
    assert _collective(peer["error"]) == _collective(errors[victim]), text
    assert "injected fault after the all-gather barrier on rank 1" in peer["error"], text
    for r in (2, 3):
        assert "timed out" not in errors[r], text
