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
- ``shutdown()`` tears everything down (threads, shared memory); later calls
  start afresh.

How it is built (details in docs/collectives.md):

- algorithms: ``ring``, ``tree`` and ``naive`` over point-to-point messages;
  ``direct`` (shared-memory reads) -- see [Note: algorithms versus transports]
  in ``transport.py``;
- transports: ``shm`` (one host, default for CPU tensors there), ``torchdist``
  (the process group's send/recv, across hosts), ``threaded`` (tests);
- ``select``: thresholds and the ``GRADRING_ALGO`` / ``GRADRING_TRANSPORT`` /
  ``GRADRING_TIMEOUT`` overrides; ``engine``: the per-group async thread;
- ``watchdog``: deadlines, fail-fast markers, the flight recorder
  (``GRADRING_FLIGHT_RECORDER``); ``desync``: fingerprint checks
  (``GRADRING_CHECK``); see docs/reliability.md. ``label("bucket 3")`` names
  the collectives issued inside it in errors and the recorder.

CUDA tensors go to the process group's native collectives.
"""

from __future__ import annotations

from typing import Any

from gradring.comm.api import (
    ReduceOp,
    all_gather_into_tensor,
    all_reduce,
    barrier,
    broadcast,
    empty,
    in_transport_memory,
    reduce_scatter_tensor,
)
from gradring.comm.context import shutdown as _shutdown
from gradring.comm.desync import DesyncError
from gradring.comm.engine import Work
from gradring.comm.transport import CollectiveError
from gradring.comm.watchdog import label

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
]


def shutdown(group: Any = None) -> None:
    """Tear down gradring's collectives for ``group``, or for every group when None.

    Stops engine threads (queued work finishes first), closes transports and
    removes their shared-memory segments. Call before
    ``torch.distributed.destroy_process_group``; it also runs at exit.
    """
    if group is None:
        _shutdown(all_groups=True)
    else:
        _shutdown(group)
