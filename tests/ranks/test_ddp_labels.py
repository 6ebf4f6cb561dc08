"""The reducer labels its collectives, so a bucket mismatch is caught even when sizes agree.

Rank 0 reduces its one bucket during backward; rank 1 instead issues a plain
all-reduce of exactly the bucket's size. Without labels the two would pair up
silently and rank 0 would get a wrong sum. With ``GRADRING_CHECK=1`` the
reducer's ``DDP bucket 0`` label is part of the fingerprint, and both ranks
raise a desync error that names the bucket.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import gradring
from gradring import comm

pytestmark = pytest.mark.timeout(120)


def _bucket_versus_plain(rank: int, world: int, check: bool) -> dict:
    old = os.environ.get("GRADRING_CHECK")
    os.environ["GRADRING_CHECK"] = "1" if check else "0"
    try:
        torch.manual_seed(0)
        ddp = gradring.DistributedDataParallel(nn.Linear(8, 8))
        numel = sum(p.numel() for p in ddp.parameters())
        error = None
        grad = None
        try:
            out = ddp(torch.ones(2, 8)).sum()
            if rank == 0:
                out.backward()
                grad = ddp.module.bias.grad.tolist()
            else:
                comm.all_reduce(torch.zeros(numel))
        except Exception as exc:  # noqa: BLE001 - reported to the test
            error = f"{type(exc).__name__}: {exc}"
        return {"error": error, "grad": grad}
    finally:
        comm.shutdown()
        if old is None:
            os.environ.pop("GRADRING_CHECK", None)
        else:
            os.environ["GRADRING_CHECK"] = old


def test_bucket_label_catches_equal_size_mismatch(pools) -> None:
    checked = pools.run(2, _bucket_versus_plain, True)
    for r in checked:
        assert r["error"] is not None and "gradring desync" in r["error"], r
        assert "label differ" in r["error"], r
    # Rank 0's own description carries the reducer's label; rank 1 sees the
    # peer's words only when they reach it in time.
    assert "DDP bucket 0" in checked[0]["error"], checked
    # The same run without GRADRING_CHECK pairs the two silently: rank 0's
    # bias gradient is half of what it computed (its sum with rank 1's zeros,
    # divided by the world size), which is exactly what the label prevents.
    unchecked = pools.run(2, _bucket_versus_plain, False)
    assert [r["error"] for r in unchecked] == [None, None], unchecked
    assert unchecked[0]["grad"] == [1.0] * 8, unchecked
