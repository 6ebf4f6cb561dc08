"""What a shared-memory rank tells its peers about itself: the status block.

The collective the rank started last and its state (fields in ``layout.py``),
written by the owner and read by peers, to fail fast and to say what a
missing rank is doing. ``struct.pack_into`` zero-fills before it writes, so a
plain read could see a half-written block: the version word makes it a
seqlock (bumped before and after each write, stores in order on x86-64; a
reader retries until it saw the same even version before and after).
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

from gradring.comm import peers
from gradring.comm.transport import Collective, Kind
from gradring.comm.transports.shm.layout import STATUS as _STRUCT
from gradring.comm.transports.shm.layout import STATUS_OFF as OFFSET
from gradring.comm.transports.shm.layout import STATUS_STATE_WORD as _STATE_WORD
from gradring.comm.transports.shm.layout import STATUS_VERSION_WORD as _VERSION_WORD
from gradring.comm.transports.shm.layout import STATUS_WHY_WORD as _WHY_WORD

RUNNING, CLOSED, FAILED = 0, 1, 2
TIMEOUT, LOST_PEER, DESYNC, ABORTED, ERROR = 1, 2, 3, 4, 5
#: How a peer words each failure reason (ERROR: any other exception, named in the
#: rank's reason text, see ``verdict.py``).
WHY = {TIMEOUT: "timed out", LOST_PEER: "lost a peer", DESYNC: "saw a desync",
       ABORTED: "was aborted", ERROR: "raised an error"}


class Status(NamedTuple):
    """One rank's status block, as a peer reads it."""

    seq: int
    kind: int
    state: int
    nbytes: int
    dtype: int
    why: int
    shape: int

    def last(self) -> str:
        """The collective it started last, in words."""
        return f"{Kind(self.kind).label} #{self.seq}" if self.kind in Kind._value2member_map_ \
            else "nothing"

    def reason(self) -> str:
        return WHY.get(self.why, "failed")


def publish(mm: Any, words: Any, info: Collective, dtype_code: int,
            shape_hash: int) -> None:
    """Start of a collective: announce it (state running). ``words``: 32-bit view of ``mm``."""
    words[_VERSION_WORD] += 1
    _STRUCT.pack_into(mm, OFFSET, info.seq, int(info.kind), RUNNING, info.nbytes, dtype_code,
                      0, shape_hash)
    words[_VERSION_WORD] += 1


def set_state(words: Any, state: int, why: int = 0) -> None:
    """Closed or failed (and why); ``words`` is the owner's 32-bit view."""
    words[_VERSION_WORD] += 1
    words[_WHY_WORD] = why
    words[_STATE_WORD] = state
    words[_VERSION_WORD] += 1


def read(mm: Any, words: Any) -> Status:
    """A consistent copy of a peer's block (``words``: 32-bit view of ``mm``); after
    ~4096 tries (an owner killed mid-write) the last, possibly torn, copy."""
    for spins in range(1, 4097):
        before = words[_VERSION_WORD]
        status = Status(*_STRUCT.unpack_from(mm, OFFSET))
        if not before & 1 and words[_VERSION_WORD] == before:
            break
        if spins % 64 == 0:
            os.sched_yield()  # the owner was preempted mid-write: let it finish
    return status


def describe(rank: int, pid: int, status: Status, *, alive: bool, seq: int,
             stopped: bool = False) -> str:
    """Rank ``rank``'s situation as seen by a rank waiting in collective ``seq``;
    ``stopped``: its process is stopped (SIGSTOP or a debugger), so it cannot move."""
    who, last = f"rank {rank} (pid {pid})", status.last()
    skipped = f", so it skipped #{seq}" if status.seq < seq else ""
    if not alive:
        return f"{who} has exited (last started {last}{skipped}): {peers.how_it_ended(pid)}"
    if status.state == CLOSED:
        return f"{who} left: it shut gradring down after starting {last}{skipped}"
    if status.state == FAILED:
        return f"{who} {status.reason()} in {last}"
    if stopped:
        return f"{who} is stopped (SIGSTOP or a debugger: process state T), last started " \
            f"{last}" + (" (it has not reached this collective)" if status.seq < seq else "")
    return f"{who} is alive and last started {last}" + \
        (" (it has not reached this collective)" if status.seq < seq else "")
