"""A CPU shim for torch's DDP tests that ask for GPUs only to place tensors.

Used by scripts/torch_ddp_tests.py (``--cpu-shim``, the default), applied the same way
under torch's DDP and gradring's so that the reference still is the reference.

[Note: the CPU shim]
Many of torch's DDP tests are gated on ``skip_if_lt_x_gpu(2)`` but use the GPU only as a
place: ``.cuda(rank)``, ``torch.ones(..., device=rank)``, ``torch.cuda.set_device(rank)``,
``DDP(model, device_ids=[rank])``. The shim lets those run on CPU:

* torch's test modules (``distributed_test``, ``common_distributed``) see a ``torch``
  whose ``cuda`` is a small fake: ``is_available()`` is true, ``device_count()`` is the
  world size, ``set_device``/``synchronize`` do nothing. Only those two modules' global
  name ``torch`` is rebound, so torch itself and the DDP under test still see the real
  ``torch.cuda`` (CPU-only, not available). Anything else asked of the fake raises
  ``AttributeError("cpu shim: torch.cuda.X is not faked")``: such a test really needs a GPU.
  ``common_distributed.TEST_CUDA`` is set too, since ``skip_if_no_gpu`` reads it.
* a ``TorchFunctionMode`` in each rank turns every CUDA device argument (``device=``,
  ``.cuda(...)``, ``.to(...)``; an int, ``"cuda[:N]"`` or ``torch.device("cuda", N)``)
  into the CPU, so ``.cuda()`` on a CPU tensor returns the tensor itself, as ``.to()`` does
  for a tensor already in place.
* the DDP class the tests construct drops ``device_ids``/``output_device`` when the
  module's parameters are all on the CPU (torch's DDP rejects them there).

Tests that check where tensors ended up, use CUDA streams, CUDA amp or memory stats
still fail, under both implementations; scripts/torch_ddp_tests.txt lists them.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["CpuDeviceMode", "cpu_placed_ddp", "fake_torch_for_tests"]

_CPU = torch.device("cpu")


def _is_cuda_place(value: object) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    if isinstance(value, str):
        return value.startswith("cuda")
    return isinstance(value, torch.device) and value.type == "cuda"


class CpuDeviceMode(TorchFunctionMode):
    """Sends every CUDA device argument of a torch call to the CPU; see [Note: the CPU shim]."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if _is_cuda_place(kwargs.get("device")):
            kwargs["device"] = _CPU
        if func is torch.Tensor.cuda:
            return args[0]
        if func in _PLACING:
            args = tuple(_CPU if _is_cuda_place(a) else a for a in args)
        return func(*args, **kwargs)


#: The calls that take a device positionally (``t.to(rank)``, ``module.to(rank)``'s parse).
_PLACING = (torch.Tensor.to, torch._C._nn._parse_to)


class _FakeCuda(types.ModuleType):
    """What torch's test modules see as ``torch.cuda`` under the shim."""

    def __init__(self, device_count: int) -> None:
        super().__init__("torch.cuda")
        self._device_count = device_count  # as many "GPUs" as ranks, so rank i has "GPU i"

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return self._device_count

    def current_device(self) -> int:
        return 0

    def set_device(self, device: object) -> None:
        """Nothing to select: every rank's "GPU" is the CPU."""

    def synchronize(self, device: object = None) -> None:
        """CPU work is already done when the call returns."""

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"cpu shim: torch.cuda.{name} is not faked (the test needs a GPU)")


class _TorchForTests(types.ModuleType):
    """``torch`` as torch's test modules see it under the shim: real except for ``cuda``."""

    def __init__(self, device_count: int) -> None:
        super().__init__("torch")
        self.cuda = _FakeCuda(device_count)  # the only attribute that differs from torch's

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def fake_torch_for_tests(device_count: int) -> types.ModuleType:
    """A stand-in for the name ``torch`` in torch's test modules; see [Note: the CPU shim]."""
    return _TorchForTests(device_count)


def cpu_placed_ddp(ddp_class: type) -> type:
    """A subclass of ``ddp_class`` that ignores ``device_ids``/``output_device`` for a module
    whose parameters are all on the CPU; see [Note: the CPU shim]."""

    def __init__(self: Any, module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        if all(p.device.type == "cpu" for p in module.parameters()):
            if args:  # device_ids and output_device are the 2nd and 3rd positional ones
                args = (None, None, *args[2:])
            kwargs.pop("device_ids", None)
            kwargs.pop("output_device", None)
        ddp_class.__init__(self, module, *args, **kwargs)

    # Named like the class it stands in for, and findable under that name in this module,
    # so that pickling a wrapper (some tests do) finds the class it was built from.
    shimmed = type(ddp_class.__name__, (ddp_class,),
                   {"__init__": __init__, "__module__": __name__,
                    "__qualname__": ddp_class.__name__})
    globals()[ddp_class.__name__] = shimmed
    return shimmed
