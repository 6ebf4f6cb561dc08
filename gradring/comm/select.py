"""Which transport and algorithm a collective uses: measured thresholds plus overrides.

Environment overrides (read at every call, so a benchmark can switch; parsed and
validated in ``gradring/config.py``):

- ``GRADRING_TRANSPORT=shm|torch``: force the transport (``shm`` fails loudly
  if the ranks do not share a host);
- ``GRADRING_ALGO=ring|tree|hierarchical|native``: force the algorithm;
  ``native`` hands the call to the process group's own collective (gloo);
  ``ring``/``tree`` on a multi-host group run flat over the process group's
  point-to-point; ``hierarchical`` only matters there (it is the default
  when every host has the same number > 1 of ranks; elsewhere it means "the
  default");
- ``GRADRING_TIMEOUT=<seconds>``: overrides the process group's timeout (read
  when the group's state is made, ``context.py``).

Defaults (crossovers measured at world 2 and 4 on a 2-core VM, numbers in
docs/collectives.md):

- shm: all-reduce ``direct/inline`` up to ``INLINE_MAX_BYTES`` (the inputs
  travel in the control segments: one barrier in all), ``direct/oneshot`` up
  to ``oneshot_max_bytes(W)`` (one barrier plus the closing agreement; every
  rank reads all W buffers, so the crossover shrinks as 1/W: 256 KiB at W=2,
  128 KiB at W=4), ``direct/twoshot`` above (minimum memory traffic); every
  other collective is ``direct``.
- torch: all-reduce ``tree`` up to ``TREE_MAX_BYTES`` (2·log2 W hops instead
  of 2(W-1)), ``ring`` above (bandwidth-optimal, pipelined); broadcast
  ``tree`` (binomial); reduce-scatter and all-gather ``ring``.
- shm+torch (several hosts, several ranks on each, see ``hierarchical.py``):
  all-reduce ``hierarchical`` at every size (shared memory inside a host,
  then one all-reduce per local rank across hosts, picked by the torch rule
  above for the shard's size); everything else as on torch, flat.
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
