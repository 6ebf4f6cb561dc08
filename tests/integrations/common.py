"""Helpers that run inside the pooled ranks of the framework tests."""

from __future__ import annotations

import os
from typing import Any

import torch

SHM_DIR = "/dev/shm"


def launched_like_torchrun(rank: int, world_size: int) -> None:
    """Give the rank the environment torchrun gives its children.

    The pool's process group is already initialised; with these variables the
    frameworks see an externally launched job (Lightning's TorchElasticEnvironment,
    Accelerate's MULTI_CPU) and use that group instead of starting processes.
    """
    os.environ.update({
        "TORCHELASTIC_RUN_ID": "gradring-tests", "RANK": str(rank),
        "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), "GROUP_RANK": "0",
        "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500", "OMP_NUM_THREADS": "1",
    })
    torch.set_num_threads(1)


def my_segments() -> list[str]:
    """This process's gradring shared-memory segments."""
    mine = f"gradring-{os.getpid()}-"
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(mine))


def release() -> list[str]:
    """Shut gradring's collectives down (as before destroy_process_group) and
    return the segments that are still there: a test asserts it is empty."""
    import gradring

    gradring.comm.shutdown()
    return my_segments()


def params_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def exactly_equal(a: Any, b: Any) -> bool:
    """Structural equality with torch.equal on tensors (dtype included) and == on floats."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            exactly_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(
            exactly_equal(x, y) for x, y in zip(a, b))
    return a == b


def first_difference(a: Any, b: Any, path: str = "") -> str:
    """Where two results first differ, for the assertion message."""
    if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        for k in a:
            if not exactly_equal(a[k], b[k]):
                return first_difference(a[k], b[k], f"{path}.{k}")
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            if not exactly_equal(x, y):
                return first_difference(x, y, f"{path}[{i}]")
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape:
        return f"{path}: max |diff| {(a.double() - b.double()).abs().max().item():.3g}"
    return f"{path}: {a!r} != {b!r}"
