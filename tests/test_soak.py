"""Soak: 1000 iterations across bucket caps and hooks, then nothing is left behind.

Each rank builds and drops a fresh DDP instance per configuration, so buckets,
shared-memory segments, hook scratch buffers and engine threads are created
and released many times over. After the last cycle and ``comm.shutdown()``
the process must hold no more threads, file descriptors or gradring mappings
than after the warm-up cycle, and its RSS must not grow from cycle to cycle.
The oracle for the gradients is the rest of the suite; here a training step
only has to run and keep the loss finite.
"""

import gc
import math
import os
import threading

import torch
import torch.distributed as dist
from torch import nn

import gradring
from gradring import hooks
from gradring.tools.launch import run_local

ITERATIONS = 1000
CYCLES = 5


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _gradring_maps() -> int:
    with open("/proc/self/maps") as f:
        return sum("gradring-" in line for line in f)


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _configs() -> list:
    psgd = hooks.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                               start_powerSGD_iter=2)
    return [
        ({"bucket_cap_mb": 0.001}, None, None),
        ({"bucket_cap_mb": 25, "gradient_as_bucket_view": True}, None, None),
        ({"bucket_cap_mb": 0.01}, None, hooks.bf16_compress_hook),
        ({"bucket_cap_mb": 0.005, "find_unused_parameters": True}, None, hooks.allreduce_hook),
        ({"bucket_cap_mb": 0.004}, None, hooks.fp16_compress_hook),
        ({"bucket_cap_mb": 0.02}, psgd, hooks.powerSGD_hook),
    ]


def _cycle(per_config: int) -> None:
    for kwargs, state, hook in _configs():
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
        ddp = gradring.DistributedDataParallel(model, **kwargs)
        if hook is not None:
            ddp.register_comm_hook(state, hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        for _ in range(per_config):
            opt.zero_grad()
            loss = ddp(torch.randn(4, 32)).pow(2).mean()
            loss.backward()
            opt.step()
        assert math.isfinite(loss.item())
        del ddp, opt, model, state
        gc.collect()


def _snapshot() -> dict:
    gc.collect()
    return {"threads": threading.active_count(), "fds": _fds(), "maps": _gradring_maps()}


def _soak(rank: int, world_size: int) -> dict:
    torch.manual_seed(rank)
    per_config = math.ceil(ITERATIONS / (CYCLES * len(_configs())))
    # One short warm-up cycle opens whatever is opened once (libraries, sockets).
    _cycle(3)
    dist.barrier()
    gradring.comm.shutdown()
    before = _snapshot()
    rss = []
    for _ in range(CYCLES):
        _cycle(per_config)
        rss.append(_rss_kib())
    dist.barrier()
    gradring.comm.shutdown()
    return {"before": before, "after": _snapshot(), "rss_kib": rss, "pid": os.getpid(),
            "iterations": per_config * CYCLES * len(_configs())}


def test_soak_leaves_nothing_behind():
    results = run_local(_soak, 2, timeout_s=400)
    for r in results:
        assert r["iterations"] >= ITERATIONS, r
        b, a = r["before"], r["after"]
        assert a["threads"] <= b["threads"], r  # engine threads are gone after shutdown
        assert a["fds"] <= b["fds"], r
        assert a["maps"] <= b["maps"], r
        # flat from the second cycle on (the first may still warm allocator pools)
        assert r["rss_kib"][-1] - r["rss_kib"][1] < 16 * 1024, r
    leftovers = [n for n in os.listdir("/dev/shm") if n.startswith("gradring-")
                 and any(f"-{r['pid']}-" in n for r in results)]
    assert leftovers == []
