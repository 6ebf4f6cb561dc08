"""Communication hooks for gradring's DistributedDataParallel.

A hook is ``hook(state, bucket) -> torch.futures.Future[torch.Tensor]``; register
one with ``ddp.register_comm_hook(state, hook)``. Every hook here talks to the
other ranks through ``gradring.comm`` and records its traffic in
``comm_stats()``. See docs/hooks.md.
"""

from gradring.hooks.default import (
    allreduce_hook,
    bf16_compress_hook,
    bf16_compress_wrapper,
    fp16_compress_hook,
    fp16_compress_wrapper,
)
from gradring.hooks.powersgd import PowerSGDState, batched_powerSGD_hook, powerSGD_hook
from gradring.hooks.quantization import quantization_perchannel_hook, quantization_pertensor_hook
from gradring.hooks.stats import CommStats, HookTraffic, comm_stats

__all__ = [
    # reference and 16-bit
    "allreduce_hook", "fp16_compress_hook", "bf16_compress_hook",
    "fp16_compress_wrapper", "bf16_compress_wrapper",
    # low rank
    "PowerSGDState", "powerSGD_hook", "batched_powerSGD_hook",
    # 8-bit
    "quantization_pertensor_hook", "quantization_perchannel_hook",
    # traffic accounting
    "CommStats", "HookTraffic", "comm_stats",
]
