from __future__ import annotations

import os

import pytest

# On a CI machine with as many ranks as cores the reducer would reduce every
# bucket at the end of the backward (see [Note: overlap needs a free core] in
# gradring/reducer/overlap_policy.py). The suite keeps testing the launch at ready
# time, the path of machines with cores to spare; test_overlap_policy.py tests
# the other one. Rank pools and example subprocesses inherit this.
os.environ.setdefault("GRADRING_OVERLAP", "1")

from tests.rankpool import RankPool


class Pools:
    """Lazily started rank pools, one per world size, shared by the whole session."""

    def __init__(self) -> None:
        self._pools: dict[int, RankPool] = {}

    def run(self, world_size: int, fn, *args, timeout: float = 120, **kwargs):
        pool = self._pools.get(world_size)
        if pool is None:
            pool = self._pools[world_size] = RankPool(world_size)
        return pool.run(fn, *args, timeout=timeout, **kwargs)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


@pytest.fixture(scope="session")
def pools():
    p = Pools()
    yield p
    p.close()
