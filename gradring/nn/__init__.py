"""Layers that need to talk to the other ranks."""

from gradring.nn.sync_batchnorm import SyncBatchNorm

__all__ = ["SyncBatchNorm"]
