"""The small interfaces algorithms are written against, and the types they share.

[Note: algorithms versus transports]
An algorithm (``ring``, ``tree``, ``naive``, ``direct``) never knows how bytes
move. Ring, tree and naive only use the point-to-point :class:`Transport`
(``isend`` / ``irecv`` / ``wait_all``); every transport offers it. ``direct``
is the shared-memory specialisation: it uses :class:`DirectTransport`, whose
ranks can read each other's buffers once they have been *exposed* and
*exchanged*; the shm transport (and the tests' threaded one) offers it. So
every algorithm runs on thread-ranks in unit tests (``tests/support/threaded.py``),
and ring/tree also run on shm and over torch.distributed.

[Note: requests progress in wait_all]
``isend``/``irecv`` only describe a transfer; a transport may move the bytes
at once (threads, gloo's own threads) or only inside ``wait_all`` (shm, which
has no helper thread). Algorithms therefore post every request of a step
before waiting on any of them, which keeps bounded mailboxes deadlock-free.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import torch

from gradring.comm.ops import Op


class Kind(enum.IntEnum):
    """Which collective is in flight (also written into shared descriptors)."""

    ALL_REDUCE = 1
    BROADCAST = 2
    ALL_GATHER = 3
    REDUCE_SCATTER = 4
    BARRIER = 5

    @property
    def label(self) -> str:
        return self.name.lower()


class Collective(Protocol):
    """What transports and algorithms read of a collective: the fields of
    :class:`gradring.comm.collective.Collective` (the one object that describes a
    collective; this is its interface, so that this module needs nothing above it)."""

    seq: int  # per-group issue number, identical on every rank
    kind: Kind
    nbytes: int  # bytes of this rank's input tensor
    dtype: torch.dtype
    algo: str  # e.g. "direct/twoshot over shm"
    group: str  # the process group's name
    shape: tuple[int, ...]  # the caller's tensor shape (desync checks, messages)
    label: str | None  # the caller's label, e.g. "DDP bucket 3"

    def describe(self) -> str:
        """The collective in words, for errors."""


def describe_collective(kind: str, seq: int, nbytes: int, dtype: torch.dtype | str,
                        shape: Sequence[int] = (), label: str | None = None) -> str:
    """A collective in words, the same in every message: ``all_reduce #3 (12 bytes,
    float32, shape [3], DDP bucket 0)`` (shape and label only when known)."""
    dtype = str(dtype).replace("torch.", "")
    shape_text = f", shape {list(shape)}" if len(shape) else ""
    label_text = f", {label}" if label else ""
    return f"{kind} #{seq} ({nbytes} bytes, {dtype}{shape_text}{label_text})"


class CollectiveError(RuntimeError):
    """A collective failed: a peer died, timed out or issued something else."""


class Exchange(NamedTuple):
    """Result of :meth:`DirectTransport.exchange`."""

    views: list[torch.Tensor | None]  # rank p's exposed buffer, or None if p exposed none
    zero_copy: bool  # some rank exposed user memory: nobody may return before all are done


class Transport(Protocol):
    """Point-to-point primitives; see [Note: algorithms versus transports]."""

    name: str
    rank: int
    world_size: int

    def start(self, info: Collective) -> None:
        """Begin a collective: arm its deadline and remember it for error messages."""

    def isend(self, buf: torch.Tensor, dst: int) -> Any:
        """Post sending flat ``buf`` to ``dst``; ``buf`` must stay untouched until waited."""

    def irecv(self, buf: torch.Tensor, src: int, op: Op | None = None) -> Any:
        """Post receiving into ``buf`` from ``src``; with ``op``, ``buf = buf (op) incoming``."""

    def wait_all(self, reqs: Sequence[Any]) -> None:
        """Complete the given requests (and progress any other pending ones)."""

    def close(self) -> None:
        """Release every resource; the transport is unusable afterwards."""


class DirectTransport(Transport, Protocol):
    """Ranks can read each other's exposed memory (shared memory, threads)."""

    def expose(self, flat: torch.Tensor, *,
               force_staging: bool = False) -> tuple[torch.Tensor, bool]:
        """Return ``(buffer, zero_copy)``: a tensor like ``flat`` that peers can read.

        It is ``flat`` itself when ``flat`` already lives in transport memory
        (``zero_copy``), else -- or with ``force_staging`` -- one of two
        alternating staging buffers whose contents the caller fills. Call at
        most once per collective, before ``exchange``.
        """

    def exchange(self, info: Collective, exposed: torch.Tensor | None, *,
                 zero_copy: bool) -> Exchange:
        """Publish ``exposed``, wait for every rank to arrive, return all ranks' buffers.

        Raises :class:`CollectiveError` if a peer is in a different collective.
        """

    def exchange_inline(self, info: Collective, flat: torch.Tensor) -> list[torch.Tensor]:
        """Copy ``flat`` (small, contiguous, of any shape) where peers read it; after
        one barrier, return every rank's copy in rank order, shaped like ``flat``.
        The copies stay readable until this rank's next exchange, and nothing that
        follows needs a closing barrier."""

    def arrive(self) -> None:
        """Announce that this rank reached the next barrier, without waiting."""

    def wait_arrivals(self) -> None:
        """Wait until every rank has arrived at the barrier announced last."""

    def barrier(self) -> None:
        """``arrive()`` then ``wait_arrivals()``."""
