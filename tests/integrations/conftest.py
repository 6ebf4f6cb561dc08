"""A rank pool of its own for the framework tests.

The frameworks leave process-wide state behind (Accelerate's singletons,
Lightning's rank-zero flags, environment variables, ``gradring.install()`` in
a failing test), so their ranks are kept apart from the pool the other tests
share. It is started on first use and closed at the end of the session.
"""

from __future__ import annotations

import pytest

from tests.support.rankpool import RankPool


class _Pool:
    def __init__(self) -> None:
        self._pool = RankPool(2)

    def run(self, fn, *args, timeout: float = 180, **kwargs):  # noqa: ANN001, ANN201
        return self._pool.run(fn, *args, timeout=timeout, **kwargs)

    def close(self) -> None:
        self._pool.close()


@pytest.fixture(scope="session")
def integ_pool():  # noqa: ANN201
    pool = _Pool()
    yield pool
    pool.close()
