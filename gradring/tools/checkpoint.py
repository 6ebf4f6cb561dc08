"""Atomic checkpoints for restartable training (torchrun --max-restarts).

A checkpoint is written to a temporary file in the same folder, flushed to
disk, and renamed over the target in one step: a crash at any moment leaves
either the previous complete checkpoint or the new complete one, never a torn
file. Only one rank (rank 0 by default) writes; every rank reads.

[Note: checkpoints other users could plant]
Unpickling runs code, and checkpoint folders are often shared (``/tmp``), so
a local user who pre-creates the folder or plants a file there must not get
to run code as the job's user (often root). Checkpoints are therefore

- read with ``torch.load(..., weights_only=True)``: tensors, numbers, strings
  and the containers of a ``state_dict`` (the model's, the optimizer's, plain
  dicts and lists of them) load; any other pickled object is refused;
- read only from a regular file owned by the job's user that nobody else may
  write to, in a folder owned by the job's user or root that others may not
  write to unless it is sticky (``safe_files.open_private_input``);
- written with ``safe_files.atomic_output``: missing folders are created with
  mode 0700 without following links planted on the way, the temporary file is
  new (``O_EXCL | O_NOFOLLOW``, mode 0600), and the rename goes through the
  folder's descriptor.

A refused path raises ``safe_files.UnsafePath`` naming the path and why.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from gradring.safe_files import UnsafePath, atomic_output, open_private_input

__all__ = ["UnsafePath", "load_if_exists", "save_atomic", "save_on_rank0"]


def save_atomic(obj: Any, path: str) -> None:
    """Write ``obj`` with torch.save so that ``path`` is always complete or absent
    (see [Note: checkpoints other users could plant])."""
    with atomic_output(os.fspath(path), "wb", create_folders=True) as f:
        torch.save(obj, f)


def save_on_rank0(obj: Any, path: str, group: Any = None) -> None:
    """Rank 0 writes atomically; everyone waits until the file is in place."""
    if not dist.is_initialized() or dist.get_rank(group) == 0:
        save_atomic(obj, path)
    if dist.is_initialized():
        dist.barrier(group=group)


def load_if_exists(path: str) -> Any | None:
    """The checkpoint at ``path``, or None when there is none yet.

    Raises ``UnsafePath`` for a file or folder another user could have planted,
    and ``pickle.UnpicklingError`` for a file holding more than weights (see
    [Note: checkpoints other users could plant])."""
    try:
        f = open_private_input(os.fspath(path))
    except FileNotFoundError:
        return None
    with f:
        return torch.load(f, map_location="cpu", weights_only=True)
