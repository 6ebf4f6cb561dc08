"""PyTorch Lightning: strategies that wrap in gradring's DDP, for the Trainer and for Fabric.

``DDPStrategy`` is for ``lightning.pytorch.Trainer``; ``FabricDDPStrategy`` is
for ``lightning.fabric.Fabric``. ``import gradring.lightning`` registers the
names ``"gradring"``, ``"gradring_find_unused_parameters_true"`` and
``"gradring_find_unused_parameters_false"`` in both registries (they are
separate), so ``strategy="gradring"`` works with either.

For the Trainer, use either form::

    from gradring.lightning import DDPStrategy
    trainer = Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(static_graph=True))

    import gradring.lightning  # registers the names below
    trainer = Trainer(accelerator="cpu", devices=2, strategy="gradring")

The class is a subclass of Lightning's own ``DDPStrategy`` and takes exactly its
arguments (the extra keyword arguments go to the DDP constructor, as there).
Three things differ from Lightning's strategy:

- the wrapper is ``gradring.DistributedDataParallel``;
- ``ddp_comm_hook`` / ``ddp_comm_state`` / ``ddp_comm_wrapper`` are registered on
  every device, CPU included (Lightning registers them on CUDA only, because
  torch's hooks needed NCCL once; gradring's run on CPU);
- ``teardown`` removes gradring's autograd hooks from the parameters and leaves
  ``strategy.model`` as the plain LightningModule.

Everything else (manual optimization, ``no_sync`` for gradient accumulation,
the first static-graph iteration, checkpointing) is Lightning's code, which
treats gradring's wrapper as torch's since gradring's class subclasses it.

For Fabric::

    import gradring.lightning
    fabric = Fabric(accelerator="cpu", devices=2, strategy="gradring")
    # or: strategy=gradring.lightning.FabricDDPStrategy(static_graph=True)

``FabricDDPStrategy`` is Fabric's own ``DDPStrategy`` (same arguments, extra
keyword arguments go to the DDP constructor) with gradring's wrapper;
``fabric.no_backward_sync``, ``fabric.save``/``fabric.load`` and the precision
plugins are Fabric's code. Fabric builds torch's wrapper from a class object
it took when imported, which is why a strategy is needed (``gradring.install()``
also rebinds it, see [Note: captured names] in ``captures.py``).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from lightning.fabric.strategies import STRATEGY_REGISTRY as _FABRIC_REGISTRY
from lightning.fabric.strategies import DDPStrategy as _FabricDDPStrategy
from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook
from lightning.pytorch.strategies import DDPStrategy as _LightningDDPStrategy
from lightning.pytorch.strategies import StrategyRegistry
from torch.nn import Module

from gradring.ddp import DistributedDataParallel

__all__ = ["DDPStrategy", "FabricDDPStrategy"]


class DDPStrategy(_LightningDDPStrategy):
    """Lightning's ``DDPStrategy`` with ``gradring.DistributedDataParallel`` as the wrapper."""

    strategy_name = "gradring"

    def _setup_model(self, model: Module) -> DistributedDataParallel:
        device_ids = self.determine_ddp_device_ids()
        # As Lightning does: construct on a side stream when on CUDA.
        ctx = torch.cuda.stream(torch.cuda.Stream()) if device_ids is not None else nullcontext()
        with ctx:
            return DistributedDataParallel(module=model, device_ids=device_ids, **self._ddp_kwargs)

    def _register_ddp_hooks(self) -> None:
        if not isinstance(self.model, DistributedDataParallel):
            raise TypeError(f"{type(self).__name__} expected the model to be wrapped in "
                            f"gradring.DistributedDataParallel, found {type(self.model).__name__}")
        _register_ddp_comm_hook(
            model=self.model,
            ddp_comm_state=self._ddp_comm_state,
            ddp_comm_hook=self._ddp_comm_hook,
            ddp_comm_wrapper=self._ddp_comm_wrapper,
        )

    def teardown(self) -> None:
        wrapper = self.model
        if isinstance(wrapper, DistributedDataParallel):
            _detach_from_parameters(wrapper)
            # Lightning's teardown unwraps torch's DDP; doing it here first also
            # covers a gradring built without the torch base class.
            self.model = self.lightning_module
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        _register_names(cls, strategy_registry)


class FabricDDPStrategy(_FabricDDPStrategy):
    """Fabric's ``DDPStrategy`` with ``gradring.DistributedDataParallel`` as the wrapper."""

    def setup_module(self, module: Module) -> DistributedDataParallel:
        device_ids = self._determine_ddp_device_ids()
        # As Fabric does: construct on a side stream when on CUDA.
        ctx = torch.cuda.stream(torch.cuda.Stream()) if device_ids is not None else nullcontext()
        with ctx:
            return DistributedDataParallel(module=module, device_ids=device_ids, **self._ddp_kwargs)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        _register_names(cls, strategy_registry)


def _register_names(cls: type, strategy_registry: Any) -> None:
    """gradring's counterparts of Lightning's ``"ddp"`` names, in either registry."""
    for name, fup in (("gradring", None), ("gradring_find_unused_parameters_true", True),
                      ("gradring_find_unused_parameters_false", False)):
        params = {} if fup is None else {"find_unused_parameters": fup}
        what = "" if fup is None else f" and find_unused_parameters={fup}"
        strategy_registry.register(
            name, cls, description=f"gradring's DistributedDataParallel{what}",
            override=True, **params)


def _detach_from_parameters(wrapper: DistributedDataParallel) -> None:
    """Drop the wrapper's autograd hooks so a later backward on the plain module is local."""
    remove = getattr(wrapper, "_remove_autograd_hooks", None)
    if remove is not None:
        remove()
    elif getattr(wrapper, "reducer", None) is not None:
        wrapper.reducer.remove_hooks()


DDPStrategy.register_strategies(StrategyRegistry)
FabricDDPStrategy.register_strategies(_FABRIC_REGISTRY)
