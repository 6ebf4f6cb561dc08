"""torch.compile and gradring's DDP.

``split.py``: compiled graphs split at gradring's buckets ([Note: compile and
the buckets]); ``never_traced.py``: what Dynamo never traces ([Note: never
traced]). The public names of both are re-exported here, so
``gradring.compile.splits`` (and the others) keep working.
"""

from gradring.compile.never_traced import NEVER_TRACED, never_traced
from gradring.compile.split import (
    SPLIT_BY,
    BucketSplit,
    Split,
    after_rebuild,
    install,
    splits,
)

__all__ = ["NEVER_TRACED", "SPLIT_BY", "BucketSplit", "Split", "after_rebuild", "install",
           "never_traced", "splits"]
