"""Atomic checkpoints for restartable training (torchrun --max-restarts).

A checkpoint is written to a temporary file in the same folder, flushed to
disk, and renamed over the target in one step: a crash at any moment leaves
either the previous complete checkpoint or the new complete one, never a torn
file. Only one rank (rank 0 by default) writes; every rank reads.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist


def save_atomic(obj: Any, path: str) -> None:
    """Write ``obj`` with torch.save so that ``path`` is always complete or absent."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".pt", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save_on_rank0(obj: Any, path: str, group: Any = None) -> None:
    """Rank 0 writes atomically; everyone waits until the file is in place."""
    if not dist.is_initialized() or dist.get_rank(group) == 0:
        save_atomic(obj, path)
    if dist.is_initialized():
        dist.barrier(group=group)


def load_if_exists(path: str) -> Any | None:
    """The checkpoint at ``path``, or None when there is none yet."""
    if not os.path.exists(path):
        return None
    return torch.load(path, map_location="cpu", weights_only=False)
