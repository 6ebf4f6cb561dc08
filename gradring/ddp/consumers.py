"""Who takes a DDP's buckets once they are ready: one consumer at a time.

[Note: one consumer]
A bucket's gradients can be handed to one of three consumers:

- a communication hook (``register_comm_hook``, ``_register_builtin_comm_hook``),
  which replaces the bucket's all-reduce;
- a fused optimizer (``_register_fused_optim``), which steps the bucket's
  parameters as soon as its reduced gradients are written (see [Note: fused
  optimizer] in ``gradring/fused_optim.py``);
- optimizers applied in backward (torch's ``_apply_optimizer_in_backward``),
  set up at the first forward, which do the same per parameter and then set
  ``.grad`` to None.

torch's DDP builds the last two from comm hooks, so a DDP takes one of the
three, once: a second registration of any kind raises. :class:`ConsumerSlot`
is where that rule is checked and what is registered is recorded; it then
tells the reducer through ``set_comm_hook`` or ``set_post_reduce``, and the
reducer runs what it was given without checking the rule again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from gradring import errors
from gradring.announce import notice
from gradring.fused_optim import FusedOptimizer, attach_fused_optimizer
from gradring.reducer import CommHook, Reducer

#: The kinds of consumer, as recorded in the slot.
COMM_HOOK = "comm hook"
FUSED_OPTIM = "fused optimizer"
IN_BACKWARD = "in-backward optimizers"

#: (consumer already there, consumer asked for) -> the error's message.
_CONFLICTS = {
    (COMM_HOOK, COMM_HOOK): errors.comm_hook_twice,
    (FUSED_OPTIM, COMM_HOOK): errors.comm_hook_with_fused_optim,
    (IN_BACKWARD, COMM_HOOK): errors.in_backward_optim_with_hook,
    (FUSED_OPTIM, FUSED_OPTIM): errors.fused_optim_twice,
    (COMM_HOOK, FUSED_OPTIM): errors.fused_optim_with_comm_hook,
    (IN_BACKWARD, FUSED_OPTIM): errors.in_backward_optim_with_hook,
    (COMM_HOOK, IN_BACKWARD): errors.in_backward_optim_with_hook,
    (FUSED_OPTIM, IN_BACKWARD): errors.in_backward_optim_with_hook,
}


class ConsumerSlot:
    """The one consumer of a reducer's buckets ([Note: one consumer])."""

    def __init__(self, reducer: Reducer,
                 fail: Callable[[type[BaseException], str], None]) -> None:
        # The reducer told what to run (set_comm_hook / set_post_reduce).
        self._reducer = reducer
        # How a refusal is raised: the DDP's _log_and_throw, which records it first.
        self._fail = fail
        # Which consumer took the slot (COMM_HOOK, FUSED_OPTIM, IN_BACKWARD), if any.
        self.kind: str | None = None
        # The fused optimizer, when that is the consumer (ddp._fused_optim).
        self.fused_optim: FusedOptimizer | None = None
        # Whether the torch-PowerSGD-on-gloo warning was given (once per DDP).
        self._warned_unordered_hook = False

    def _check_free(self, kind: str) -> None:
        """Raise, naming both, if another consumer (or this one) took the slot."""
        if self.kind is not None:
            self._fail(RuntimeError, _CONFLICTS[(self.kind, kind)]())

    def set_comm_hook(self, hook: CommHook, state: object) -> None:
        """Replace the bucket all-reduce by ``hook(state, bucket) -> Future[Tensor]``."""
        self._check_free(COMM_HOOK)
        self.kind = COMM_HOOK
        self._reducer.set_comm_hook(hook, state)

    def set_fused_optim(self, optim_cls: type, *args: Any, **kwargs: Any) -> FusedOptimizer:
        """Step each parameter as soon as its bucket is reduced; returns the fused optimizer."""
        self._check_free(FUSED_OPTIM)
        # Built before the slot is taken: a bad optimizer class or argument leaves it free.
        self.fused_optim = attach_fused_optimizer(self._reducer, optim_cls, *args, **kwargs)
        self.kind = FUSED_OPTIM
        return self.fused_optim

    def set_in_backward(self, params: list[Any]) -> None:
        """Step the optimizers torch's ``_apply_optimizer_in_backward`` put on
        ``params`` as soon as their bucket is reduced, then set their ``.grad``
        to None, as torch's DDP does."""
        from torch.distributed.optim import apply_optimizer_in_backward as aob

        for p in params:
            for handle in aob.param_to_optim_hook_handle_map.get(p, []):
                handle.remove()
        self._check_free(IN_BACKWARD)
        self.kind = IN_BACKWARD

        def step_bucket(bucket: Any) -> None:
            for p in bucket.params:
                optims = getattr(p, "_in_backward_optimizers", None)
                if optims and p.grad is not None:
                    for opt in optims:
                        opt.step()
                    p.grad = None
        self._reducer.set_post_reduce(step_bucket)

    def warn_unordered_hook(self, process_group: Any) -> None:
        """Once, when torch's PowerSGD hook meets several buckets on gloo (see
        docs/hooks.md); checked at registration and after the bucket rebuild."""
        hook = self._reducer.comm_hook
        if hook is None or self._warned_unordered_hook or not _unordered_torch_hook(hook) \
                or len(self._reducer.buckets) < 2 \
                or dist.get_backend(process_group) != "gloo":
            return
        self._warned_unordered_hook = True
        notice(errors.torch_power_sgd_on_gloo(hook.__name__))  # gradring's own advice


def _unordered_torch_hook(hook: Any) -> bool:
    """Torch's PowerSGD hooks, which issue a second all-reduce from inside the
    first one's callback and wait for it there (see docs/hooks.md)."""
    return (getattr(hook, "__module__", "")
            == "torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook"
            and getattr(hook, "__name__", "") in ("powerSGD_hook", "batched_powerSGD_hook"))
