"""The benchmarks' rank launcher (gradring/tools/bench/ranks.py): results from every
rank, and a rank that dies or never reports makes an error naming it, never a hang."""

from __future__ import annotations

import time
from typing import Any

import pytest

from gradring.tools.bench.ranks import run_ranks

# Fresh rank processes, one failing on purpose (see [Note: the default suite and the
# slow one] in tests/conftest.py).
pytestmark = pytest.mark.slow


def _report(rank: int, nproc: int, store_path: str, tag: str, queue: Any) -> None:
    queue.put((rank, nproc, tag, bool(store_path)))


def _rank1_fails(rank: int, nproc: int, store_path: str, marker: str, queue: Any) -> None:
    if rank == 1:
        raise SystemExit(3)
    time.sleep(20)  # rank 0 waits for a peer that is gone, then would leave a mark
    with open(marker, "w") as f:
        f.write("rank 0 was left to run")


def _silent(rank: int, nproc: int, store_path: str, queue: Any) -> None:
    time.sleep(120)


def test_every_rank_reports_with_its_arguments() -> None:
    got = run_ranks(_report, 3, ("x",), results=3, timeout=120)
    assert sorted(got) == [(0, 3, "x", True), (1, 3, "x", True), (2, 3, "x", True)]


def test_a_rank_that_dies_is_named_and_the_others_are_killed(tmp_path) -> None:
    marker = tmp_path / "rank0-finished"
    with pytest.raises(RuntimeError, match=r"benchmark rank 1 of 2 exited with code 3"):
        run_ranks(_rank1_fails, 2, (str(marker),), timeout=300)
    # the survivor was killed when the error was raised, not awaited until it ended
    assert not marker.exists()


def test_ranks_that_never_report_time_out() -> None:
    with pytest.raises(TimeoutError, match=r"reported 0 of 1 results in 3 s"):
        run_ranks(_silent, 1, (), timeout=3)


def test_no_ranks_is_an_error() -> None:
    with pytest.raises(ValueError, match="nproc must be at least 1, got 0"):
        run_ranks(_report, 0, ("x",))
