"""The line gradring's wrapper logs at its first forward, so a user can see which DDP they got.

[Note: which DDP did I get]
A framework may build torch's wrapper or gradring's depending on when its
module took the class (see [Note: captured names] in ``captures.py``). So
gradring's wrapper says so once, at its first forward, on rank 0 of its
process group, at INFO through ``logging.getLogger("gradring")``::

    gradring DDP wraps Net: 6 parameters, 1,348 elements, 2 ranks (gloo)

A torch wrapper built while gradring is installed warns instead (see [Note:
torch's constructor while installed] in ``install.py``). The call is made once
per wrapper, outside the per-step path.
"""

from __future__ import annotations

import logging

import torch.distributed as dist
from torch import nn

__all__ = ["announce_first_forward", "logger"]

#: gradring's logger; the line is INFO, so it shows with ``logging.basicConfig(level="INFO")``.
logger = logging.getLogger("gradring")


def announce_first_forward(ddp: nn.Module) -> None:
    """Log the one line of the Note for ``ddp`` (a gradring wrapper), on its group's rank 0."""
    group = getattr(ddp, "process_group", None)
    if dist.is_available() and dist.is_initialized() and dist.get_rank(group) != 0:
        return
    if not logger.isEnabledFor(logging.INFO):
        return
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    backend = dist.get_backend(group) if dist.is_initialized() else "no process group"
    module = getattr(ddp, "module", ddp)
    params = [p for p in module.parameters() if p.requires_grad]
    logger.info("gradring DDP wraps %s: %d parameters, %s elements, %d ranks (%s)",
                type(module).__name__, len(params),
                f"{sum(p.numel() for p in params):,}", world, backend)
