"""Start N local rank processes without torchrun (for the demo, benchmarks and tools).

Each rank gets a gloo process group rendezvoused through a FileStore in a
private temporary folder, so nothing listens on a port and concurrent runs
never collide.
"""

from __future__ import annotations

import io
import os
import queue as queue_mod
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world: int, store_path: str, fn: Callable[..., Any], args: tuple,
           queue: Any, timeout_s: float) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    try:
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank,
                                world_size=world, timeout=timedelta(seconds=timeout_s))
        result = fn(rank, world, *args)
        # Plain bytes: a tensor put on a torch queue would travel as a shared-memory
        # handle that dies with this process.
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        queue.put((rank, "err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_local(fn: Callable[..., Any], nproc: int, *args: Any,
              timeout_s: float = 600) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``nproc`` fresh processes; return per-rank results.

    ``fn`` must be importable (a module-level function). Raises RuntimeError
    with every failing rank's traceback.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="gradring-run-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_entry, args=(r, nproc, store, fn, args, queue, timeout_s))
                 for r in range(nproc)]
        for p in procs:
            p.start()
        results: list[Any] = [None] * nproc
        errors: dict[int, str] = {}
        pending = set(range(nproc))
        while pending:
            try:
                rank, tag, payload = queue.get(timeout=0.5)
            except queue_mod.Empty:  # check for ranks that died without a word
                for r in sorted(pending):
                    code = procs[r].exitcode
                    if code is not None \
                            and queue.empty():
                        errors[r] = f"rank process died with exit code {code}"
                        pending.discard(r)
                if errors and pending:
                    for r in pending:
                        procs[r].kill()
                        errors.setdefault(r, "killed after another rank died")
                    pending.clear()
                continue
            pending.discard(rank)
            if tag == "ok":
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors[rank] = payload
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if errors:
        text = "\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
        raise RuntimeError(f"ranks {sorted(errors)} failed:\n{text}")
    return results
