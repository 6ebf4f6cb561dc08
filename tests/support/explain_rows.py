"""Reading explain's printed table back, to check that it adds up as printed."""

from __future__ import annotations


def printed_rows(text: str) -> dict[str, list[float]]:
    """explain's table as printed: row label -> each rank's value (shares left out)."""
    lines = text.splitlines()
    end = next(k for k, line in enumerate(lines) if line.startswith("step "))
    return {line[:17].strip(): [float(t) for t in line[17:].split() if not t.endswith("%")]
            for line in lines[2:end + 1]}


def assert_rows_add_up(rows: dict[str, list[float]], r: int) -> None:
    """Rank ``r``'s column adds up as printed: the step rows to the step, the indented
    rows to exposed comm."""
    parts = [rows[k][r] for k in ("wait (peers)", "last bucket", "earlier buckets")]
    assert round(sum(parts), 2) == rows["exposed comm"][r], rows
    steps = [rows[k][r] for k in ("forward", "backward", "exposed comm", "copy into .grad",
                                  "optimizer", "other")]
    assert round(sum(steps), 2) == rows["step"][r], rows
