"""gradring: data-parallel training for PyTorch.

``gradring.DistributedDataParallel`` is a drop-in replacement for
``torch.nn.parallel.DistributedDataParallel`` with its own reducer and, on one
host, its own shared-memory collectives.
"""

from gradring import comm
from gradring.ddp import DistributedDataParallel, Join, Joinable, JoinHook
from gradring.install import install, uninstall
from gradring.nn import SyncBatchNorm

DDP = DistributedDataParallel


def explain(ddp: DistributedDataParallel, **kw: object) -> object:
    """Why is this DDP step slow? A measured step breakdown, stragglers and ranked findings.

    Collective: call it on every rank at the same point, after a few training
    steps. Returns a ``gradring.tools.explain_record.Explanation``; ``print`` it.
    Keyword arguments go to ``gradring.tools.explain_record.explain_ddp``."""
    from gradring.tools.explain_record import explain_ddp

    return explain_ddp(ddp, **kw)  # type: ignore[arg-type]


__all__ = ["DDP", "DistributedDataParallel", "Join", "JoinHook", "Joinable", "SyncBatchNorm",
           "comm", "explain", "install", "uninstall"]
