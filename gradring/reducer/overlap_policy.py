"""Whether a bucket's all-reduce overlaps the backward, or waits for its end.

[Note: overlap needs a free core]
torch's DDP launches each bucket's all-reduce as soon as the bucket is ready,
so that communication runs while autograd computes the earlier layers. That
pays when the communication runs somewhere else: on a GPU's copy engines, or
on a CPU core the backward does not use. gradring's shared-memory all-reduce
is CPU work done by the group's comm thread, so on a host with no core to
spare that thread can only take one from a backward.

gradring launches when ready, as torch does, on every host, even where it
counts no free core: reducing every bucket at the end of the backward on
such a host (joined into one collective), measured side by side against
launching when ready (``benchmarks/ablation.py``, five models, world 2 on a
2-core VM, quiet and with two competing processes), won beyond the spread
on no model and lost beyond it on the 12 x Linear(1024) MLP under load
(docs/design.md, "Fast paths, measured"). So the host does not decide.

``GRADRING_OVERLAP=0`` still reduces every bucket on the training thread
when the backward ends, in bucket order (see [Note: buckets left to the
finalize] in ``launcher.py``), for a user whose own
measurement (``gradring bench ddp --overlap``) says it pays on their host;
the results are the same bits either way. Every rank follows rank 0's
choice (it travels with rank 0's bucket assignment): ranks that launched
buckets at different times could issue the unused-parameter map of
``static_graph``'s first iteration, or Join's flag, in a different order
relative to the buckets. Shared memory being given up later (a full
``/dev/shm``, which every rank does together) switches overlap back on at
the next backward.

The choice does not apply with a comm hook, a fused optimizer or
``find_unused_parameters``: those keep launching at ready time (they need the
futures, step buckets early, or send the usage map after the last bucket).
"""

from __future__ import annotations

from typing import NamedTuple

from gradring import config

#: ``GRADRING_OVERLAP``: "0"/"off" reduces every bucket at the end of the backward.
ENV = "GRADRING_OVERLAP"


class OverlapChoice(NamedTuple):
    """Whether buckets launch when ready (True) or at the end of the backward, and why."""

    overlap: bool
    why: str


def choose(*, env: str | None = None) -> OverlapChoice:
    """This rank's choice (see [Note: overlap needs a free core]); ``env``
    defaults to ``GRADRING_OVERLAP``. The reducer makes every rank follow rank 0's."""
    value = (config.current().overlap if env is None else env).strip().lower()
    if value in ("0", "off", "false", "no"):
        return OverlapChoice(False, f"{ENV}={value}")
    if value in ("1", "on", "true", "yes"):
        return OverlapChoice(True, f"{ENV}={value}")
    return OverlapChoice(True, "buckets launch as they become ready, as in torch's DDP")
