"""Which transport and algorithm a collective uses: measured thresholds plus overrides.

Environment overrides (read at every call, so a benchmark can switch):

- ``GRADRING_TRANSPORT=shm|torch``: force the transport (``shm`` fails loudly
  if the ranks do not share a host);
- ``GRADRING_ALGO=ring|tree|native``: force the algorithm; ``native`` hands
  the call to the process group's own collective (gloo);
- ``GRADRING_TIMEOUT=<seconds>``: overrides the process group's timeout.

Defaults (thresholds measured with ``benchmarks/allreduce.py``, world 2 and
4, on a 2-core VM; see docs/collectives.md):

- shm: all-reduce ``direct/oneshot`` up to ``ONESHOT_MAX_BYTES`` (one barrier,
  latency-bound), ``direct/twoshot`` above (minimum memory traffic); every
  other collective is ``direct``.
- torch: all-reduce ``tree`` up to ``TREE_MAX_BYTES`` (fewer hops), ``ring``
  above (bandwidth-optimal); broadcast ``tree`` (binomial); reduce-scatter
  and all-gather ``ring``.
"""

from __future__ import annotations

import os
from typing import NamedTuple

from gradring.comm.transport import Kind

#: Largest all-reduce (bytes) run as one-shot on shared memory.
ONESHOT_MAX_BYTES = 16 * 1024
#: Largest all-reduce (bytes) run on the double binary tree over torch p2p.
TREE_MAX_BYTES = 64 * 1024

TRANSPORTS = ("shm", "torch")
ALGOS = ("ring", "tree", "native")


class Choice(NamedTuple):
    """How one collective runs."""

    transport: str  # "shm" | "torch" | "native"
    algo: str  # "direct/oneshot", "direct/twoshot", "direct", "ring", "tree", "native"


def env_transport() -> str | None:
    value = os.environ.get("GRADRING_TRANSPORT", "").strip().lower()
    if value and value not in TRANSPORTS:
        raise ValueError(f"GRADRING_TRANSPORT must be one of {TRANSPORTS}, not {value!r}")
    return value or None


def env_algo() -> str | None:
    value = os.environ.get("GRADRING_ALGO", "").strip().lower()
    if value and value not in ALGOS:
        raise ValueError(f"GRADRING_ALGO must be one of {ALGOS}, not {value!r}")
    return value or None


class Overrides(NamedTuple):
    """The GRADRING_TRANSPORT / GRADRING_ALGO settings in force when a call was issued."""

    transport: str | None
    algo: str | None


_last: tuple[tuple[str, str], Overrides] | None = None


def overrides() -> Overrides:
    """Both overrides, parsed once per distinct environment value (cheap per call)."""
    global _last
    raw = (os.environ.get("GRADRING_TRANSPORT", ""), os.environ.get("GRADRING_ALGO", ""))
    if _last is None or _last[0] != raw:
        _last = (raw, Overrides(env_transport(), env_algo()))
    return _last[1]


def env_timeout() -> float | None:
    value = os.environ.get("GRADRING_TIMEOUT", "").strip()
    return float(value) if value else None


def choose(kind: Kind, nbytes: int, transport: str, algo: str | None) -> Choice:
    """The algorithm for ``kind`` on ``transport`` ("shm" or "torch"), honouring ``algo``."""
    if algo == "native":
        return Choice("native", "native")
    if kind == Kind.ALL_REDUCE:
        if algo in ("ring", "tree"):
            return Choice(transport, algo)
        if transport == "shm":
            return Choice("shm", "direct/oneshot" if nbytes <= ONESHOT_MAX_BYTES
                          else "direct/twoshot")
        return Choice(transport, "tree" if nbytes <= TREE_MAX_BYTES else "ring")
    if transport == "shm" and algo is None:
        return Choice("shm", "direct")
    if kind in (Kind.BROADCAST, Kind.BARRIER):
        return Choice(transport, "tree")
    return Choice(transport, "ring")  # reduce-scatter, all-gather
