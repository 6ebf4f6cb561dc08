"""A competing load for a benchmark: processes that spin on the CPU while it runs.

``gradring bench ddp --load 1`` (and the source checkout's
``benchmarks/ddp_*.py --load 1``) start one such process beside the ranks.
On a machine with as many cores as ranks it takes a core the ranks and their
comm threads counted on, as another job on a shared host would. The spinners
are plain Python loops that neither allocate nor touch shared memory, so they
compete for CPU time and nothing else; they are killed when the benchmark
ends, whatever way it ends.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator

_SPIN = "while True:\n    pass\n"


@contextlib.contextmanager
def competing_load(spinners: int) -> Iterator[list[int]]:
    """Run ``spinners`` busy processes for the duration of the block; yields their pids."""
    procs = [subprocess.Popen([sys.executable, "-c", _SPIN], stdin=subprocess.DEVNULL)
             for _ in range(max(0, spinners))]
    try:
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def load_note(spinners: int) -> str:
    """The line a report starts with when it ran under ``spinners`` busy processes
    ("" without any)."""
    return (f"competing load: {spinners} spinning process(es) beside the ranks\n"
            if spinners > 0 else "")
