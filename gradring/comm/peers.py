"""Which process each rank of a group is, known before the peer board; how a peer
process ended, in words; and the errors of gloo calls completed with both.

[Note: naming a peer behind a gloo error]
Where gradring calls gloo itself (DDP's parameter verification, Join's
all-reduce) a dead peer leaves gloo's bare "Connection reset by peer", and the
first gradring call on a group (``agree.py``) waited in the store for a dead
peer until the group's timeout. So DDP's verification gathers every rank's
``(pid, host key)`` with its parameters (:func:`gather_objects`), each rank
having put its own in the group's store first (``gradring/ids/<gen>/``); the
result is kept per group (:func:`learn`, :func:`known`). A gloo error inside
:func:`naming_dead_peers` is raised again as a :class:`PeerExitedError` (a
``CollectiveError`` and a ``DistBackendError``) naming the peer on this host
that exited and how, or the ranks that never reached the call; waits in the
store check :func:`dead_among`. Only peers on this host can be checked.

[Note: naming how a peer died]
"Has exited" alone does not tell a crash from an OOM kill. What can be known,
read only on an error path: a child's status (``waitid(WNOWAIT)``, not
reaping it); a zombie's (``/proc/<pid>/stat`` field 52; ``pid_alive`` counts a
zombie as dead, so a survivor usually looks within that window); the kernel
log (``/dev/kmsg``), which records every OOM kill. Without any, the words say
where to look (docs/reliability.md, "Dead peers and early exits").
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch.distributed as dist

from gradring.comm.registry import GROUPS
from gradring.comm.store import BoundedStore, group_store, instance_prefix
from gradring.comm.transport import CollectiveError
from gradring.comm.transports.shm import segments
from gradring.comm.transports.topology import host_key

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


#: group name -> (the group, weakly; {rank: (pid, host key)})
_KNOWN: dict[str, tuple[Any, dict[int, tuple[int, str]]]] = {}


class PeerExitedError(CollectiveError, dist.DistBackendError):
    """A gloo call failed and gradring knows which peer is gone (see the Note)."""


def _group(group: Any) -> Any:
    return dist.distributed_c10d._get_default_group() if group is None else group


def _name(group: Any) -> str:
    return str(getattr(_group(group), "group_name", "?"))


def identity() -> list[Any]:
    """This process's ``[pid, host key]``."""
    return [os.getpid(), host_key()]


def learn(group: Any, ids: dict[int, tuple[int, str]]) -> None:
    """Remember the ``(pid, host key)`` of ``group``'s ranks."""
    g = _group(group)
    try:
        ref: Any = weakref.ref(g)
    except TypeError:
        ref = lambda: g  # noqa: E731 - a group without weak references
    _KNOWN[_name(g)] = (ref, dict(ids))


def known(name: str) -> dict[int, tuple[int, str]]:
    """The identities learnt for the live group named ``name`` ({} if none)."""
    entry = _KNOWN.get(name)
    if entry is None:
        return {}
    g = entry[0]()
    try:
        live = g is not None and g in dist.distributed_c10d._world.pg_map
    except Exception:  # noqa: BLE001 - private API
        live = g is not None
    return dict(entry[1]) if live else {}


def dead_among(name: str, ranks: Sequence[int]) -> list[tuple[int, int]]:
    """``(rank, pid)`` of those of ``ranks`` known to run on this host whose process is gone."""
    ids = known(name)
    me = host_key()
    return [(r, ids[r][0]) for r in ranks
            if r in ids and ids[r][1] == me and not segments.pid_alive(ids[r][0])]


def failing_if_gone(name: str, where: str) -> Callable[[Sequence[int]], None]:
    """A ``check_missing`` for :func:`~gradring.comm.store.wait_keys`: raise a
    CollectiveError naming those of the missing ranks known to be gone from this host,
    and how they ended, ``where`` saying what the wait was for."""
    def check(missing: Sequence[int]) -> None:
        dead = dead_among(name, missing)
        if dead:
            raise CollectiveError(f"gradring group {name}: "
                                  + "; ".join(exited(p, pid) for p, pid in dead)
                                  + f", {where}")
    return check


def _store_ids(group: Any, prefix: str, world_size: int) -> dict[int, tuple[int, str]] | None:
    """The identities ranks put under ``prefix`` (None: the store did not answer)."""
    def get(store: Any) -> dict[int, Any]:
        return {p: store.get(f"{prefix}{p}") for p in range(world_size)
                if store.check([f"{prefix}{p}"])}

    try:
        raw = BoundedStore(group_store(group)).run(get)
    except Exception:  # noqa: BLE001 - diagnostics only
        return None
    out = {}
    for p, value in raw.items():
        try:
            pid, host = json.loads(value)
            if type(pid) is int and isinstance(host, str):
                out[p] = (pid, host)
        except (ValueError, TypeError):
            continue
    return out


def explain(group: Any, prefix: str | None = None, what: str = "the call") -> str | None:
    """What gradring knows about why a gloo call of ``group`` failed: which peers on this
    host have exited (and how), else which ranks never reached it; None if nothing."""
    g = _group(group)
    world, me = dist.get_world_size(g), dist.get_rank(g)
    ids = known(_name(g))
    in_store = _store_ids(g, prefix, world) if prefix is not None else None
    ids.update(in_store or {})
    with contextlib.suppress(Exception):
        ctx = GROUPS.get(g)  # the group's context, if gradring made one (never makes it)
        if ctx is not None:
            ids.update(ctx.board.identities())  # type: ignore[attr-defined]
    here = host_key()
    for attempt in range(6):  # a socket closes before its process is reaped
        dead = [(r, pid) for r, (pid, host) in sorted(ids.items())
                if r != me and host == here and not segments.pid_alive(pid)]
        if dead:
            return "; ".join(exited(r, pid) for r, pid in dead)
        if attempt < 5:
            time.sleep(0.05)
    if in_store is not None:
        missing = [r for r in range(world) if r not in in_store]
        if missing:
            return (f"ranks {missing} never reached {what} (nothing of theirs in the store): "
                    "they died or hung before it")
    others = sorted({r for r, (_, host) in ids.items() if host != here})
    if others:
        return (f"no rank on this host has exited; ranks {others} run on other hosts, where "
                "gradring cannot check their processes: see their logs")
    return None


@contextlib.contextmanager
def naming_dead_peers(group: Any, what: str, prefix: str | None = None) -> Iterator[None]:
    """Raise a gloo error of the block again with what gradring knows of its cause
    (see [Note: naming a peer behind a gloo error]); ``what`` names the call."""
    try:
        yield
    except RuntimeError as exc:
        if isinstance(exc, CollectiveError):
            raise
        try:
            note = explain(group, prefix, what)
        except Exception:  # noqa: BLE001 - never hide the original error
            note = None
        if note is None:
            raise
        raise PeerExitedError(f"{exc}\ngradring: {what} failed on rank "
                              f"{dist.get_rank(_group(group))}: {note}") from exc


def gather_objects(group: Any, obj: Any, what: str) -> list[Any]:
    """``dist.all_gather_object`` of ``obj`` over ``group`` (every rank's, by rank),
    learning every rank's identity on the way; a gloo error names a dead peer."""
    g = _group(group)
    world, rank = dist.get_world_size(g), dist.get_rank(g)
    mine = identity()
    prefix: str | None = None
    with contextlib.suppress(Exception):  # no store: the gather still runs
        store = group_store(g)
        prefix = instance_prefix(store, "ids", world)
        store.set(f"{prefix}{rank}", json.dumps(mine))
    out: list[Any] = [None] * world
    with naming_dead_peers(g, what, prefix):
        dist.all_gather_object(out, (obj, mine), group=g)
    learn(g, {r: (int(o[1][0]), str(o[1][1])) for r, o in enumerate(out)})
    return [o[0] for o in out]
