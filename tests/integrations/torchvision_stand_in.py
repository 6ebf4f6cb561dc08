"""Import timm on a machine whose torchvision is missing or cannot load.

[Note: timm without torchvision]
timm imports torchvision when it is imported (``torchvision.ops.misc``,
``torchvision.transforms``, ``torchvision.datasets``), but building and running
a model never calls into it. torchvision's PyPI wheels for Linux are CUDA
builds: next to the CPU torch this project installs they fail at import
("operator torchvision::nms does not exist"), and installed, they also break
``import lightning`` and ``import torchmetrics``. The CPU wheels are only on
PyTorch's own index. So timm is installed without its dependencies
(``pip install --no-deps timm``; its other requirements come with
transformers), and the ranks that run timm models put a stand-in for
torchvision in front of the import system: every ``torchvision.*`` module
imports as an empty package whose every attribute is a fresh class.

Only ranks of the timm tests' own pool load it, never the pytest process,
so no other test ever sees the stand-in.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any


class _AnyClass(type):
    """Metaclass of the stand-in classes: every attribute is another stand-in class."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _AnyClass(name, (), {})


class _AnyModule(types.ModuleType):
    """A stand-in module: every attribute is a stand-in class."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _AnyClass(name, (), {})


class TorchvisionStandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds and loads every ``torchvision`` module as an :class:`_AnyModule`."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _AnyModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def import_timm() -> types.ModuleType:
    """``import timm``, with the stand-in for torchvision if the real one does not import."""
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - missing, or a build for another torch
        for name in [n for n in sys.modules if n.split(".")[0] == "torchvision"]:
            del sys.modules[name]
        if not any(isinstance(f, TorchvisionStandIn) for f in sys.meta_path):
            sys.meta_path.insert(0, TorchvisionStandIn())
    import timm

    return timm
