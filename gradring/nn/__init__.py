"""Layers that need to talk to the other ranks."""

from gradring.nn.sync_batchnorm import SyncBatchNorm, SyncBatchNormAct

__all__ = ["SyncBatchNorm", "SyncBatchNormAct"]
