"""A reusable pool of real rank processes for multi-process tests.

Starting a rank costs seconds (importing torch), so each world size gets one
pool of processes per test session. A test ships a *module-level* function by
name; every rank runs it with ``(rank, world_size, *args)`` inside an already
initialised gloo process group and sends back its return value.

Any failure -- an exception on some rank or a timeout -- tears the pool down
(its process group may be wedged) and the next test gets a fresh one, so a bug
becomes a failure, never a hang.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

#: The repository root: test modules (and their helpers) import as ``tests.<name>``.
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: How long a process group collective may block inside a pooled rank before
#: torch gives up. Keeps a broken test from waiting for 30 minutes.
PG_TIMEOUT_S = 60


class RankFailure(AssertionError):
    """One or more ranks raised; carries every rank's traceback."""


def _worker_main(rank: int, world_size: int, store_path: str, conn: Any) -> None:
    if _ROOT not in sys.path:
        sys.path.insert(0, _ROOT)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size,
        timeout=timedelta(seconds=PG_TIMEOUT_S),
    )
    conn.send(("ready", os.getpid()))
    seq = 0
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        modname, qualname, args, kwargs = msg
        try:
            obj: Any = importlib.import_module(modname)
            for part in qualname.split("."):
                obj = getattr(obj, part)
            result = obj(rank, world_size, *args, **kwargs)
            # Every rank must leave the test with its collectives in step.
            seq += 1
            check = torch.tensor([float(seq)], dtype=torch.float64)
            dist.all_reduce(check)
            if check.item() != seq * world_size:
                raise RuntimeError("ranks left the test with collectives out of step")
            conn.send(("ok", result))
        except BaseException as exc:  # noqa: BLE001 - everything goes back to the test
            conn.send(("err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    try:
        dist.destroy_process_group()
    finally:
        conn.close()


class RankPool:
    """``world_size`` live rank processes sharing one gloo process group."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.pids: list[int] = []

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._tmp = tempfile.TemporaryDirectory(prefix="gradring-pool-")
        store_path = os.path.join(self._tmp.name, "store")
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main, args=(rank, self.world_size, store_path, child),
                daemon=True,
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        deadline = time.monotonic() + 120
        for rank, conn in enumerate(self._conns):
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                self.close(force=True)
                raise RuntimeError(f"rank {rank} of the test pool did not start")
            tag, pid = conn.recv()
            self.pids.append(pid)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 120,
            **kwargs: Any) -> list[Any]:
        """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank; return per-rank results."""
        if not self._procs:
            self._start()
        msg = (fn.__module__, fn.__qualname__, args, kwargs)
        for conn in self._conns:
            conn.send(msg)
        results: list[Any] = [None] * self.world_size
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        pending = set(range(self.world_size))
        while pending:
            for rank in sorted(pending):
                conn = self._conns[rank]
                try:
                    ready = conn.poll(0.02)
                    if ready:
                        tag, payload = conn.recv()
                except (EOFError, OSError):
                    errors[rank] = "rank process died"
                    pending.discard(rank)
                    continue
                if ready:
                    pending.discard(rank)
                    if tag == "ok":
                        results[rank] = payload
                    else:
                        errors[rank] = payload
            if pending and time.monotonic() > deadline:
                for rank in pending:
                    errors[rank] = f"timed out after {timeout}s"
                break
            if errors and pending:
                # Give the others a short grace period, then give up on them.
                deadline = min(deadline, time.monotonic() + 10)
        if errors:
            self.close(force=True)
            text = "\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
            raise RankFailure(f"{fn.__qualname__} failed on ranks {sorted(errors)}:\n{text}")
        return results

    def close(self, *, force: bool = False) -> None:
        for conn in self._conns:
            try:
                if not force:
                    conn.send(None)
            except OSError:
                pass
        for proc in self._procs:
            proc.join(timeout=0 if force else 15)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns, self.pids = [], [], []
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
