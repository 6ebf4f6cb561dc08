"""Settings that must match across ranks are compared when a group's state is made.

A ``GRADRING_TRANSPORT=torch`` on rank 0 only used to wait for the whole timeout
and fail with ``DistStoreError ... gradring/shm/0/info/0`` and "rank 1 posted
nothing"; ``GRADRING_CHECK=1`` on one rank only reported "[shape differ]" for
identical shapes. Now every rank raises at the group's first gradring call,
naming the variable and each rank's value (see [Note: agreed settings] in
``gradring/comm/agree.py``). All cases run in one pooled job (about 5 s).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import pytest
import torch
from torch import nn

import gradring
from gradring import comm
from gradring.comm import agree, runner
from gradring.comm.context import context
from gradring.comm.transports.shm import segments, space

pytestmark = pytest.mark.timeout(120)

_VARS = ("GRADRING_TRANSPORT", "GRADRING_ALGO", "GRADRING_CHECK", "GRADRING_TIMEOUT")


def _case(rank: int, env: dict[str, str], first: Callable[[], object]) -> dict:
    """Run ``first`` (the group's first gradring call) under ``env``, then one more
    all-reduce; every error in words, and how long the first call took."""
    old = {v: os.environ.get(v) for v in _VARS}
    comm.shutdown()  # the next call makes the group's state afresh
    for v in _VARS:
        os.environ.pop(v, None)
    # Old code waited for this deadline; the agreement needs none of it.
    os.environ.update({"GRADRING_TIMEOUT": "4", **env})
    out: dict = {"error": None, "later": None, "value": None}
    t0 = time.monotonic()
    try:
        out["value"] = first()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["took"] = time.monotonic() - t0
    if out["error"] is not None:
        t1 = time.monotonic()
        try:
            comm.all_reduce(torch.ones(4))
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out["later"] = f"{type(exc).__name__}: {exc}"
        out["later_took"] = time.monotonic() - t1
    comm.shutdown()
    for v, val in old.items():
        if val is None:
            os.environ.pop(v, None)
        else:
            os.environ[v] = val
    return out


def _all_reduce() -> float:
    x = torch.ones(8)
    comm.all_reduce(x)
    return float(x[0])


def _empty() -> float:
    comm.empty(1024)
    return _all_reduce()


def _ddp_step() -> float:
    torch.manual_seed(0)
    ddp = gradring.DistributedDataParallel(nn.Linear(8, 2))
    ddp(torch.ones(2, 8)).sum().backward()
    return float(ddp.module.bias.grad[0])


def _cases(rank: int, world: int) -> dict[str, dict]:
    zero = rank == 0
    return {
        "transport": _case(rank, {"GRADRING_TRANSPORT": "torch"} if zero else {}, _all_reduce),
        "transport_empty": _case(rank, {} if zero else {"GRADRING_TRANSPORT": "torch"}, _empty),
        "transport_ddp": _case(rank, {"GRADRING_TRANSPORT": "torch"} if zero else {}, _ddp_step),
        "check": _case(rank, {"GRADRING_CHECK": "1"} if zero else {}, _all_reduce),
        "algo": _case(rank, {"GRADRING_TRANSPORT": "torch",
                             "GRADRING_ALGO": "ring" if zero else "tree"}, _all_reduce),
        "two": _case(rank, {"GRADRING_CHECK": "1", "GRADRING_ALGO": "ring"} if zero else {},
                     _all_reduce),
        # Spelled differently, parsed alike: no mismatch.
        "alike": _case(rank, {"GRADRING_CHECK": "yes" if zero else "1",
                              "GRADRING_TRANSPORT": "torch"}, _all_reduce),
        "same_shm": _case(rank, {}, _empty),
        "holding": {"value": _holding(rank)},
    }


def _holding(rank: int) -> int:
    """What each rank's /dev/shm advice is computed from when a collective runs out:
    the largest holding of the ranks, whatever this rank's own."""
    comm.shutdown()
    comm.all_reduce(torch.ones(2))
    ctx = context(None)
    assert ctx is not None
    try:
        return runner._largest_holding(ctx, (rank + 1) * 1000)
    finally:
        comm.shutdown()


@pytest.fixture(scope="module")
def results(pools) -> list[dict[str, dict]]:
    return pools.run(2, _cases)


_TRANSPORT = "GRADRING_TRANSPORT differs across ranks: rank 0 has 'torch', rank 1 has it unset"


@pytest.mark.parametrize("case", ["transport", "transport_ddp"])
def test_transport_on_one_rank_is_named_on_every_rank(results, case: str) -> None:
    for r in (results[0][case], results[1][case]):
        err = r["error"]
        assert err is not None and err.startswith("SettingsMismatch: "), r
        assert _TRANSPORT in err and "set it the same on every rank" in err, err
        assert "DistStoreError" not in err and "posted nothing" not in err, err
        assert r["took"] < 3.0, r  # no deadline waited for (GRADRING_TIMEOUT=4)
        # The group refuses later collectives at once, saying why.
        assert r["later"] is not None and "unusable after an earlier failure" in r["later"], r
        assert _TRANSPORT in r["later"] and r["later_took"] < 1.0, r


def test_transport_mismatch_at_comm_empty(results) -> None:
    # comm.empty is the group's first call (DDP's buckets): rank 0 would have returned
    # ordinary memory without a word while rank 1 waited in the shm rendezvous.
    for r in (results[0]["transport_empty"], results[1]["transport_empty"]):
        assert r["error"] is not None, r
        assert ("GRADRING_TRANSPORT differs across ranks: rank 0 has it unset, "
                "rank 1 has 'torch'") in r["error"], r
        assert r["took"] < 3.0, r


def test_check_on_one_rank_is_a_settings_mismatch_not_a_desync(results) -> None:
    for r in (results[0]["check"], results[1]["check"]):
        err = r["error"]
        assert err is not None and err.startswith("SettingsMismatch: "), r
        assert "GRADRING_CHECK differs across ranks: rank 0 has '1', rank 1 has it unset" \
            in err, err
        assert "shape differ" not in err and "desync" not in err, err


def test_algo_and_several_at_once(results) -> None:
    for r in (results[0]["algo"], results[1]["algo"]):
        assert "GRADRING_ALGO differs across ranks: rank 0 has 'ring', rank 1 has 'tree'" \
            in (r["error"] or ""), r
    for r in (results[0]["two"], results[1]["two"]):
        err = r["error"] or ""
        assert "GRADRING_ALGO differs" in err and "GRADRING_CHECK differs" in err, r
        assert err.endswith("set them the same on every rank"), err


def test_equal_settings_run(results) -> None:
    for case in ("alike", "same_shm"):
        for r in (results[0][case], results[1][case]):
            assert r["error"] is None and r["value"] == 2.0, (case, r)


def test_mismatch_wording_for_many_ranks() -> None:
    def pub(transport: str | None) -> dict:
        return {"GRADRING_TRANSPORT": [transport, transport],
                "GRADRING_ALGO": [None, None], "GRADRING_CHECK": [False, None]}
    values = [pub("torch")] + [pub(None)] * 3 + [pub("torch")] + [pub("shm")] * 2
    assert agree.mismatches(values) == [
        "GRADRING_TRANSPORT differs across ranks: ranks 0, 4 have 'torch', ranks 1-3 have it "
        "unset, ranks 5, 6 have 'shm'"]
    assert agree.mismatches([pub("shm")] * 4) == []


# ------------------------------------------------- /dev/shm: which cause, one figure
_MiB = 1 << 20


def _statvfs(free_mib: float, total_mib: float) -> Callable[[str], os.statvfs_result]:
    block = 4096
    blocks = int(total_mib * _MiB) // block
    avail = int(free_mib * _MiB) // block
    fake = os.statvfs_result((block, block, blocks, avail, avail, 0, 0, 0, 0, 255))
    return lambda _path: fake


def test_a_mount_too_small_for_the_job_says_raise_it(monkeypatch) -> None:
    monkeypatch.setattr(segments.os, "statvfs", _statvfs(4, 8))
    text = space.advice(16 * _MiB, 2 * _MiB, 2)
    # (2 + 16) MiB per rank, 2 ranks, 4 MiB to spare.
    assert text.startswith("/dev/shm is too small for gradring's shared-memory transport"), text
    assert "these 2 rank(s) need about 40 MiB" in text and "--shm-size=40m" in text, text
    assert space.cause(40 * _MiB, 4 * _MiB, 8 * _MiB) == space.TOO_SMALL
    assert space.cause(40 * _MiB, 0, 0) == space.TOO_SMALL  # statvfs failed: as before


def test_a_mount_filled_by_others_says_free_it(monkeypatch) -> None:
    # 64 MiB (Docker's default) holds the job's 40 MiB, but others left 3 MiB free.
    monkeypatch.setattr(segments.os, "statvfs", _statvfs(3, 64))
    text = space.advice(16 * _MiB, 2 * _MiB, 2)
    assert text.startswith("/dev/shm is large enough for gradring's shared-memory transport "
                           "(64 MiB; these 2 rank(s) need about 40 MiB) but other processes "
                           "fill it"), text
    assert "ls -la /dev/shm" in text and "--shm-size" not in text, text
    assert space.cause(40 * _MiB, 3 * _MiB, 64 * _MiB) == space.TAKEN


def test_one_figure_for_the_job(monkeypatch, results) -> None:
    # A collective that runs out: every rank advises from the largest holding.
    assert [results[r]["holding"]["value"] for r in (0, 1)] == [2000, 2000]
    # comm.empty running out is one rank's own event: only rank 0 gives the job's figure.
    monkeypatch.setattr(segments.os, "statvfs", _statvfs(3, 8))
    full = segments.ShmFull("x", 16 * _MiB, 3 * _MiB, 8 * _MiB)
    assert "need about 40 MiB" in space.explain(full, 2 * _MiB, 2, rank=0)
    other = space.explain(full, 1 * _MiB, 2, rank=1)
    assert "need about" not in other and "a segment of 16.0 MiB did not fit" in other, other
