"""gradring's collectives, mirroring ``torch.distributed``'s functional API.

The contract the rest of gradring relies on:

- ``all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False)`` reduces in
  place; with ``async_op=True`` it returns a work object whose ``wait()`` blocks
  (and re-raises the collective's error) and whose ``get_future()`` is a
  ``torch.futures.Future`` resolving to ``[tensor]`` (exactly like torch's).
- ``broadcast``, ``all_gather_into_tensor``, ``reduce_scatter_tensor``,
  ``barrier`` likewise.
- ``empty(shape, dtype, group=None)`` returns a tensor living in the transport's
  own memory (zero-copy for collectives); DDP buckets are allocated with it.
- ``all_reduce_external(flat, parts, group=None)``: an all-reduce of ``flat``
  where some ranges live in other tensors, which hold their input and receive
  their result (``ExternalParts(pieces, scale)``; the part a rank reduces
  itself is ``own_range(numel, rank, world_size)``), see [Note: external
  parts] in ``external.py``.
- ``shutdown()`` tears everything down (threads, shared memory); later calls
  start afresh.

How it is built: docs/collectives.md; every module, with what it holds:
README.md's "What is where" (``tests/unit/test_readme.py`` keeps it complete).

Nothing here imports the DDP side (``gradring.ddp``, ``gradring.reducer``, ...).
CUDA tensors go to the process group's native collectives.
"""

from __future__ import annotations

from typing import Any

from gradring.comm.api import (
    ReduceOp,
    all_gather_into_tensor,
    all_reduce,
    all_reduce_external,
    barrier,
    broadcast,
    empty,
    in_transport_memory,
    reduce_scatter_tensor,
)
from gradring.comm.context import shutdown as _shutdown
from gradring.comm.desync import DesyncError
from gradring.comm.engine import Work
from gradring.comm.external import ExternalParts, own_range
from gradring.comm.recorder import label
from gradring.comm.transport import CollectiveError

__all__ = [
    "ReduceOp",
    "all_reduce",
    "broadcast",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "barrier",
    "empty",
    "in_transport_memory",
    "shutdown",
    "Work",
    "CollectiveError",
    "DesyncError",
    "label",
    "all_reduce_external",
    "ExternalParts",
    "own_range",
]


def shutdown(group: Any = None) -> None:
    """Tear down gradring's collectives for ``group``, or for every group when None.

    Stops engine threads (queued work finishes first), closes transports and
    removes their shared-memory segments. Collectives issued later start afresh.
    ``torch.distributed.destroy_process_group`` and the process's exit do this
    themselves, so a program need not call it.
    """
    if group is None:
        _shutdown(all_groups=True)
    else:
        _shutdown(group)
