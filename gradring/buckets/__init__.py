"""Gradient buckets: which parameters share one (``assign.py``), the flat-buffer
``Bucket`` and its transitions (``bucket.py``), how gradients go in and out
(``slot_io.py``, ``packing.py``), and what a comm hook sees
(``grad_bucket.py``).

The names ``gradring.buckets`` exported as one module are re-exported here.
"""

from gradring.buckets.assign import (
    DEFAULT_BUCKET_CAP_MB,
    DEFAULT_FIRST_BUCKET_BYTES,
    MIB,
    BucketCaps,
    assign_buckets,
    bucket_key,
)
from gradring.buckets.bucket import Bucket, BucketState, SlotKind

__all__ = [
    "DEFAULT_BUCKET_CAP_MB", "DEFAULT_FIRST_BUCKET_BYTES",
    "MIB", "Bucket", "BucketCaps", "BucketState", "SlotKind",
    "assign_buckets", "bucket_key",
]
