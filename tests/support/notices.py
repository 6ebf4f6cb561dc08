"""Catching what gradring says outside exceptions (see [Note: which channel a
warning takes] in gradring/announce.py): its own notices on the ``gradring``
logger, and torch-style lines on stderr."""

from __future__ import annotations

import contextlib
import io
import logging
import sys
from collections.abc import Iterator


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def notices() -> Iterator[list[str]]:
    """The messages the ``gradring`` logger emits at WARNING or above meanwhile."""
    log = logging.getLogger("gradring")
    handler = _Collect()
    handler.setLevel(logging.WARNING)
    log.addHandler(handler)
    try:
        yield handler.messages
    finally:
        log.removeHandler(handler)


@contextlib.contextmanager
def stderr_text() -> Iterator[io.StringIO]:
    """What Python code writes to ``sys.stderr`` meanwhile (read ``.getvalue()``)."""
    old, sys.stderr = sys.stderr, io.StringIO()
    try:
        yield sys.stderr
    finally:
        sys.stderr = old
