"""The line gradring's wrapper prints at its first forward, so a user can see which DDP they got.

[Note: which DDP did I get]
A framework may build torch's wrapper or gradring's depending on when its
module took the class (see [Note: captured names] in ``captures.py``), and
the one-import switch changes nothing else a user sees. So gradring's wrapper
says so once, at its first forward, on rank 0 of its process group, as
Lightning and Accelerate announce their strategy::

    gradring DDP wraps Net: 6 parameters, 1,348 elements, 2 ranks (gloo)

Where the line goes:

- Through ``logging.getLogger("gradring")`` at INFO, when that logger passes
  INFO and some handler would receive it (the user configured logging to show
  INFO, or attached a handler to gradring's logger).
- Otherwise to stderr, with how to silence it appended, unless the user set
  gradring's logger to a level above INFO: a script that never configures
  logging (the usual case) still sees it, as it would not at INFO.
- Nowhere under ``GRADRING_QUIET=1`` or
  ``logging.getLogger("gradring").setLevel(logging.WARNING)``.

stderr and not stdout, so that programs that print results to stdout (and
tests that compare it) are unchanged. A torch wrapper built while gradring is
installed warns instead (see [Note: torch's constructor while installed] in
``install.py``). The call is made once per wrapper, outside the per-step path.
"""

from __future__ import annotations

import logging
import os
import sys

import torch.distributed as dist
from torch import nn

from gradring import config

__all__ = ["announce_first_forward", "logger", "notice", "SILENCE", "stderr_warning_once",
           "user_location"]

#: gradring's logger; the line is INFO.
logger = logging.getLogger("gradring")

#: How to silence the line, appended where it goes to stderr.
SILENCE = "(GRADRING_QUIET=1 silences this line)"


def announce_first_forward(ddp: nn.Module) -> None:
    """Show the one line of the Note for ``ddp`` (a gradring wrapper), on its group's rank 0."""
    group = getattr(ddp, "process_group", None)
    if dist.is_available() and dist.is_initialized() and dist.get_rank(group) != 0:
        return
    if config.current().quiet:
        return
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    backend = dist.get_backend(group) if dist.is_initialized() else "no process group"
    module = getattr(ddp, "module", ddp)
    params = [p for p in module.parameters() if p.requires_grad]
    line = (f"gradring DDP wraps {type(module).__name__}: {len(params)} parameters, "
            f"{sum(p.numel() for p in params):,} elements, {world} ranks ({backend})")
    if logger.isEnabledFor(logging.INFO) and logger.hasHandlers():
        logger.info("%s", line)
    elif logger.level == logging.NOTSET or logger.isEnabledFor(logging.INFO):
        print(f"{line} {SILENCE}", file=sys.stderr, flush=True)


# [Note: which channel a warning takes]
# Where torch's DDP says the same thing, gradring says it on torch's channel:
# torch's Python warnings (deprecated arguments, static_graph set twice, ...)
# are ``warnings.warn`` with torch's category and text, pointed at the user's
# line; what torch's C++ reducer prints (TORCH_WARN_ONCE, e.g. "did not find
# any unused parameters") is a line on stderr, once per process, which no
# Python warning filter sees (``stderr_warning_once``). What gradring says
# and torch does not (its own advice, e.g. a second backward after one
# forward) is a WARNING of the ``gradring`` logger naming the user's line
# (``notice``): with logging not configured, Python prints it on stderr; a
# warning filter ("error", ``pytest -W error``) cannot turn it into an
# exception that torch's DDP would not raise. The list is in
# docs/ddp-differences.md ("Warnings and where they go").

#: Keys of the torch-style stderr warnings already printed by this process.
_SAID: set[str] = set()

#: Directories whose frames are never "the user's line".
_INTERNAL = tuple(os.path.dirname(m.__file__) + os.sep for m in (sys.modules["torch"],
                                                                   sys.modules["gradring"]))


def user_location() -> str:
    """``file:line`` of the innermost frame outside torch and gradring (the user's
    call that led here), or "" when there is none."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_INTERNAL) and not name.startswith("<"):
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back
    return ""


def stderr_warning_once(key: str, text: str) -> None:
    """A warning torch's C++ reducer prints once per process: a line on stderr,
    prefixed by the rank as torch's distributed logs are."""
    if key in _SAID:
        return
    _SAID.add(key)
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else None
    prefix = "" if rank is None else f"[rank{rank}]:"
    print(f"{prefix}[W gradring reducer] Warning: {text}", file=sys.stderr, flush=True)


def notice(text: str) -> None:
    """gradring's own advice: a WARNING of the ``gradring`` logger, naming the
    user's line (see [Note: which channel a warning takes])."""
    where = user_location()
    logger.warning("%s%s", text, f" (at {where})" if where else "")
