"""Which rank torchrun names as a failed job's root cause.

[Note: torchrun's root cause]
torchrun names as "Root Cause" the failed worker with the smallest timestamp,
in whole seconds, from its error file (``TORCHELASTIC_ERROR_FILE``, written by
``@record``) or from when the agent saw it exit. gradring's peers learn of a
rank's failure within milliseconds and exit while it is still tearing down,
so torchrun picked a survivor in 2 of 4 runs (torch's DDP never: its peers
wait for a timeout). So at exit after an uncaught exception a rank whose
exception is not a gradring collective failure writes its error file (unless
``@record`` did); one whose exception is, or was caused by, one
(``CollectiveError``, the watchdog's error) sets its file's timestamp one
second after its own failure. A consequence never sorts before the first
failure. The handler is registered again (so runs first) whenever a group
context is made, before the groups close at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
import time
import traceback
from typing import Any

from gradring.comm.transport import CollectiveError

ENV = "TORCHELASTIC_ERROR_FILE"


#: How autograd's engine words an exception raised by a callback queued on it
#: (the reducer's finalize): it re-raises a new RuntimeError carrying only the
#: text, so the original exception's type survives only as words in it.
_ENGINE_CALLBACK = "error when running the callback: "


def _consequence(exc: BaseException | None) -> bool:
    """Whether ``exc`` is, or was raised because of, a gradring collective failure."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, CollectiveError) or type(exc).__name__ == "WatchdogError":
            return True
        text = str(exc)
        if _ENGINE_CALLBACK in text and text.split(_ENGINE_CALLBACK, 1)[1].startswith(
                ("CollectiveError:", "WatchdogError:")):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _read(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) and "message" in data else None
    except (OSError, ValueError):
        return None


def _write(path: str, data: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):
        tmp = f"{path}.gradring.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)


def record(exc: BaseException, now: float | None = None, path: str | None = None) -> None:
    """Write or adjust this rank's torchelastic error file for ``exc`` (see the Note)."""
    path = path if path is not None else os.environ.get(ENV)
    if not path or exc is None or isinstance(exc, (SystemExit, KeyboardInterrupt)):
        return
    now = time.time() if now is None else now
    data = _read(path)
    if not _consequence(exc):
        if data is None:  # @record did not write it: do what it would have
            tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            _write(path, {"message": {"message": f"{type(exc).__name__}: {exc}",
                                      "extraInfo": {"py_callstack": tb,
                                                    "timestamp": str(int(now))}}})
        return
    later = str(int(now) + 1)
    if data is None:
        data = {"message": {"message": f"{type(exc).__name__}: {exc} (gradring: this rank "
                                       "stopped because a peer failed first)",
                            "extraInfo": {"py_callstack": "", "timestamp": later}}}
    elif isinstance(data["message"], dict):
        data["message"].setdefault("extraInfo", {})["timestamp"] = later
    else:
        data["timestamp"] = later
    _write(path, data)


def _at_exit() -> None:
    record(getattr(sys, "last_value", None))  # type: ignore[arg-type]


def install() -> None:
    """(Re-)register the exit handler so that it runs before the groups close
    (atexit runs the newest registration first)."""
    atexit.unregister(_at_exit)
    atexit.register(_at_exit)
