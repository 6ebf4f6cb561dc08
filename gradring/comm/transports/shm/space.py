"""When /dev/shm is too small: one collective decision, one warning, a fallback.

Segments are reserved whole when created ([Note: reserving shared memory] in
``segments.py``), so a full /dev/shm is :class:`~gradring.comm.transports.shm.segments.ShmFull`
at creation, never a SIGBUS later. For control segments every rank gives up
shared memory at the rendezvous (``rendezvous.py``); ``comm.empty`` falls back
to ordinary memory; a staging buffer is flagged "no room" in the descriptor,
so every rank raises :class:`ShmExhausted` in the same collective and the
runner re-runs it (and all later ones) over the process group, or fails it
with ``GRADRING_TRANSPORT=shm`` (one host of a multi-host group: [Note: a host
without room in /dev/shm] in ``algos/hierarchical.py``). The user is told once
per process how much the job needs, the same figure on every rank ([Note: one
figure, two causes]); docs/reliability.md ("Shared memory under pressure") has
the messages.
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

    def __init__(self, message: str, needed: int, limited: list[int] | None = None) -> None:
        super().__init__(message)
        self.needed = needed
        # The ranks stopped by a process limit (``segments.LimitReached``), not by room.
        self.limited = limited or []


def job_need(needed: int, in_use: int, local_ranks: int) -> int:
    """Bytes of /dev/shm the job's ranks on this host need (whole MiB): each holds
    ``in_use`` and wants ``needed`` more, plus 4 MiB to spare. Callers pass figures
    every rank shares (the largest of the ranks'), so that every rank prints the
    same figure: see [Note: one figure, two causes]."""
    return -(-((in_use + needed) * max(1, local_ranks) + 4 * _MiB) // _MiB) * _MiB


#: :func:`cause`'s answers: the mount holds less than the job needs, or enough
#: but other processes (other jobs, files of crashed ones) fill it.
TOO_SMALL, TAKEN = "too small", "taken"


def cause(need: int, free: int, total: int) -> str:
    """Why a segment did not fit, from the mount's figures (``statvfs``) and the job's
    ``need`` (:func:`job_need`): :data:`TOO_SMALL` when the mount's total is below
    ``need`` (or unknown: 0), else :data:`TAKEN`.

    [Note: one figure, two causes]
    Raising ``--shm-size`` is the answer only when the mount is smaller than the
    job's need; when it is large enough, others hold its space (another job, a
    crashed job's files) and raising it only hides that. The need comes from
    figures every rank shares (the rendezvous publishes each rank's shortfall; a
    collective that runs out compares the ranks' largest staging buffer and
    holding), so every rank prints the same figure; ``comm.empty`` running out
    is one rank's own event, so there only rank 0 gives the job's figure.
    """
    if total <= 0 or total < need:
        return TOO_SMALL
    return TAKEN


def advice(needed: int, in_use: int, local_ranks: int,
           space: tuple[int, int] | None = None) -> str:
    """How much /dev/shm is needed and what to do, in words: raise the size when the
    mount is too small for the job, free it when others fill it (see :func:`cause`).
    ``space``: ``(free, total)`` bytes, else the mount's own."""
    free, total = segments.shm_space() if space is None else space
    need = job_need(needed, in_use, local_ranks)
    want = need // _MiB
    what = (f"a segment of {needed / _MiB:.1f} MiB did not fit ({free / _MiB:.1f} MiB free "
            f"of {total / _MiB:.1f} MiB)")
    if cause(need, free, total) == TAKEN:
        return (f"{segments.SHM_DIR} is large enough for gradring's shared-memory transport "
                f"({total / _MiB:.0f} MiB; these {local_ranks} rank(s) need about {want} MiB) "
                f"but other processes fill it: {what}. Free it: files of other or crashed "
                f"jobs (`ls -la {segments.SHM_DIR}`, `df -h {segments.SHM_DIR}`); raise its "
                f"size only if they must stay")
    return (f"{segments.SHM_DIR} is too small for gradring's shared-memory transport: "
            f"{what}; these {local_ranks} rank(s) need about {want} MiB. "
            f"Raise it: `docker run --shm-size={want}m ...` (Docker's default is 64 MiB), "
            f"`shm_size` in docker-compose, a larger `emptyDir: {{medium: Memory}}` on "
            f"Kubernetes, or `mount -o remount,size={want}m {segments.SHM_DIR}`")


def explain(exc: segments.ShmFull, in_use: int, local_ranks: int, rank: int = 0) -> str:
    """Why a segment could not be made, in words: taken names or a process limit
    (``segments.LimitReached``), else :func:`advice`
    (on rank 0; another rank says what did not fit: see [Note: one figure, two causes])."""
    if isinstance(exc, segments.LimitReached):
        return exc.strerror
    if isinstance(exc, segments.NamesTaken):
        return str(exc)
    if rank != 0:
        free, total = segments.shm_space()
        return (f"a segment of {exc.needed / _MiB:.1f} MiB did not fit in {segments.SHM_DIR} "
                f"({free / _MiB:.1f} MiB free of {total / _MiB:.1f} MiB; rank 0 tells how "
                f"much the job needs if it runs short too)")
    return advice(exc.needed, in_use, local_ranks)


def limit_notice(limited: list[int]) -> str:
    """What the ranks that did not reach a limit say when ``limited`` did (each of those
    names its limit in its own warning): /dev/shm's room is not the cause."""
    return (f"rank(s) {limited} reached a process limit (open files, `ulimit -n`, or "
            f"memory mappings) making a shared-memory segment; their own warning names it")


def warn_once(text: str) -> None:
    """Print ``text`` as gradring's single /dev/shm warning of this process."""
    if _warned.is_set():
        return
    _warned.set()
    print(f"gradring warning (rank pid {os.getpid()}): {text}", file=sys.stderr, flush=True)
