"""Make code that names torch's DDP construct gradring's.

Libraries such as Accelerate (and transformers' ``Trainer`` through it) build
the wrapper themselves with ``torch.nn.parallel.DistributedDataParallel(model,
...)``, looking the name up when they wrap. ``install()`` points that name, in
both places torch publishes it, at ``gradring.DistributedDataParallel``;
``uninstall()`` puts back what was there before.

gradring's class is a subclass of torch's, so an ``isinstance`` check against
torch's class object (including one a module grabbed with ``from ... import``
before ``install()``) holds for gradring's wrappers. gradring keeps its own
reference to torch's class (taken when ``gradring.ddp`` is imported) and never
looks torch's name up again, so the replaced name cannot send it back into
itself.
"""

from __future__ import annotations

import threading
from types import TracebackType
from typing import Any

import torch.nn.parallel
import torch.nn.parallel.distributed

__all__ = ["install", "installed", "uninstall"]

#: Where torch publishes the class: the package namespace (``torch.nn.parallel``,
#: re-exported by its ``__init__``) and the defining module.
_HOMES = (torch.nn.parallel, torch.nn.parallel.distributed)
_NAME = "DistributedDataParallel"

#: torch's own class, as this module found it.
_TORCH_DDP: type = torch.nn.parallel.distributed.DistributedDataParallel

_lock = threading.Lock()
#: What each home held before ``install()``; empty while not installed.
_saved: dict[str, Any] = {}


class _Installation:
    """Returned by :func:`install`; as a context manager it restores the previous state."""

    def __init__(self, was_installed: bool) -> None:
        self._was_installed = was_installed

    def __enter__(self) -> _Installation:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if not self._was_installed:
            uninstall()


def _gradring_class() -> type:
    from gradring.ddp import DistributedDataParallel

    return DistributedDataParallel


def installed() -> bool:
    """Whether ``torch.nn.parallel.DistributedDataParallel`` currently constructs gradring's."""
    cls = _gradring_class()
    return all(getattr(home, _NAME) is cls for home in _HOMES)


def install() -> _Installation:
    """Point ``torch.nn.parallel.DistributedDataParallel`` and
    ``torch.nn.parallel.distributed.DistributedDataParallel`` at gradring's class.

    Calling it again while installed changes nothing. Code that already holds
    torch's class object (``from torch.nn.parallel import
    DistributedDataParallel`` before this call) keeps constructing torch's
    wrapper; its ``isinstance`` checks still accept gradring's.

    The return value may be used as ``with gradring.install(): ...``, which
    uninstalls on exit unless gradring was already installed before.
    """
    cls = _gradring_class()
    with _lock:
        was = bool(_saved)
        if not was:
            for home in _HOMES:
                current = getattr(home, _NAME)
                if current is cls:  # assigned by hand, not by install(): restore torch's
                    current = _TORCH_DDP
                _saved[home.__name__] = current
            for home in _HOMES:
                setattr(home, _NAME, cls)
        return _Installation(was)


def uninstall() -> None:
    """Put back what ``install()`` replaced. Does nothing when not installed.

    Wrappers that were constructed while installed stay gradring's.
    """
    cls = _gradring_class()
    with _lock:
        if not _saved:
            return
        for home in _HOMES:
            if getattr(home, _NAME) is not cls:
                raise RuntimeError(
                    f"{home.__name__}.{_NAME} was replaced by {getattr(home, _NAME)!r} after "
                    "gradring.install(); undo that replacement before gradring.uninstall()")
        for home in _HOMES:
            setattr(home, _NAME, _saved[home.__name__])
        _saved.clear()
