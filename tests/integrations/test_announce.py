"""The line gradring's wrapper logs at its first forward ([Note: which DDP did I get])."""

from __future__ import annotations

import logging
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
