"""Connecting a shared-memory group: the rendezvous through the process group's store.

Three rounds of keys under ``gradring/shm/<generation>/`` (``store.instance_prefix``):
``info/<rank>``, the host identity (``topology.host_identity``) and pid -- shm
is used only if all ranks share it (and on x86-64, ``futex.py``), a verdict
every rank reaches from the same data; ``ctl/<rank>``, the name of the rank's
control segment and a random cookie written into it -- a peer maps it only if
well-formed and the header matches, then reads the naming key there ([Note:
segment names and leaks]), and a forged entry makes every rank fall back with
a warning; ``ok/<rank>``, whether this rank mapped every peer's control segment
and read the cookie back -- the proof that /dev/shm really is shared. Then
every control segment is unlinked: all peers map it, so a ``kill -9`` cannot
leak it.
"""

from __future__ import annotations

import itertools
import json
import os
import secrets
import sys
import time
from collections.abc import Callable
from typing import Any

from gradring.comm.store import instance_prefix, wait_keys, who_is_missing
from gradring.comm.transport import CollectiveError
from gradring.comm.transports.shm import futex, segments, sigterm, space
from gradring.comm.transports.shm.layout import (
    HEADER,
    KEY_BYTES,
    KEY_OFF,
    MAGIC,
    control_size,
)
from gradring.comm.transports.shm.segments import Segment
from gradring.comm.transports.shm.transport import ShmTransport, live_transports
from gradring.comm.transports.topology import host_identity

_transport_counter = itertools.count()


def _gather(store: Any, prefix: str, world_size: int, timeout: float,
            check_missing: Callable[[list[int]], None] | None) -> list[Any]:
    """Every rank's value under ``prefix`` (None for one that is not JSON: forged);
    ``check_missing`` as for ``store.wait_keys``."""
    keys = [f"{prefix}{p}" for p in range(world_size)]
    try:
        wait_keys(store, keys, timeout, check_missing)
    except CollectiveError:
        raise
    except Exception as exc:  # noqa: BLE001 - the store's timeout (or a closed store)
        raise CollectiveError(
            f"gradring: {who_is_missing(store, keys)} did not reach the shared-memory "
            f"rendezvous within {timeout:g}s (gone, or stuck before their first "
            f"collective on this group). Store: {exc}") from None
    out = []
    for k in keys:
        try:
            out.append(json.loads(store.get(k)))
        except ValueError:
            out.append(None)
    return out


def _sweep() -> None:
    """What dead processes left in /dev/shm goes at every connect (see [Note: a live job
    sweeps too] in ``segments.py``)."""
    segments.sweep_if_due(time.monotonic(), force=True)


def _announced(p: int, info: Any, ctl: Any) -> tuple[str, int, int]:
    """``(control segment name, cookie, pid)`` rank ``p`` announced in the store, or
    ValueError naming what is impossible (the store is unauthenticated: see
    [Note: segment names and leaks])."""
    name = ctl.get("name") if isinstance(ctl, dict) else None
    cookie = ctl.get("cookie") if isinstance(ctl, dict) else None
    pid = info.get("pid") if isinstance(info, dict) else None
    if type(cookie) is not int or not 0 <= cookie < 1 << 63 or type(pid) is not int \
            or not 0 < pid < 1 << 31:
        raise ValueError(f"rank {p} announced an impossible control segment in the store "
                         f"(name {name!r}, cookie {cookie!r}, pid {pid!r}): forged?")
    return segments.check_name(name), cookie, pid


def _unavailable(reason: str) -> tuple[None, str]:
    """Give shared memory up for this group, saying why on stderr (not for another host:
    that is no fault)."""
    print(f"gradring warning (rank pid {os.getpid()}): shared memory is unavailable for "
          f"this group ({reason}); its collectives run over the process group (slower)",
          file=sys.stderr, flush=True)
    return None, reason


def connect(store: Any, rank: int, world_size: int, timeout: float,
            check_missing: Callable[[list[int]], None] | None = None) -> tuple[
        ShmTransport | None, str]:
    """Rendezvous through ``store`` (private to the group); collective. ``(transport,
    "")``, or ``(None, reason)`` when the ranks do not share a host (or a peer's entry
    does not check out). Every connect sweeps dead processes' segments ([Note: a live
    job sweeps too]); ``check_missing(ranks)`` may end the wait (a rank known gone).
"""
    key = instance_prefix(store, "shm", world_size)  # one generation per group instance
    store.set(f"{key}info/{rank}", json.dumps(dict(host_identity(), pid=os.getpid())))
    infos = _gather(store, f"{key}info/", world_size, timeout, check_missing)
    ident = host_identity()
    others = [p for p, i in enumerate(infos)
              if not isinstance(i, dict) or {k: i.get(k) for k in ident} != ident]
    if not futex.AVAILABLE:
        return None, "shared-memory futexes need Linux on x86-64"
    if others:
        return None, f"ranks {others} run on another host, boot or pid namespace"
    _sweep()
    base = segments.segment_base(os.getpid(), ident["pidns"], next(_transport_counter))
    naming_key = secrets.token_bytes(KEY_BYTES)  # this rank's own: never in the store
    cookie = secrets.randbits(63)
    ctl: Segment | None = None
    try:
        ctl, ctl_no = _create_control(base, naming_key, world_size, rank == 0)
        stamp_control(ctl, rank, world_size, cookie, naming_key)
        mine: dict[str, Any] = {"name": ctl.name, "cookie": cookie}
    except OSError as exc:  # e.g. /dev/shm full: everybody falls back together
        mine = {"error": str(exc)}
        if isinstance(exc, segments.ShmFull) and not isinstance(exc, segments.LimitReached):
            mine["needed"] = exc.needed  # a process limit is no matter of /dev/shm's size
    store.set(f"{key}ctl/{rank}", json.dumps(mine))
    ctls = _gather(store, f"{key}ctl/", world_size, timeout, check_missing)
    failed = [f"rank {p}: {c['error']}" for p, c in enumerate(ctls)
              if isinstance(c, dict) and "error" in c]
    if failed or ctl is None:
        if ctl is not None:
            ctl.close()
        short = [c["needed"] for c in ctls if isinstance(c, dict) and type(c.get("needed")) is int]
        if short:
            space.warn_once(space.advice(max(short), 0, world_size) + "; gradring uses the "
                            "process group's transport instead (slower)")
            return None, "cannot create control segments: " + "; ".join(failed)
        return _unavailable("cannot create control segments: " + "; ".join(failed))
    peers: list[Segment | None] = [None] * world_size
    keys, bases, pids = [naming_key] * world_size, [base] * world_size, [os.getpid()] * world_size
    problem = ""
    for p, c in enumerate(ctls):
        if p == rank:
            continue
        try:
            name, pcookie, pids[p] = _announced(p, infos[p], c)
            seg = Segment.open(name, keep_fd=p == 0,  # rank 0's: the group lock
                               min_size=control_size(world_size))
            peers[p] = seg
            if not control_matches(seg, pids[p], p, world_size, pcookie):
                problem = f"rank {p}'s control segment is not what it announced"
            keys[p], bases[p] = read_key(seg), name.rsplit("-", 1)[0]
        except (OSError, ValueError) as exc:
            problem = f"cannot map rank {p}'s control segment: {exc}"
    store.set(f"{key}ok/{rank}", json.dumps(problem))
    verdicts = _gather(store, f"{key}ok/", world_size, timeout, check_missing)
    ctl.unlink()  # every peer has mapped it (or given up): no name left to leak
    bad = [f"rank {p}: {v}" for p, v in enumerate(verdicts) if v]
    if bad:
        for seg in peers:
            if seg is not None:
                seg.close()
        ctl.close()
        return _unavailable("; ".join(bad))
    sigterm.install(live_transports)
    return ShmTransport(rank=rank, world_size=world_size, base=base, ctl=ctl,
                        peer_ctls=peers, peer_bases=bases, pids=pids, timeout=timeout,
                        keys=keys, first_segno=ctl_no + 1), ""


def _create_control(base: str, naming_key: bytes, world_size: int,
                    keep_fd: bool) -> tuple[Segment, int]:
    """This rank's control segment under the first free name (squatted names skipped)."""
    for segno in range(16):
        try:
            seg = Segment.create(segments.segment_name(base, naming_key, segno),
                                 control_size(world_size), keep_fd=keep_fd)
        except FileExistsError:
            continue
        seg.segno = segno
        return seg, segno
    raise segments.NamesTaken(base, 16, control_size(world_size))


def stamp_control(seg: Segment, rank: int, world_size: int, cookie: int,
                  naming_key: bytes) -> None:
    """Write the header and the naming key of a fresh control segment."""
    HEADER.pack_into(seg.mm, 0, MAGIC, os.getpid(), rank, world_size, 0, cookie)
    seg.mm[KEY_OFF:KEY_OFF + KEY_BYTES] = naming_key


def read_key(seg: Segment) -> bytes:
    """The naming key in a peer's control segment (after :func:`control_matches`)."""
    return bytes(seg.mm[KEY_OFF:KEY_OFF + KEY_BYTES])


def control_matches(seg: Segment, pid: int, rank: int, world_size: int, cookie: int) -> bool:
    """Whether a mapped control segment carries the header its owner announced."""
    magic, ppid, prank, pworld, _, pcookie = HEADER.unpack_from(seg.mm, 0)
    return (magic, ppid, prank, pworld, pcookie) == (MAGIC, pid, rank, world_size, cookie)
