"""Where a DDP step's overhead goes: the training thread's time in each part of
gradring's DDP, and the comm thread's, per step.

    python benchmarks/ddp_parts.py                      # resnet, world 2
    python benchmarks/ddp_parts.py --models resnet mlp64 --steps 40

World 2 on one host; rank 0's figures. After a warm-up the reducer's parts
are wrapped with a timer (a few tenths of a µs each) and ``--steps`` steps
are timed. The parts nest: ``the hooks`` contains the puts and the
launches; ``finalize`` contains the waits for the buckets and the
write-backs; ``pre-forward`` contains the buffer broadcast. A wait contains
whatever the peer makes it wait for: a rank that reaches a collective first
waits there for the other. ``collectives`` is the time spent running
collectives, waits included, on the training thread (the buffer broadcast)
and on the comm thread (the buckets); on a host with no free core the comm
thread shares the training thread's core. The ``CPU`` lines are CPU time
(``time.thread_time``): the training thread's over the whole step, and the
comm thread's inside collectives; wall time minus CPU time is time spent
waiting or descheduled. ``the same step without DDP`` is a second copy of
the model, stepped alone as many times right after (wall and CPU).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from gradring.tools.bench.ranks import run_ranks

#: (part, indent) in the order printed.
PARTS = [
    ("step (forward, backward, optimizer)", 0),
    ("pre-forward", 1), ("buffer broadcast", 2),
    ("the hooks (per gradient)", 1), ("puts: homed", 2), ("puts: copied", 2),
    ("puts: view", 2), ("puts: packed, per bucket", 2), ("launching buckets", 2),
    ("finalize", 1), ("waiting for the buckets", 2), ("writing .grad", 2),
    ("collectives (training thread)", 0), ("collectives (comm thread)", 0),
    ("CPU: training thread, whole step", 0), ("CPU: comm thread, in collectives", 0),
    ("the same step without DDP", 0), ("CPU: the same step without DDP", 0),
]


def _timed(acc: dict[str, float], part: str, fn: Callable[..., Any],
           main_only: bool = False) -> Callable[..., Any]:
    clock, cpu = time.perf_counter, time.thread_time
    main = threading.main_thread()

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0, c0 = clock(), cpu()
        try:
            return fn(*args, **kwargs)
        finally:
            if not main_only or threading.current_thread() is main:
                acc[part] += clock() - t0
            else:
                acc["collectives (comm thread)"] += clock() - t0
                acc["CPU: comm thread, in collectives"] += cpu() - c0
    return wrapper


def _run(step: Callable[[], None], steps: int) -> tuple[float, float]:
    """Take ``steps`` steps: (wall seconds, this thread's CPU seconds)."""
    t0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(steps):
        step()
    return time.perf_counter() - t0, time.thread_time() - c0


def _rank_main(rank: int, nproc: int, store: str, model_name: str, steps: int,
               cap: float | None, queue: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["GRADRING_QUIET"] = "1"
    dist.init_process_group("gloo", store=dist.FileStore(store, nproc), rank=rank,
                            world_size=nproc)
    from gradring.buckets import SlotKind, slot_io
    from gradring.buckets.homed import HomedPath
    from gradring.buckets.packed import PackedPath
    from gradring.comm import runner
    from gradring.reducer import reducer as reducer_mod
    from gradring.tools.bench import ddp_step

    ddp, opt, x = ddp_step.gradring_ddp(model_name, bucket_cap_mb=cap)
    step = functools.partial(ddp_step.train_step, ddp, opt, x)

    for _ in range(6):  # warm-up and the rebuild
        step()
    acc: dict[str, float] = defaultdict(float)
    red = ddp.reducer
    red._mark_ready = _timed(acc, "the hooks (per gradient)", red._mark_ready)
    red._finalize = _timed(acc, "finalize", red._finalize)
    ddp._pre_forward = _timed(acc, "pre-forward", ddp._pre_forward)
    ddp._sync_buffers = _timed(acc, "buffer broadcast", ddp._sync_buffers)
    launcher = red._launcher
    launcher.launch_ready = _timed(acc, "launching buckets", launcher.launch_ready)
    launcher.result = _timed(acc, "waiting for the buckets", launcher.result)
    # The core's puts, and each fast path's (see gradring/fast_paths.py).
    for k, part in {SlotKind.COPIED: "puts: copied", SlotKind.VIEW: "puts: view"}.items():
        slot_io.CORE_PUTS[k] = _timed(acc, part, slot_io.CORE_PUTS[k])
    HomedPath.put = _timed(acc, "puts: homed", HomedPath.put)
    PackedPath.on_full = _timed(acc, "puts: packed, per bucket", PackedPath.on_full)
    red._set.install([b.param_indices for b in red.buckets], red.fast)  # routes and paths anew
    reducer_mod.write_grads = _timed(acc, "writing .grad", slot_io.write_grads)
    runner.run = _timed(acc, "collectives (training thread)", runner.run, main_only=True)
    dist.barrier()
    acc.clear()
    (acc["step (forward, backward, optimizer)"],
     acc["CPU: training thread, whole step"]) = _run(step, steps)
    bare, _ = ddp_step.build(ddp_step.MODELS[model_name][0])
    bare_step = functools.partial(ddp_step.train_step, bare,
                                  torch.optim.SGD(bare.parameters(), lr=1e-4), x)
    _run(bare_step, 6)
    dist.barrier()
    acc["the same step without DDP"], acc["CPU: the same step without DDP"] = \
        _run(bare_step, steps)
    if rank == 0:
        queue.put({k: v / steps * 1e3 for k, v in acc.items()})
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    from gradring.tools.bench import ddp_step

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["resnet"], choices=list(ddp_step.MODELS))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--cap", type=float, default=None, help="bucket_cap_mb (default: unset)")
    a = p.parse_args(argv)
    for model in a.models:
        res = run_ranks(_rank_main, 2, (model, a.steps, a.cap), timeout=1800)[0]
        print(f"{model}: ms per step, rank 0, bucket_cap_mb={a.cap}")
        for part, indent in PARTS:
            if part in res:
                print(f"  {'  ' * indent}{part:{44 - 2 * indent}s} {res[part]:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
