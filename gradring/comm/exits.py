"""How a peer process ended, in words, as far as this process can know it.

[Note: naming how a peer died]
A rank on this host whose pid is gone "has exited"; that alone does not tell
a crash from an OOM kill. What can be known, in order:

- the process is this process's child: ``waitid(WNOWAIT)`` peeks at its
  status without reaping it;
- it is a zombie (its parent, e.g. torchrun's agent, has not reaped it yet;
  ``pid_alive`` counts a zombie as dead, so a survivor usually looks within
  that window): ``/proc/<pid>/stat`` field 52 holds its exit status in
  ``waitpid`` form (Linux >= 3.5);
- the kernel log (``/dev/kmsg``, readable by root unless restricted) records
  every OOM kill: "Killed process <pid> (...)" or "oom-kill:...,pid=<pid>,...".

A SIGKILL without a readable kernel log is worded "killed by signal 9
(SIGKILL)" plus where an OOM kill would show. Nothing known at all (the agent
reaped it, no kernel log) says the process may have been killed and where to
look. Every source is read only on an error path.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time

#: Most bytes of kernel log read per lookup (the ring buffer is usually 128 KiB-1 MiB).
_KMSG_LIMIT = 8 << 20
#: Most seconds one kernel-log lookup may take.
_KMSG_BUDGET_S = 0.5


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def _child_status(pid: int) -> int | None:
    """``waitpid``-style status of ``pid`` if it is this process's dead child (not reaped)."""
    if not hasattr(os, "waitid"):
        return None
    try:
        res = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except (ChildProcessError, OSError):
        return None
    if res is None:
        return None
    if res.si_code == os.CLD_EXITED:
        return (res.si_status & 0xFF) << 8
    return res.si_status & 0x7F  # killed or dumped: the signal


def zombie_status(pid: int, proc: str = "/proc") -> int | None:
    """The exit status (``waitpid`` form) of ``pid`` while it is a zombie, else None."""
    try:
        with open(f"{proc}/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    try:
        end = stat.rindex(b")")
        fields = stat[end + 2:].split()
        if fields[0] not in (b"Z", b"X") or len(fields) < 50:
            return None
        return int(fields[49])  # field 52 of the whole line; 3 is fields[0]
    except (ValueError, IndexError):
        return None


def kernel_log_lines(path: str = "/dev/kmsg") -> list[str] | None:
    """The kernel log's records, or None when it cannot be read (no permission,
    ``kernel.dmesg_restrict``, not Linux)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    lines: list[str] = []
    total = 0
    give_up = time.monotonic() + _KMSG_BUDGET_S
    try:
        while total < _KMSG_LIMIT and time.monotonic() < give_up:
            try:
                rec = os.read(fd, 16384)
            except BlockingIOError:
                break  # the end of the ring buffer
            except OSError as exc:
                if exc.errno == 32:  # EPIPE: a record was overwritten; go on
                    continue
                if not lines:
                    return None
                break
            if not rec:
                break
            total += len(rec)
            # Records read "<prio>,<seq>,<usec>,<flags>;<text>", then " KEY=value" lines.
            for line in rec.decode("utf-8", "replace").splitlines():
                if line and not line.startswith(" "):
                    lines.append(line.split(";", 1)[-1])
    finally:
        os.close(fd)
    return lines


def oom_record(pid: int, lines: list[str]) -> str | None:
    """The kernel log's line about the OOM kill of ``pid``, if any."""
    pat = re.compile(rf"(Killed process {pid} \(|[,:\s]pid={pid}[,\s])")
    for line in reversed(lines):
        if pat.search(line) and ("oom" in line.lower() or "Killed process" in line
                                 or "Out of memory" in line):
            return line.strip()
    return None


def describe_status(status: int) -> str:
    """A ``waitpid`` status in words: "killed by signal 9 (SIGKILL)", "exit status 3"."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return f"killed by signal {sig} ({_signal_name(sig)})"
    if os.WIFEXITED(status):
        return f"exit status {os.WEXITSTATUS(status)}"
    return f"status {status:#x}"


def how_it_ended(pid: int, host: str = "this host", *, proc: str = "/proc",
                 kmsg: str = "/dev/kmsg") -> str:
    """How ``pid`` (gone or a zombie) ended, in words, without a leading separator:
    "killed by signal 9 (SIGKILL)", "killed by the OOM killer (...)", or where to
    look when nothing can be known here (see [Note: naming how a peer died])."""
    status = _child_status(pid)
    if status is None:
        status = zombie_status(pid, proc)
    killed = status is not None and os.WIFSIGNALED(status)
    if status is not None and not (killed and os.WTERMSIG(status) == signal.SIGKILL):
        return describe_status(status)
    lines = kernel_log_lines(kmsg)
    record = oom_record(pid, lines) if lines is not None else None
    if record is not None:
        return f"killed by the OOM killer (SIGKILL); the kernel log says: {record[:300]}"
    if killed:
        if lines is not None:
            return describe_status(status)  # type: ignore[arg-type]
        return (f"{describe_status(status)}; the OOM killer sends SIGKILL, and would "  # type: ignore[arg-type]
                f"have logged 'Killed process {pid}' in the kernel log (dmesg) on {host}")
    return (f"how is unknown here; it may have been killed (by the OOM killer, for "
            f"example: look for 'Killed process {pid}' in dmesg or journalctl -k on {host}; "
            f"the launcher's log, e.g. torchrun's, has its exit code)")


def exited(rank: int, pid: int, host: str = "this host") -> str:
    """``rank R (pid P) has exited: <how>`` for an error message."""
    with contextlib.suppress(Exception):
        return f"rank {rank} (pid {pid}) has exited: {how_it_ended(pid, host)}"
    return f"rank {rank} (pid {pid}) has exited"
