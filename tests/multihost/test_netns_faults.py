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
import time

import pytest

from gradring.comm.transports.shm.layout import control_size
from tests.multihost.netns_harness import TwoHosts, describe, records, unavailable

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")
CAP_S = 180.0  # per launch: generous, 4 ranks + 2 agents on a 2-core VM
#: Two control segments of 2 ranks fit, with 32 KiB to spare: a 64 KiB staging buffer
#: does not.
SMALL_SHM = f"{2 * control_size(2) // 1024 + 32}k"
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


# -- a host cut off from the others ------------------------------------------------------
#: gradring's deadline in the partition runs; gloo's own (the process group's) is 60 s
#: (worker.py), so an error that says "timed out after 15s" came from gradring's deadline
#: and not from gloo's: the order of two deadlines, not a measured duration.
PARTITION_TIMEOUT = "15"


class _Partition:
    """``tick`` for TwoHosts.torchrun: sets the link down once every rank said MH_READY;
    with ``up_after_s`` sets it up again that many seconds later (a flap). Ends the run
    once all 4 ranks reported an error, or finished."""

    def __init__(self, hosts: TwoHosts, up_after_s: float | None = None) -> None:
        self.hosts = hosts
        self.up_after_s = up_after_s
        self.down_at: float | None = None
        self.up_at: float | None = None

    def __call__(self, outputs: list[str]) -> bool:
        text = "\n".join(outputs)
        if self.down_at is None and text.count("MH_READY ") >= 4:
            self.hosts.link(up=False)
            self.down_at = time.monotonic()
        if self.down_at is not None and self.up_at is None and self.up_after_s is not None \
                and time.monotonic() - self.down_at >= self.up_after_s:
            self.hosts.link(up=True)
            self.up_at = time.monotonic()
        done = text.count("MH_ERROR ") + text.count("MH_RESULT ")
        return done >= 4


def _partition_run(hosts: TwoHosts, tick: _Partition, steps: str) -> tuple[list, str]:
    try:
        runs = hosts.torchrun(WORKER, ["partition", "--victim", "-1", "--at-step", "5",
                                       "--steps", steps, "--linger", LINGER_S],
                              nproc_per_node=2, timeout=CAP_S, tick=tick,
                              env={"GRADRING_TIMEOUT": PARTITION_TIMEOUT})
    finally:
        hosts.link(up=True)  # for the next test, whatever happened
    return runs, describe(runs)


@pytest.mark.parametrize("attempt", range(3))
def test_cut_off_host_fails_every_rank_naming_the_partition(hosts, attempt):
    """The link goes down mid-training and stays down. Every rank must raise (before, the
    cut-off host's ranks hung in a store call under the board's lock until killed): the
    cut-off ranks say the store is unreachable, the others call them unreachable (not
    "alive"), both at gradring's deadline, before gloo's."""
    tick = _Partition(hosts)
    runs, text = _partition_run(hosts, tick, "100000")
    assert tick.down_at is not None, "the ranks never got ready:\n" + text
    errors = {d["rank"]: d["error"] for d in records(runs, "MH_ERROR")}
    assert sorted(errors) == [0, 1, 2, 3], "not every rank raised:\n" + text
    store = f"the store at {hosts.hosts[0].addr}:"
    for r in (2, 3):  # host b: the store (torchrun's, on host a) is out of reach
        assert store in errors[r] and "is unreachable" in errors[r], text
        assert "timed out after" in errors[r], text
    for r in (0, 1):  # host a: ranks 2 and 3 are cut off, and never called alive
        assert re.search(r"rank [23] is unreachable", errors[r]), text
        assert not re.search(r"rank [23] (\(pid \d+\) is alive|posted nothing)", errors[r]), text
        assert "timed out after" in errors[r], text


@pytest.mark.parametrize("attempt", range(3))
def test_link_down_then_up_before_the_deadline_trains_on(hosts, attempt):
    """A flap shorter than the deadline: the link is down for 3 s, then up. The store
    calls that found no answer meanwhile must not have broken anything: every rank
    finishes its steps, none raises."""
    tick = _Partition(hosts, up_after_s=3.0)
    runs, text = _partition_run(hosts, tick, "300")
    assert tick.down_at is not None and tick.up_at is not None, text
    assert not records(runs, "MH_ERROR"), text
    done = sorted(d["rank"] for d in records(runs, "MH_RESULT") if d.get("finished"))
    assert done == [0, 1, 2, 3], text
