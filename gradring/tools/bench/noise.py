"""When a benchmark figure can be trusted: spread across rounds, and ratios that noise ate.

Benchmarks here run their set-ups in interleaved rounds. A figure is the
median over rounds; its *spread* is the range (max - min) over the same
rounds. An *effect* (an overhead: set-up minus baseline) is computed per
round, because both sides of one round saw the same machine load, and then
summarised the same way.

A ratio of two effects (``gradring bench ddp``'s gradring overhead / torch
overhead) is printed only when both effects are positive and each is larger
than its own spread. Otherwise the line says why instead: on a loaded
machine the baseline can be slower than DDP in a round, which gave a
ratio of -1.31 once and nan the next time.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import NamedTuple


class Figure(NamedTuple):
    """Median over rounds, with the lowest and highest round."""

    median: float
    low: float
    high: float

    @property
    def spread(self) -> float:
        return self.high - self.low

    def __str__(self) -> str:
        return f"{self.median:.1f} ±{self.spread / 2:.1f}"


def figure(rounds: Sequence[float]) -> Figure:
    """Summarise one figure's per-round values."""
    values = [float(v) for v in rounds if not math.isnan(v)]
    if not values:
        return Figure(float("nan"), float("nan"), float("nan"))
    return Figure(statistics.median(values), min(values), max(values))


def effect(baseline: Sequence[float], measured: Sequence[float]) -> Figure:
    """``measured - baseline``, round by round (the two lists are aligned by round)."""
    if len(baseline) != len(measured):
        raise ValueError(f"rounds differ: {len(baseline)} baseline vs {len(measured)} measured")
    return figure([m - b for b, m in zip(baseline, measured)])


class Verdict(NamedTuple):
    """A ratio of two effects, or why it is not given."""

    ratio: float | None
    problem: str  # "" when the ratio can be trusted

    def cell(self, width: int = 0) -> str:
        text = f"{self.ratio:.2f}" if self.ratio is not None else "noisy"
        return f"{text:>{width}}" if width else text


def ratio(numerator: Figure, denominator: Figure, names: tuple[str, str] = ("a", "b")) -> Verdict:
    """``numerator / denominator`` of two effects, if noise leaves it meaningful."""
    problems = []
    for name, f in zip(names, (numerator, denominator)):
        if math.isnan(f.median):
            problems.append(f"{name} was not measured")
        elif f.median <= 0:
            problems.append(f"{name} overhead is {f.median:.2f} ms (not positive: "
                            "noise larger than the cost)")
        elif f.spread > f.median:
            problems.append(f"{name} overhead {f.median:.2f} ms varies by {f.spread:.2f} ms "
                            "across rounds (spread larger than the effect)")
    if problems:
        return Verdict(None, "; ".join(problems))
    return Verdict(numerator.median / denominator.median, "")
