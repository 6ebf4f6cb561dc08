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

How it is built (details in docs/collectives.md), module by module:

- ``api``: the functions above, issuing each collective; ``external``: the
  all-reduce with external parts (``ExternalParts``, ``own_range``);
- ``context``: per-group state; ``registry``: the groups that have some;
  ``runner``: one collective, start to finish (small synchronous
  all-reduces on the caller's thread too); ``engine``: the per-group
  async thread; ``select``: thresholds, the choice of transport and
  algorithm, and the ``GRADRING_ALGO`` / ``GRADRING_TRANSPORT`` overrides
  (every ``GRADRING_*`` variable is parsed in ``gradring/config.py``);
- ``ops``: reductions and chunking; ``transport``: the interfaces algorithms
  are written against -- see [Note: algorithms versus transports] there;
- ``algos/``: the registry (``algos/__init__``: name and kind -> algorithm)
  and ``ring``, ``tree``, ``naive`` (point-to-point), ``direct``
  (shared-memory reads), ``hierarchical`` (several hosts);
- ``transports/``: ``group`` (a group's transports, made on first use),
  ``torchdist`` (the process group's send/recv, across hosts), ``topology``
  (which ranks share a host), ``hosts`` (the multi-host transports and their
  rendezvous);
- ``transports/shm/``: the one-host transport -- ``transport``, ``memory``
  (its data segments and the peers' it maps; an object the transport
  owns), ``layout`` (every offset of the control segment), ``mailbox``,
  ``status``, ``verdict`` (sticky failures and the group lock), ``segments``
  (names, reservation, safe opening), ``space`` (a small /dev/shm: the
  collective fallback), ``sigterm``, ``orphans`` (workers whose torchrun
  agent died), ``futex``, ``rendezvous``;
- reliability (docs/reliability.md): ``watchdog`` (deadlines of what cannot be
  interrupted), ``board`` (the peers' markers), ``recorder`` (the flight
  recorder, ``GRADRING_FLIGHT_RECORDER``; ``label("bucket 3")`` names the
  collectives issued inside it), ``desync`` (fingerprints, ``GRADRING_CHECK``),
  ``failures`` (recording a failure, completing its error);
- ``store``: the group's private store and fresh key prefixes in it.

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
