"""gradring's collective algorithms, and the one table that names them.

Every algorithm is reached through :data:`ALGORITHMS`, keyed by its name (as
``select.choose`` and ``GRADRING_ALGO`` spell it) and the collective's
:class:`~gradring.comm.transport.Kind`, with one signature,
``(transport, call) -> None`` (:class:`Call` carries everything a collective
can need); the table adapts the modules' natural signatures. The algorithms
themselves: docs/collectives.md ("Algorithms").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from gradring.comm import external, ops
from gradring.comm.algos import direct, hierarchical, naive, ring, tree
from gradring.comm.external import ExternalParts
from gradring.comm.ops import Op
from gradring.comm.transport import Collective, Kind


class Call(NamedTuple):
    """One collective as an algorithm receives it."""

    info: Collective  # what it is (seq, kind, bytes, ...): descriptors and errors
    out: torch.Tensor  # flat, written (the tensor itself for in-place collectives)
    inp: torch.Tensor  # flat, read (same object as ``out`` when in place)
    op: Op = ops.SUM  # reduction (SUM for copies)
    root: int = 0  # broadcast source, as a group rank
    parts: ExternalParts | None = None  # all-reduce only: see [Note: external parts]


#: The one signature every registered algorithm has.
Algorithm = Callable[[Any, Call], None]

ALL_REDUCE, BROADCAST, ALL_GATHER, REDUCE_SCATTER, BARRIER = (
    Kind.ALL_REDUCE, Kind.BROADCAST, Kind.ALL_GATHER, Kind.REDUCE_SCATTER, Kind.BARRIER)

#: ``(algorithm name, kind) -> algorithm``: every way a collective can run.
ALGORITHMS: dict[tuple[str, Kind], Algorithm] = {
    ("ring", ALL_REDUCE): lambda t, c: ring.all_reduce(t, c.out, c.op),
    ("ring", REDUCE_SCATTER): lambda t, c: ring.reduce_scatter(t, c.out, c.inp, c.op),
    ("ring", ALL_GATHER): lambda t, c: ring.all_gather(t, c.out, c.inp),
    ("tree", ALL_REDUCE): lambda t, c: tree.all_reduce(t, c.out, c.op),
    ("tree", BROADCAST): lambda t, c: tree.broadcast(t, c.out, c.root),
    ("tree", BARRIER): lambda t, c: tree.barrier(t),
    ("naive", ALL_REDUCE): lambda t, c: naive.all_reduce(t, c.out, c.op),
    ("direct/inline", ALL_REDUCE):
        lambda t, c: direct.all_reduce_inline(t, c.info, c.out, c.op),
    ("direct/oneshot", ALL_REDUCE):
        lambda t, c: direct.all_reduce_oneshot(t, c.info, c.out, c.op),
    ("direct/twoshot", ALL_REDUCE):
        lambda t, c: direct.all_reduce_twoshot(t, c.info, c.out, c.op, c.parts),
    ("direct", BROADCAST): lambda t, c: direct.broadcast(t, c.info, c.out, c.root),
    ("direct", ALL_GATHER): lambda t, c: direct.all_gather(t, c.info, c.out, c.inp),
    ("direct", REDUCE_SCATTER):
        lambda t, c: direct.reduce_scatter(t, c.info, c.out, c.inp, c.op),
    ("direct", BARRIER): lambda t, c: direct.barrier(t, c.info),
    ("hierarchical", ALL_REDUCE): lambda t, c: hierarchical.all_reduce(t, c.info, c.out, c.op),
}

#: The algorithms that read an all-reduce's external parts themselves.
READS_PARTS = frozenset({"direct/twoshot"})


def lookup(name: str, kind: Kind) -> Algorithm:
    """The algorithm ``name`` for ``kind``; a clear error for a pair that does not exist."""
    try:
        return ALGORITHMS[(name, kind)]
    except KeyError:
        known = sorted({n for n, k in ALGORITHMS if k == kind})
        raise ValueError(f"gradring has no {kind.label} algorithm {name!r}; "
                         f"known: {known}") from None


def run(name: str, transport: Any, call: Call) -> None:
    """Run ``call`` with algorithm ``name`` on ``transport``. An all-reduce with external
    parts on an algorithm that does not read them is staged around a plain one
    (``external.py``)."""
    algorithm = lookup(name, call.info.kind)
    h = call.parts
    if h is None or name in READS_PARTS:
        algorithm(transport, call)
        return
    lo, hi = external.own_range(call.out.numel(), transport.rank, transport.world_size)
    external.stage_in(call.out, h, lo, hi)
    algorithm(transport, call._replace(parts=None))
    external.finish_out(call.out, h)
