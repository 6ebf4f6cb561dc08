"""gradring: data-parallel training for PyTorch.

``gradring.DistributedDataParallel`` is a drop-in replacement for
``torch.nn.parallel.DistributedDataParallel`` with its own reducer and, on one
host, its own shared-memory collectives.
"""

from gradring import comm
from gradring.ddp import DistributedDataParallel
from gradring.install import install, uninstall
from gradring.join import Join, Joinable, JoinHook
from gradring.nn import SyncBatchNorm

DDP = DistributedDataParallel

__all__ = ["DDP", "DistributedDataParallel", "Join", "JoinHook", "Joinable", "SyncBatchNorm",
           "comm", "install", "uninstall"]
