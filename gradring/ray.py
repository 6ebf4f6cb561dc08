"""Ray Train: gradring's DDP inside ``ray.train.torch.TorchTrainer`` workers.

``ray.train.torch.prepare_model`` wraps in the DDP class that Ray's module
took when it was imported. ``gradring.install()`` called inside the
training function still reaches it because ``install()`` rebinds Ray's copy
(see [Note: captured names] in ``captures.py``). Two routes that do not
depend on that:

- in the training function, ``gradring.ray.prepare_model(model)`` instead of
  ``ray.train.torch.prepare_model(model)``: Ray moves the model to the
  worker's device, gradring wraps it (keyword arguments go to the DDP
  constructor, as Ray's ``parallel_strategy_kwargs`` do);
- for a script left as it is, install gradring in every worker process
  before Ray's module is imported there::

      ray.init(runtime_env=gradring.ray.runtime_env())
      # that is: runtime_env={"worker_process_setup_hook": "gradring.ray.setup_hook"}

Ray Train sets up torch.distributed among the workers (gloo on CPU) before
the training function runs; gradring averages over that process group, with
its shared-memory collectives among the workers of one host.
"""

from __future__ import annotations

from typing import Any

import ray.train
import ray.train.torch
import torch
from torch import nn

from gradring.ddp import DistributedDataParallel
from gradring.install import install

__all__ = ["SETUP_HOOK", "prepare_model", "runtime_env", "setup_hook"]

#: The import path Ray's ``worker_process_setup_hook`` takes, for a runtime_env in YAML/JSON.
SETUP_HOOK = "gradring.ray.setup_hook"


def prepare_model(model: nn.Module, move_to_device: bool | torch.device = True,
                  **ddp_kwargs: Any) -> nn.Module:
    """``ray.train.torch.prepare_model(model)`` with gradring's DDP as the wrapper.

    Ray moves the model to the worker's device; with more than one worker the
    model is wrapped in ``gradring.DistributedDataParallel(model, **ddp_kwargs)``
    (on a GPU, ``device_ids`` and ``output_device`` default to the worker's
    device, as Ray does). With one worker the model comes back unwrapped, as
    from Ray.
    """
    model = ray.train.torch.prepare_model(model, move_to_device=move_to_device,
                                          parallel_strategy=None)
    if ray.train.get_context().get_world_size() <= 1:
        return model
    device = move_to_device if isinstance(move_to_device, torch.device) \
        else ray.train.torch.get_device()
    if device.type != "cpu":
        ddp_kwargs = {"device_ids": [device], "output_device": device, **ddp_kwargs}
    return DistributedDataParallel(model, **ddp_kwargs)


def setup_hook() -> None:
    """Ray's ``worker_process_setup_hook``: ``gradring.install()`` as the worker starts."""
    install()


def runtime_env(base: dict[str, Any] | None = None) -> dict[str, Any]:
    """``base`` (a Ray runtime_env dict) with gradring's worker setup hook added."""
    env = dict(base or {})
    if env.get("worker_process_setup_hook") not in (None, SETUP_HOOK):
        raise ValueError("runtime_env already has a worker_process_setup_hook "
                         f"({env['worker_process_setup_hook']!r}); call gradring.install() from it")
    env["worker_process_setup_hook"] = SETUP_HOOK
    return env
