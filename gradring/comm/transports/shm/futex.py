"""Linux futexes on shared mappings, through ctypes (which releases the GIL).

[Note: spin, then block]
A waiter spins briefly in Python (a running peer arrives in ~1 µs), yields
while that costs nothing ([Note: yield only while it is free] in
``transport.py``), then sleeps in ``FUTEX_WAIT`` in short slices, to check
deadlines and peer liveness: pure spinning collapses when the peer is
descheduled, and blocking gives it the core. A word several ranks bump (a
doorbell) goes up with ``FUTEX_WAKE_OP`` (add and wake, atomically, in one
call); a word only its owner writes is stored, then woken with ``FUTEX_WAKE``.
No wake-up is lost: the kernel refuses to sleep if the word moved since the
waiter saw it. Ordering relies on x86-64 (TSO: plain stores become visible in
program order, so "write data, then bump the word" needs no fence), so the shm
transport is only selected there.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import sys

#: True where this module works (and the shm transport may be chosen).
AVAILABLE = sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")

_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT = 0
_FUTEX_WAKE = 1
_FUTEX_WAKE_OP = 5
_FUTEX_OP_ADD = 1
_FUTEX_OP_CMP_EQ = 0
#: FUTEX_WAKE_OP's encoded operation: ``*uaddr2 += 1`` (then compare with 0, unused).
_ADD_ONE = (_FUTEX_OP_ADD << 28) | (_FUTEX_OP_CMP_EQ << 24) | (1 << 12) | 0
_WAKE_ALL = 0x7FFFFFFF


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


if AVAILABLE:
    _libc = ctypes.CDLL(None, use_errno=True)
    _syscall = _libc.syscall
    _syscall.restype = ctypes.c_long


def add_and_wake(addr: int) -> None:
    """Atomically ``*(uint32*)addr += 1`` and wake every waiter on it."""
    rc = _syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAKE_OP, _WAKE_ALL,
                  ctypes.c_void_p(0), ctypes.c_void_p(addr), _ADD_ONE)
    if rc < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"futex(FUTEX_WAKE_OP) failed: {os.strerror(err)}")


def wake(addr: int) -> None:
    """Wake every waiter on ``*(uint32*)addr`` (its owner has just stored a new value)."""
    rc = _syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAKE, _WAKE_ALL,
                  ctypes.c_void_p(0), ctypes.c_void_p(0), 0)
    if rc < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"futex(FUTEX_WAKE) failed: {os.strerror(err)}")


class Waker:
    """:func:`wake` for one word, called once per barrier: its ctypes arguments are
    built once (building them cost a third of the call)."""

    __slots__ = ("_args",)

    def __init__(self, addr: int) -> None:
        self._args = (_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAKE, _WAKE_ALL,
                      ctypes.c_void_p(0), ctypes.c_void_p(0), 0)

    def __call__(self) -> None:
        if _syscall(*self._args) < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"futex(FUTEX_WAKE) failed: {os.strerror(err)}")


def wait(addr: int, seen: int, timeout_s: float) -> bool:
    """Sleep while ``*(uint32*)addr == seen``, at most ``timeout_s``.

    Returns False on timeout, True otherwise (woken, value moved, signal).
    """
    secs = int(timeout_s)
    ts = _Timespec(secs, int((timeout_s - secs) * 1e9))
    rc = _syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAIT, ctypes.c_uint32(seen),
                  ctypes.byref(ts), ctypes.c_void_p(0), 0)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err == errno.ETIMEDOUT:
        return False
    if err in (errno.EAGAIN, errno.EINTR):
        return True
    raise OSError(err, f"futex(FUTEX_WAIT) failed: {os.strerror(err)}")
