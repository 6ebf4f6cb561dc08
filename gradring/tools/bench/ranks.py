"""Start a benchmark's rank processes and collect what they report, or say which died.

Every benchmark here runs its ranks as fresh ``spawn`` processes that report
through a queue. Waiting on the queue alone would hang when a rank dies before
it reports (an exception, a kill), so :func:`run_ranks` also watches the
processes and raises with the rank and its exit code as soon as one fails.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import tempfile
import time
from collections.abc import Callable
from typing import Any

#: How often (seconds) the parent looks at the ranks while it waits for results.
POLL_S = 0.5


def run_ranks(target: Callable[..., None], nproc: int, args: tuple[Any, ...], *,
              results: int = 1, timeout: float | None = None) -> list[Any]:
    """Run ``target(rank, nproc, store_path, *args, queue)`` on ``nproc`` fresh
    processes and return the first ``results`` objects they put on ``queue``, in
    arrival order. ``store_path`` is a FileStore path for ``init_process_group``;
    ``target`` and ``args`` must be picklable (``target`` a module-level function).

    Raises RuntimeError when a rank exits with a non-zero code before the results
    are in (its traceback is on stderr), TimeoutError when ``timeout`` seconds pass
    first (no limit when None). On success the ranks are joined (killed after 30 s);
    on a failure the ones still running are killed at once."""
    if nproc < 1:
        raise ValueError(f"nproc must be at least 1, got {nproc}")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    deadline = None if timeout is None else time.monotonic() + timeout
    out: list[Any] = []
    done = False
    with tempfile.TemporaryDirectory(prefix="gradring-bench-") as tmp:
        procs = [ctx.Process(target=target, daemon=True,
                             args=(r, nproc, os.path.join(tmp, "store"), *args, queue))
                 for r in range(nproc)]
        for p in procs:
            p.start()
        try:
            while len(out) < results:
                try:
                    out.append(queue.get(timeout=POLL_S))
                    continue
                except queue_mod.Empty:
                    pass
                dead = [(r, p.exitcode) for r, p in enumerate(procs)
                        if p.exitcode not in (None, 0)]
                if dead:
                    rank, code = dead[0]
                    raise RuntimeError(f"benchmark rank {rank} of {nproc} exited with code "
                                       f"{code} before reporting (its error is above)")
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"the benchmark's {nproc} ranks reported "
                                       f"{len(out)} of {results} results in {timeout} s")
            done = True
            return out
        finally:
            for p in procs:
                if done:
                    p.join(30)
                if p.is_alive():
                    p.kill()
                    p.join()
