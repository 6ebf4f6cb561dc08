"""Environment variables set for a block and restored after it: pool ranks are
reused across tests, so a variable one test sets must not leak into the next."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def environ(**values: str) -> Iterator[None]:
    """Set ``values`` in ``os.environ`` for the block; put back what was there
    (or unset what was not) after it."""
    before = {var: os.environ.get(var) for var in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for var, value in before.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value


def run_with_environ(rank: int, world_size: int, values: dict[str, str], fn: Any,
                     *args: Any, **kwargs: Any) -> Any:
    """A pool rank's body: ``fn(rank, world_size, *args, **kwargs)`` with
    ``values`` set in the environment (see [Note: both policies] in tests/conftest.py)."""
    with environ(**values):
        return fn(rank, world_size, *args, **kwargs)
