"""torch 2.1's delayed all-reduce of ``delay_all_reduce_named_params``.

[Note: the delayed all-reduce]
The named parameters stay out of the reducer (their names join
``parameters_to_ignore``, as in torch). Their gradients live in one flat
buffer: before each backward (at the end of every forward, synchronised or
not) a delayed parameter whose ``.grad`` is None gets its view of the buffer
as ``.grad``, so autograd accumulates into the buffer. When the gradient of
``param_to_hook_all_reduce`` is computed (a tensor hook on it, which runs
before that gradient is accumulated), the whole buffer is divided by the
world size and summed over the group: the average, in torch's order of
operations, so the bits are torch's. As in torch this happens in every
backward, under ``no_sync()`` too, and neither the comm hook, nor
``find_unused_parameters``, nor ``static_graph`` touches these parameters.

Unlike torch, which leaves the all-reduce's work unwaited (on gloo the sum
lands in ``.grad`` whenever the background thread finishes), gradring waits
for it when the backward ends: the averaged gradients are in ``.grad`` when
``loss.backward()`` returns (docs/ddp-differences.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from gradring import errors
from gradring.group_comm import GroupComm
from gradring.reducer.engine_callback import queue_engine_callback

__all__ = ["DelayedAllReduce", "check_given_together"]


def check_given_together(named_params: Any, hook_param: Any) -> str | None:
    """The error text when only one of the two arguments is given, else None."""
    if (named_params is None) != (hook_param is None):
        return errors.delay_all_reduce_half_given()
    return None


class DelayedAllReduce:
    """The delayed parameters' gradient buffer and the all-reduce that averages it."""

    def __init__(self, params: Iterable[torch.Tensor], comm: GroupComm,
                 device: torch.device) -> None:
        # The delayed parameters, in the order given.
        self.params: list[torch.Tensor] = list(params)
        # Collectives over the DDP process group.
        self._comm = comm
        # One flat buffer (torch's default dtype, as torch makes it) and each
        # parameter's view of it, shaped like the parameter.
        self.buffer = torch.zeros(sum(p.numel() for p in self.params), device=device)
        self.views: list[torch.Tensor] = []
        offset = 0
        for p in self.params:
            self.views.append(self.buffer[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
        # The all-reduce launched in this backward, waited for when it ends.
        self._future: torch.futures.Future | None = None
        # The handle of the tensor hook on param_to_hook_all_reduce.
        self._handle: Any = None

    def broadcast_params(self) -> None:
        """Rank 0's values of the delayed parameters on every rank (at construction)."""
        self._comm.broadcast_coalesced([p.detach() for p in self.params], src=0)

    def hook_onto(self, param: torch.Tensor) -> None:
        """Launch the all-reduce when ``param``'s gradient is computed."""
        self._handle = param.register_hook(self.on_hooked_grad)

    def on_hooked_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """The hook: average the buffer over the group; ``grad`` passes unchanged."""
        self.launch()
        return grad

    def launch(self) -> None:
        """Divide the buffer by the world size and sum it over the group, in place."""
        self.wait()  # a launch not yet waited for (a hook fired twice in a backward)
        with torch.no_grad():
            self.buffer.div_(self._comm.world_size)
        self._future = self._comm.all_reduce(self.buffer, label="DDP delayed all-reduce")
        queue_engine_callback(self.wait)

    def wait(self) -> None:
        """Wait for the launched all-reduce, if any (at the end of the backward)."""
        future, self._future = self._future, None
        if future is not None:
            future.wait()

    def clear_grads(self) -> None:
        """Before a backward: each delayed parameter whose ``.grad`` is None gets
        its (zeroed) view of the buffer as ``.grad``."""
        self.wait()
        missing = [p.grad is None for p in self.params]
        with torch.no_grad():
            if all(missing):
                self.buffer.zero_()
            for p, view, none in zip(self.params, self.views, missing):
                if none:
                    p.grad = view
                    if not all(missing):
                        view.zero_()

    def remove_hook(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
