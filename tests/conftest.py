from __future__ import annotations

import pytest

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
