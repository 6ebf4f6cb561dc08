"""gradring.install() and modules that copied torch's DDP class before it ran.

See [Note: captured names] in gradring/captures.py and [Note: torch's
constructor while installed] in gradring/install.py. Single process: nothing
here builds a working wrapper, so no process group is needed.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import py_compile
import sys
import textwrap
import warnings
from pathlib import Path
from types import ModuleType

import pytest
import torch

import gradring
from gradring.install import install, uninstall

#: torch's class, held where install() does not look (a global bound to it and
#: used as a default argument below would itself be rebound while installed).
_HELD = {"torch": torch.nn.parallel.distributed.DistributedDataParallel}

SOURCES = {
    # Calls the name.
    "constructs": """
        from torch.nn.parallel import DistributedDataParallel as DDP

        def wrap(model):
            return DDP(model)
    """,
    # Hands it on through a local alias, as Ray Train's prepare_model does.
    "aliases": """
        from torch.nn.parallel.distributed import DistributedDataParallel

        def wrap(model, kind="ddp"):
            Wrapper = DistributedDataParallel if kind == "ddp" else None
            return Wrapper(model)
    """,
    # Only checks with it: isinstance, a comparison, an attribute, annotations.
    "checks": """
        from torch.nn.parallel import DistributedDataParallel

        def unwrap(model: DistributedDataParallel) -> object:
            if isinstance(model, (DistributedDataParallel, int)):
                return model.module
            if type(model) is DistributedDataParallel:
                return None
            return DistributedDataParallel.__name__
    """,
}


def torch_ddp() -> type:
    return _HELD["torch"]


def _load(tmp_path: Path, stem: str, source: str, sourceless: bool = False) -> ModuleType:
    name = f"gradring_captures_{stem}_{tmp_path.name}"
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    if sourceless:
        pyc = tmp_path / f"{name}.pyc"
        py_compile.compile(str(path), cfile=str(pyc), doraise=True)
        path.unlink()
        loader = importlib.machinery.SourcelessFileLoader(name, str(pyc))
        spec = importlib.util.spec_from_loader(name, loader)
    else:
        spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def modules(tmp_path: Path):  # noqa: ANN201
    loaded = {stem: _load(tmp_path, stem, src) for stem, src in SOURCES.items()}
    loaded["sourceless"] = _load(tmp_path, "sourceless", SOURCES["constructs"], sourceless=True)
    yield loaded
    uninstall()
    for module in loaded.values():
        sys.modules.pop(module.__name__, None)


def test_constructing_modules_are_rebound_and_restored(modules) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with install():
            assert modules["constructs"].DDP is gradring.DistributedDataParallel
            assert modules["aliases"].DistributedDataParallel is gradring.DistributedDataParallel
            # isinstance-only: left alone (gradring's class subclasses torch's).
            assert modules["checks"].DistributedDataParallel is torch_ddp()
    assert modules["constructs"].DDP is torch_ddp()
    assert modules["aliases"].DistributedDataParallel is torch_ddp()
    # None of the readable modules was warned about.
    named = [str(w.message) for w in caught if "gradring.install()" in str(w.message)]
    for stem in ("constructs", "aliases", "checks"):
        assert not any(modules[stem].__name__ in m for m in named), named


def test_unreadable_module_warns_once_naming_it(modules) -> None:
    sourceless = modules["sourceless"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with install():
            pass
        with install():
            pass
    mine = [str(w.message) for w in caught if sourceless.__name__ in str(w.message)]
    assert len(mine) == 1, mine
    assert "source cannot be read" in mine[0]
    assert "before importing it" in mine[0] and "gradring.ray" in mine[0]
    assert sourceless.DDP is torch_ddp()  # not knowing, it is left as it was


def test_module_that_refuses_rebinding_warns(tmp_path: Path) -> None:
    class Frozen(ModuleType):
        def __setattr__(self, name: str, value: object) -> None:
            raise AttributeError(f"{name} is read-only")

    module = _load(tmp_path, "frozen", SOURCES["constructs"])
    module.__class__ = Frozen
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with install():
                assert module.DDP is torch_ddp()
        mine = [str(w.message) for w in caught if module.__name__ in str(w.message)]
        assert len(mine) == 1 and "could not be rebound" in mine[0], mine
    finally:
        sys.modules.pop(module.__name__, None)


def _closure_over_torch_class():  # noqa: ANN202
    cls = _HELD["torch"]
    return lambda model: cls(model)


def test_torch_constructor_warns_while_installed_naming_the_caller() -> None:
    build = _closure_over_torch_class()
    init_before = torch_ddp().__init__
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with install():
            assert torch_ddp().__init__ is not init_before
            for _ in range(2):
                # No process group here: torch's constructor fails after the warning.
                with pytest.raises((RuntimeError, ValueError)):
                    build(torch.nn.Linear(2, 2))
    assert torch_ddp().__init__ is init_before
    mine = [w for w in caught if "constructs torch's" in str(w.message)]
    assert len(mine) == 1, [str(w.message) for w in caught]
    assert __name__ in str(mine[0].message)
    assert mine[0].filename == __file__  # points at the lambda above, the caller
    # Not installed: no warning.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises((RuntimeError, ValueError)):
            build(torch.nn.Linear(2, 2))
    assert not [w for w in caught if "constructs torch's" in str(w.message)]


@pytest.mark.parametrize("modname", ["lightning.fabric.strategies.ddp",
                                     "lightning.pytorch.strategies.ddp",
                                     "ray.train.torch.train_loop_utils"])
def test_real_framework_modules_are_rebound(modname: str) -> None:
    module = pytest.importorskip(modname)
    assert module.DistributedDataParallel is torch_ddp()
    with install():
        assert module.DistributedDataParallel is gradring.DistributedDataParallel
    assert module.DistributedDataParallel is torch_ddp()


def test_lightning_isinstance_only_module_is_left_alone() -> None:
    module = pytest.importorskip("lightning.pytorch.overrides.distributed")
    with install():
        assert module.DistributedDataParallel is torch_ddp()
