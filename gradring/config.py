"""Every ``GRADRING_*`` environment variable, parsed and validated in one place.

:class:`Config` has one field per variable, documented there; :func:`current`
returns it for the environment as it is now. A value outside its range
raises :class:`ConfigError` (a ``ValueError``) naming the variable, the value
and what it may be -- at the first read of the configuration, whichever knob
that read was for.

[Note: when the environment is read]
Some knobs are read per collective, because benchmarks and tests switch them
between calls in one process: ``GRADRING_TRANSPORT``, ``GRADRING_ALGO`` and
``GRADRING_CHECK``. Those callers hold a :func:`view`, which compares only
its own variables' raw values with what it saw last (lookups in
``os.environ``'s backing dict: ~50 ns each against ~1 us through
``os.environ``'s encoding layer) and re-reads the configuration only when one
changed. The rest are read where their effect starts: ``GRADRING_TIMEOUT``
when a group's state is made,
``GRADRING_FAST_PATHS`` when it is built and when its buckets are rebuilt,
``GRADRING_QUIET`` at a wrapper's first forward,
``GRADRING_FLIGHT_RECORDER`` when the recorder writes, ``GRADRING_DEBUG`` and
``GRADRING_EXIT_DESTROY`` when the process exits, and
``GRADRING_FLIGHT_SIZE`` and ``GRADRING_SHM_YIELD_US`` at import (the
recorder's ring is made then; the wait loop reads a module constant).
Those callers use :func:`current`, which compares every variable, so a test
that changes the environment sees the change at the next such point;
:func:`reload` forgets what was parsed. The three read per collective must be
equal on every rank of a group: their values are compared when a group's state is
made (see [Note: agreed settings] in ``comm/agree.py``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from gradring import fast_paths
from gradring.fast_paths import FastPaths

T = TypeVar("T")


class ConfigError(ValueError):
    """A ``GRADRING_*`` variable holds a value gradring cannot use."""


class SettingsMismatch(ConfigError):
    """Ranks of one group set a variable that must match to different values
    (checked once per group, see ``gradring/comm/agree.py``)."""


def _bad(var: str, value: str, valid: str) -> ConfigError:
    return ConfigError(f"{var}={value!r} is not valid: {valid}")


def _choice(options: tuple[str, ...]) -> Callable[[str, str], str | None]:
    """A parser accepting one of ``options`` (any case), or nothing (None)."""
    def parse(var: str, text: str) -> str | None:
        value = text.strip().lower()
        if value and value not in options:
            raise _bad(var, text, f"expected one of {', '.join(options)} (or unset)")
        return value or None
    return parse


_YES = ("1", "true", "yes", "on")
_NO = ("0", "false", "no", "off")


def _switch(var: str, text: str) -> bool:
    value = text.strip().lower()
    if value in _YES:
        return True
    if value in _NO or not value:
        return False
    raise _bad(var, text, f"expected one of {', '.join(_YES + _NO)} (or unset)")


def _switch_on(var: str, text: str) -> bool:
    """A switch that is on unless set to one of the "no" spellings."""
    return True if not text.strip() else _switch(var, text)


def _number(var: str, text: str, low: float, high: float, *, low_open: bool,
            what: str) -> float:
    """A finite float in ``[low, high]`` (``(low, high]`` with ``low_open``)."""
    span = f"{'(' if low_open else '['}{low:g}, {high:g}]"
    try:
        value = float(text)
    except ValueError:
        raise _bad(var, text, f"expected {what}, a number in {span}") from None
    if not math.isfinite(value) or value < low or (low_open and value == low) or value > high:
        raise _bad(var, text, f"expected {what} in {span}")
    return value


def _timeout(var: str, text: str) -> float | None:
    if not text.strip():
        return None
    # Upper end: a year. torch turns the timeout into a timedelta and the store into
    # milliseconds; far beyond it those overflow.
    return _number(var, text, 0.0, 365 * 24 * 3600.0, low_open=True, what="seconds")


def _yield_us(var: str, text: str) -> float:
    if not text.strip():
        return 50.0
    return _number(var, text, 0.0, 1e6, low_open=False, what="microseconds")


def _fast_paths(var: str, text: str) -> FastPaths:
    try:
        return fast_paths.parse(text)
    except ValueError as exc:
        raise _bad(var, text, f"{exc} (or all, or none)") from None


def _flight_size(var: str, text: str) -> int:
    if not text.strip():
        return 256
    try:
        value = int(text)
    except ValueError:
        raise _bad(var, text, "expected a whole number of entries in [1, 1000000]") from None
    if not 1 <= value <= 1_000_000:
        raise _bad(var, text, "expected a whole number of entries in [1, 1000000]")
    return value


def _directory(var: str, text: str) -> str | None:
    if not text:
        return None
    if os.path.exists(text) and not os.path.isdir(text):
        raise _bad(var, text, "expected a directory (it is made if missing); this path "
                              "exists and is not a directory")
    return text


def _knob(var: str, parse: Callable[[str, str], Any], default: Any) -> Any:
    return field(default=default, metadata={"env": var, "parse": parse})


@dataclass(frozen=True)
class Config:
    """gradring's settings from the environment; see [Note: when the environment is read]."""

    #: ``GRADRING_TRANSPORT=shm|torch``: force the transport of CPU collectives (``shm``
    #: fails loudly where the ranks share no host); unset: ``select.pick_transport``.
    transport: str | None = _knob("GRADRING_TRANSPORT", _choice(("shm", "torch")), None)
    #: ``GRADRING_ALGO=ring|tree|hierarchical|native``: force the algorithm; ``native``
    #: hands collectives to the process group (see ``comm/select.py``).
    algo: str | None = _knob("GRADRING_ALGO",
                             _choice(("ring", "tree", "hierarchical", "native")), None)
    #: ``GRADRING_TIMEOUT=<seconds>``, finite and > 0: every collective's deadline, instead
    #: of the process group's timeout (None: the group's).
    timeout: float | None = _knob("GRADRING_TIMEOUT", _timeout, None)
    #: ``GRADRING_CHECK=1``: full desync fingerprints (shape, label, native collectives),
    #: see [Note: desync checks] in ``comm/desync.py``. Yes: 1/true/yes/on; no: 0/false/no/off.
    check: bool = _knob("GRADRING_CHECK", _switch, False)
    #: ``GRADRING_FLIGHT_RECORDER=<dir>``: where each rank writes its flight recorder when a
    #: collective fails (``comm/recorder.py``); None: nowhere.
    flight_recorder: str | None = _knob("GRADRING_FLIGHT_RECORDER", _directory, None)
    #: ``GRADRING_FLIGHT_SIZE=<n>``, 1 to 1000000: collectives the flight recorder keeps.
    flight_size: int = _knob("GRADRING_FLIGHT_SIZE", _flight_size, 256)
    #: ``GRADRING_SHM_YIELD_US=<us>``, 0 to 1000000: how long a shared-memory wait polls with
    #: sched_yield before sleeping in the kernel (see [Note: spin, then block]).
    shm_yield_us: float = _knob("GRADRING_SHM_YIELD_US", _yield_us, 50.0)
    #: ``GRADRING_FAST_PATHS``: the reducer's fast paths to use: ``all`` (default), ``none``
    #: (the core alone), names to keep, or ``-``names to drop (see [Note: the core and its
    #: fast paths] in ``fast_paths.py``). Rank 0's set counts.
    fast_paths: FastPaths = _knob("GRADRING_FAST_PATHS", _fast_paths, fast_paths.ALL)
    #: ``GRADRING_QUIET=1``: no line at a wrapper's first forward (see [Note: which DDP
    #: did I get] in ``announce.py``). Yes: 1/true/yes/on; no: 0/false/no/off.
    quiet: bool = _knob("GRADRING_QUIET", _switch, False)
    #: ``GRADRING_DEBUG=exit``: at exit, one line on stderr for each gradring thread, group
    #: and pending collective still alive (see [Note: how a gradring process exits] in
    #: ``comm/leaving.py``).
    debug: str | None = _knob("GRADRING_DEBUG", _choice(("exit",)), None)
    #: ``GRADRING_EXIT_DESTROY=0``: at exit, leave the default process group to the
    #: program; by default gradring destroys it if the program did not (same Note).
    exit_destroy: bool = _knob("GRADRING_EXIT_DESTROY", _switch_on, True)


#: Every knob's variable name, in field order.
VARIABLES = tuple(f.metadata["env"] for f in fields(Config))


def parse(environ: Mapping[str, str]) -> Config:
    """The configuration ``environ`` describes; :class:`ConfigError` names a bad value."""
    values = {}
    for f in fields(Config):
        text = environ.get(f.metadata["env"])
        if text is not None:
            values[f.name] = f.metadata["parse"](f.metadata["env"], text)
    return Config(**values)


# Raw values are compared in os.environ's backing dict (bytes keys and values, kept in
# sync by os.environ) where the interpreter has one: see the module's Note.
_BACKING: Mapping[Any, Any] | None = getattr(os.environ, "_data", None)
_RAW: Mapping[Any, Any] = os.environ if _BACKING is None else _BACKING
_rawkey: Callable[[str], Any] = str if _BACKING is None else os.environ.encodekey


class _Parsed:
    """The configuration last parsed and the raw values it came from."""

    def __init__(self) -> None:
        # Raw value of every variable when ``_config`` was parsed (None: not yet).
        self._raw: tuple[Any, ...] | None = None
        # What they parsed to.
        self._config = Config()
        # Keys of every variable in ``_RAW``.
        self._keys = tuple(map(_rawkey, VARIABLES))

    def current(self) -> Config:
        raw = tuple(map(_RAW.get, self._keys))
        if raw != self._raw:
            self._config = parse(os.environ)
            self._raw = raw
        return self._config

    def forget(self) -> None:
        self._raw = None


_PARSED = _Parsed()


def current() -> Config:
    """The configuration of the environment as it is now (parsed again only when some
    ``GRADRING_*`` variable changed)."""
    return _PARSED.current()


def reload() -> Config:
    """Parse the environment again, whatever was parsed before."""
    _PARSED.forget()
    return _PARSED.current()


def view(names: tuple[str, ...], make: Callable[[Config], T]) -> Callable[[], T]:
    """A function returning ``make(current())`` for one or two knobs read per collective:
    it compares only their own variables with what it saw last (see [Note: when the
    environment is read]), so its other fields may be stale -- ``make`` reads these."""
    by_field = {f.name: f.metadata["env"] for f in fields(Config)}
    keys = [_rawkey(by_field[n]) for n in names]
    get = _RAW.get
    seen: Any = object()  # raw values ``value`` was made from (nothing yet)
    value: Any = None
    # Spelled out per arity: a per-call loop or tuple(map(...)) costs ~3x the lookups.
    if len(keys) == 1:
        (key,) = keys

        def read() -> T:
            nonlocal seen, value
            raw = get(key)
            if raw != seen:
                value, seen = make(current()), raw
            return value  # type: ignore[no-any-return]
    elif len(keys) == 2:
        first, second = keys

        def read() -> T:
            nonlocal seen, value
            raw = (get(first), get(second))
            if raw != seen:
                value, seen = make(current()), raw
            return value  # type: ignore[no-any-return]
    else:
        raise TypeError(f"view() watches one or two knobs, not {len(names)}")
    return read
