"""Which transport and algorithm a collective uses: measured thresholds plus overrides.

Overrides, read at every call (parsed in ``gradring/config.py``):
``GRADRING_TRANSPORT=shm|torch`` forces the transport (``shm`` fails loudly
off one host); ``GRADRING_ALGO=ring|tree|hierarchical|native`` the algorithm
(``native``: the process group's own collective; ``ring``/``tree`` on several
hosts run flat over the process group; ``hierarchical`` is the default there
when every host has the same number > 1 of ranks).

Defaults (crossovers in docs/collectives.md, "Thresholds"): on shm, all-reduce
``direct/inline`` up to ``INLINE_MAX_BYTES``, ``direct/oneshot`` up to
``oneshot_max_bytes(W)`` (every rank reads all W buffers, so it shrinks as
1/W), ``direct/twoshot`` above, every other collective ``direct``; on torch,
all-reduce ``tree`` up to ``TREE_MAX_BYTES``, ``ring`` above, broadcast
``tree``, reduce-scatter and all-gather ``ring``; several hosts with several
ranks each: all-reduce ``hierarchical`` at every size, the rest as on torch.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from gradring import config
from gradring.comm.transport import Kind
from gradring.comm.transports.shm.layout import INLINE_BYTES

#: Largest all-reduce (bytes) whose inputs travel inline, in the control segments.
INLINE_MAX_BYTES = INLINE_BYTES
#: Largest all-reduce (bytes) run as one-shot on shared memory, at world size 2.
ONESHOT_MAX_BYTES = 256 * 1024
#: Largest all-reduce (bytes) run on the double binary tree over torch p2p.
TREE_MAX_BYTES = 256 * 1024


def oneshot_max_bytes(world_size: int) -> int:
    """One-shot reads W buffers per rank, two-shot ~3: the crossover scales as 1/W."""
    return ONESHOT_MAX_BYTES * 2 // max(2, world_size)

#: Transport label of a multi-host group with shared memory inside each host.
HOSTS = "shm+torch"


class Choice(NamedTuple):
    """How one collective runs."""

    transport: str  # "shm" | "torch" | "native"
    algo: str  # "direct/oneshot", "direct/twoshot", "direct", "ring", "tree", "native"


class Overrides(NamedTuple):
    """The GRADRING_TRANSPORT / GRADRING_ALGO settings in force when a call was issued."""

    transport: str | None
    algo: str | None


#: ``overrides()``: both overrides as the environment says at the call (cheap per call:
#: see [Note: when the environment is read] in ``gradring/config.py``).
overrides = config.view(("transport", "algo"), lambda c: Overrides(c.transport, c.algo))


def choose(kind: Kind, nbytes: int, world_size: int, transport: str,
           algo: str | None) -> Choice:
    """The algorithm for ``kind`` on ``transport`` ("shm", "torch" or ``HOSTS``),
    honouring ``algo``."""
    if algo == "native":
        return Choice("native", "native")
    if transport == HOSTS:
        if kind == Kind.ALL_REDUCE and algo in (None, "hierarchical"):
            return Choice(HOSTS, "hierarchical")
        transport = "torch"  # the rest runs flat over the group's point-to-point
    if algo == "hierarchical":
        algo = None  # one host, or one rank per host: nothing to be hierarchical about
    if kind == Kind.ALL_REDUCE:
        if algo in ("ring", "tree"):
            return Choice(transport, algo)
        if transport == "shm":
            if nbytes <= INLINE_MAX_BYTES:
                return Choice("shm", "direct/inline")
            return Choice("shm", "direct/oneshot" if nbytes <= oneshot_max_bytes(world_size)
                          else "direct/twoshot")
        return Choice(transport, "tree" if nbytes <= TREE_MAX_BYTES else "ring")
    if transport == "shm" and algo is None:
        return Choice("shm", "direct")
    if kind in (Kind.BROADCAST, Kind.BARRIER):
        return Choice(transport, "tree")
    return Choice(transport, "ring")  # reduce-scatter, all-gather


def pick_transport(transports: Any, forced: str | None, group: str) -> tuple[str, Any]:
    """``(label, transport)`` for a collective of the group whose ``GroupTransports``
    is ``transports``: shm on one host, the multi-host pair across hosts with
    several ranks each, else torch point-to-point; ``forced`` is
    ``GRADRING_TRANSPORT``. The first call connects (collective)."""
    if forced != "torch":
        t = transports.shm()
        if t is not None:
            return "shm", t
        if forced == "shm":
            raise RuntimeError(f"GRADRING_TRANSPORT=shm but shared memory is unavailable "
                               f"for group {group}: {transports.shm_reason}")
        hosts = transports.hosts()
        if hosts is not None:
            return HOSTS, hosts
    return "torch", transports.torch()
