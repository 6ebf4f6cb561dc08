"""Make code that names torch's DDP construct gradring's.

Libraries such as Accelerate (and transformers' ``Trainer`` through it) build
the wrapper themselves with ``torch.nn.parallel.DistributedDataParallel(model,
...)``, looking the name up when they wrap. ``install()`` points that name, in
both places torch publishes it, at ``gradring.DistributedDataParallel``;
``uninstall()`` puts back what was there before.

Libraries that copied the class into their own globals when imported (Ray
Train, Lightning Fabric) are found and rebound too, or warned about: see
[Note: captured names] in ``captures.py``. A torch wrapper that is built all
the same while installed (from a class object held in a closure or a default
argument) warns once per calling module: see [Note: torch's constructor while
installed].

gradring's class is a subclass of torch's, so an ``isinstance`` check against
torch's class object (including one a module grabbed with ``from ... import``
before ``install()``) holds for gradring's wrappers. gradring keeps its own
reference to torch's class (taken when ``gradring.ddp`` is imported) and never
looks torch's name up again, so the replaced name cannot send it back into
itself.
"""

from __future__ import annotations

import functools
import sys
import threading
import warnings
from collections.abc import Callable
from types import ModuleType, TracebackType
from typing import Any

import torch.nn.parallel
import torch.nn.parallel.distributed

from gradring.announce import logger
from gradring.captures import find_captures, module_label

__all__ = ["install", "installed", "uninstall"]

#: Where torch publishes the class: the package namespace (``torch.nn.parallel``,
#: re-exported by its ``__init__``) and the defining module.
_HOMES = (torch.nn.parallel, torch.nn.parallel.distributed)
_NAME = "DistributedDataParallel"

#: torch's own class, as this module found it.
_TORCH_DDP: type = torch.nn.parallel.distributed.DistributedDataParallel
#: torch's constructor, put back by ``uninstall()``.
_TORCH_INIT: Callable[..., None] = _TORCH_DDP.__init__

_lock = threading.Lock()
#: What each home held before ``install()``; empty while not installed.
_saved: dict[str, Any] = {}
#: (module, global name) pairs that ``install()`` pointed at gradring's class.
_rebound: list[tuple[ModuleType, str]] = []
#: Modules install() already warned about, by name: once per process.
_warned_captures: set[str] = set()
#: Modules already warned about for constructing torch's class while installed, by name.
_warned_callers: set[str] = set()


class _Installation:
    """Returned by :func:`install`; as a context manager it restores the previous state."""

    def __init__(self, was_installed: bool) -> None:
        # Whether gradring was installed before this call: then leaving the block keeps it.
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
    """Make torch's DDP names construct ``gradring.DistributedDataParallel``.

    - ``torch.nn.parallel.DistributedDataParallel`` and
      ``torch.nn.parallel.distributed.DistributedDataParallel`` are pointed at
      gradring's class.
    - Every loaded module outside ``torch`` and ``gradring`` that holds torch's
      class in a global (``from torch.nn.parallel import
      DistributedDataParallel as DDP`` before this call) is looked at: where its
      source may construct with the name, the global is pointed at gradring's
      class; where it only checks with it (``isinstance``), it is left alone,
      since gradring's class subclasses torch's; where the source cannot be read
      or the global cannot be set, a warning names the module and the routes
      that work (call ``install()`` before importing it, or the framework's
      route: ``gradring.ray``, ``gradring.lightning``). See [Note: captured
      names] in ``captures.py``.
    - While installed, constructing torch's own class anyway (it was kept in a
      closure or a default argument) warns once per calling module.

    Calling it again while installed changes nothing (modules imported in
    between are not looked at again). The return value may be used as ``with
    gradring.install(): ...``, which uninstalls on exit unless gradring was
    already installed before.
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
            _rebind_captures(cls)
            _TORCH_DDP.__init__ = _warning_init  # type: ignore[method-assign]
        return _Installation(was)


def uninstall() -> None:
    """Put back what ``install()`` replaced. Does nothing when not installed.

    Module globals that ``install()`` rebound get torch's class back (where they
    still hold gradring's). Wrappers that were constructed while installed stay
    gradring's.
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
        for module, name in _rebound:
            if getattr(module, name, None) is cls:
                setattr(module, name, _TORCH_DDP)
        _rebound.clear()
        _TORCH_DDP.__init__ = _TORCH_INIT  # type: ignore[method-assign]


def _rebind_captures(cls: type) -> None:
    for capture in find_captures(_TORCH_DDP):
        if capture.verdict == "leave":
            continue
        if capture.verdict == "unreadable":
            _warn_once(capture.module, "its source cannot be read, so gradring cannot tell "
                       "whether it constructs torch's DDP with it")
            continue
        for name in capture.names:
            try:
                setattr(capture.module, name, cls)
                ok = getattr(capture.module, name, None) is cls
            except Exception:  # noqa: BLE001 - any refusal is reported the same way
                ok = False
            if not ok:
                _warn_once(capture.module, f"its global {name!r} could not be rebound")
                continue
            _rebound.append((capture.module, name))
            logger.debug("gradring.install(): %s.%s now constructs gradring's DDP",
                         capture.module.__name__, name)


def _warn_once(module: ModuleType, why: str) -> None:
    if module.__name__ in _warned_captures:
        return
    _warned_captures.add(module.__name__)
    warnings.warn(
        f"gradring.install(): module {module_label(module)} holds torch's "
        f"DistributedDataParallel class from before install(), and {why}; a wrapper it builds "
        "may be torch's. Call gradring.install() before importing it, or use the framework's "
        "route (gradring.ray.prepare_model / the gradring.ray setup hook, "
        "Fabric/Trainer strategy='gradring' after `import gradring.lightning`), or construct "
        "gradring.DistributedDataParallel yourself.", RuntimeWarning, stacklevel=4)


# [Note: torch's constructor while installed]
# While installed, torch's ``DistributedDataParallel.__init__`` is replaced by
# ``_warning_init``, which warns once per calling module and then runs torch's
# own constructor unchanged. Only code that held torch's class where
# install() cannot see it (a closure, a default argument, an attribute of an
# object) gets here; gradring's class never calls torch's constructor (see
# [Note: type identity] in ddp_surface.py). The caller is the first frame
# outside the chain of ``__init__`` calls on the new object (so a subclass's
# ``super().__init__`` names the code that built the subclass).
@functools.wraps(_TORCH_INIT)
def _warning_init(self: Any, *args: Any, **kwargs: Any) -> None:
    frame = sys._getframe(1)
    depth = 2
    while frame.f_back is not None and frame.f_code.co_name == "__init__" \
            and frame.f_locals.get("self") is self:
        frame = frame.f_back
        depth += 1
    caller = frame.f_globals.get("__name__", "?")
    if caller not in _warned_callers:
        _warned_callers.add(caller)
        warnings.warn(
            f"gradring is installed, but code in module {caller} constructs torch's "
            f"DistributedDataParallel ({type(self).__qualname__}): it kept torch's class where "
            "gradring.install() cannot rebind it (a closure, a default argument, an attribute). "
            "This wrapper is torch's, not gradring's. Call gradring.install() before that code "
            "takes the class, or construct gradring.DistributedDataParallel there.",
            RuntimeWarning, stacklevel=depth)
    _TORCH_INIT(self, *args, **kwargs)
