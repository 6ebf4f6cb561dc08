"""When /dev/shm is too small: one collective decision, one warning, a fallback.

Segments are reserved whole when they are created (see [Note: reserving
shared memory] in ``segments.py``), so a full /dev/shm shows up as
:class:`~gradring.comm.transports.shm.segments.ShmFull` at creation, never
as a SIGBUS later. What happens then:

- the control segments (at connect): every rank publishes its error in the
  rendezvous, so all ranks give up shared memory together (``rendezvous.py``);
- ``comm.empty``: the tensor is ordinary memory instead (collectives on it
  are staged); purely local, nobody needs to agree;
- a staging buffer (inside a collective): the rank flags "no room" in its
  descriptor and every rank reads every descriptor after the start barrier,
  so all ranks see the flag in the same collective and raise
  :class:`ShmExhausted` together. The runner then drops the shm transport on
  every rank and re-runs the collective (and all later ones) over the process
  group -- or, with ``GRADRING_TRANSPORT=shm``, fails it on every rank.

The user is told once per process how much was needed and how to raise it.
"""

from __future__ import annotations

import os
import sys
import threading

from gradring.comm.transport import CollectiveError
from gradring.comm.transports.shm import segments

_MiB = 1 << 20
_warned = threading.Event()


class ShmExhausted(CollectiveError):
    """Some rank could not reserve a segment in this collective (all ranks raise it)."""

    def __init__(self, message: str, needed: int) -> None:
        super().__init__(message)
        self.needed = needed


def advice(needed: int, in_use: int, local_ranks: int) -> str:
    """How much /dev/shm is needed and how to get it, in words."""
    free, total = segments.shm_space()
    want = -(-((in_use + needed) * max(1, local_ranks) + 4 * _MiB) // _MiB)
    return (f"{segments.SHM_DIR} is too small for gradring's shared-memory transport: a "
            f"segment of {needed / _MiB:.1f} MiB did not fit ({free / _MiB:.1f} MiB free of "
            f"{total / _MiB:.1f} MiB); these {local_ranks} rank(s) need about {want} MiB. "
            f"Raise it: `docker run --shm-size={want}m ...` (Docker's default is 64 MiB), "
            f"`shm_size` in docker-compose, a larger `emptyDir: {{medium: Memory}}` on "
            f"Kubernetes, or `mount -o remount,size={want}m {segments.SHM_DIR}`")


def explain(exc: segments.ShmFull, in_use: int, local_ranks: int) -> str:
    """Why a segment could not be made, in words: taken names, else :func:`advice`."""
    if isinstance(exc, segments.NamesTaken):
        return str(exc)
    return advice(exc.needed, in_use, local_ranks)


def warn_once(text: str) -> None:
    """Print ``text`` as gradring's single /dev/shm warning of this process."""
    if _warned.is_set():
        return
    _warned.set()
    print(f"gradring warning (rank pid {os.getpid()}): {text}", file=sys.stderr, flush=True)
