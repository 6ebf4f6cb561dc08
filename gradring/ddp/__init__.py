"""gradring's DistributedDataParallel and what it is made of.

``module.py`` holds the wrapper class, ``buffers.py`` the buffer sync,
``join.py`` the DDP side of Join, ``consumers.py`` the one consumer of the
buckets (comm hook, fused optimizer or in-backward optimizers), and
``output_boundary.py`` the autograd Function around the forward's outputs.
"""

from gradring.ddp.join import DDPJoinHook, Join, Joinable, JoinHook
from gradring.ddp.module import DistributedDataParallel, TorchDDP

# The class is reached as gradring.ddp.DistributedDataParallel: its pickles
# name this stable path, and so do libraries that print type(model).__module__.
DistributedDataParallel.__module__ = __name__

__all__ = ["DDPJoinHook", "DistributedDataParallel", "Join", "JoinHook", "Joinable", "TorchDDP"]
