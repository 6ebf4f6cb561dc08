"""The line gradring's wrapper shows at its first forward ([Note: which DDP did I get]):
through logging where the user configured it, else on stderr; silenced on request."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from tests.integrations.common import release


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        # The messages logged while attached.
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def announce_in_ranks(rank: int, world: int, call_directly: bool) -> dict[str, Any]:
    import gradring
    from gradring.announce import announce_first_forward, logger

    handler = _Lines()
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        torch.manual_seed(0)
        ddp = gradring.DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)))
        if call_directly:
            announce_first_forward(ddp)
        for _ in range(3):
            ddp(torch.randn(2, 4)).sum().backward()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return {"lines": handler.lines, "segments_left": release()}


LINE = "gradring DDP wraps Sequential: 4 parameters, 58 elements, 2 ranks (gloo)"


def _check(results: list[dict[str, Any]], once: bool) -> None:
    for res in results:
        assert res["segments_left"] == []
    assert results[1]["lines"] == []  # rank 0 only
    lines = results[0]["lines"]
    assert lines == [LINE] if once else (lines and set(lines) == {LINE}), lines


@pytest.mark.timeout(180)
def test_announce_line_on_rank_zero(integ_pool) -> None:
    _check(integ_pool.run(announce_in_ranks, True), once=False)


@pytest.mark.timeout(180)
def test_first_forward_logs_the_line_once(integ_pool) -> None:
    _check(integ_pool.run(announce_in_ranks, False), once=True)


@contextlib.contextmanager
def _unconfigured_logging() -> Iterator[io.StringIO]:
    """Logging as in a script that never configures it, and stderr captured."""
    from gradring.announce import logger

    root = logging.getLogger()
    saved = root.handlers[:], root.level, logger.handlers[:], logger.level, sys.stderr
    root.handlers, logger.handlers = [], []
    root.setLevel(logging.WARNING)
    logger.setLevel(logging.NOTSET)
    sys.stderr = err = io.StringIO()
    try:
        yield err
    finally:
        root.handlers, level, logger.handlers, own, sys.stderr = saved
        root.setLevel(level)
        logger.setLevel(own)


def default_in_ranks(rank: int, world: int, how: str) -> dict[str, Any]:
    """Two DDPs' first forwards (and more) with logging unconfigured; ``how`` silences
    the line: "" (not at all), "env" (GRADRING_QUIET=1) or "level" (gradring's
    logger at WARNING)."""
    import gradring
    from gradring.announce import logger

    with _unconfigured_logging() as err:
        if how == "env":
            os.environ["GRADRING_QUIET"] = "1"
        elif how == "level":
            logger.setLevel(logging.WARNING)
        try:
            torch.manual_seed(0)
            for _ in range(2):
                ddp = gradring.DistributedDataParallel(
                    nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)))
                for _ in range(2):
                    ddp(torch.randn(2, 4)).sum().backward()
        finally:
            os.environ.pop("GRADRING_QUIET", None)
    return {"stderr": err.getvalue(), "segments_left": release()}


@pytest.mark.timeout(180)
def test_line_on_stderr_by_default_once_per_wrapper(integ_pool) -> None:
    from gradring.announce import SILENCE

    zero, one = integ_pool.run(default_in_ranks, "")
    assert zero["stderr"] == f"{LINE} {SILENCE}\n" * 2, zero["stderr"]
    assert one["stderr"] == "", one["stderr"]
    assert zero["segments_left"] == one["segments_left"] == []


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["env", "level"])
def test_line_silenced(integ_pool, how: str) -> None:
    for res in integ_pool.run(default_in_ranks, how):
        assert res["stderr"] == "", res["stderr"]
        assert res["segments_left"] == []
