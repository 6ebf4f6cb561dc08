"""Connecting a shared-memory group: the rendezvous through the process group's store.

Three rounds of store keys, all under a prefix private to this instance of
the group (``gradring/shm/<generation>/``; the generation comes from an
atomic counter, so re-creating a group, or a fresh process group on an old
store, never reads stale keys):

1. ``info/<rank>``: the host identity (``topology.host_identity``: hostname,
   boot id, network and pid namespaces, the ``/dev/shm`` device), pid, a
   random secret (rank 0's keys every segment name, see [Note: segment names
   and leaks]). Shared memory is used only if all ranks have the same host
   identity (and the CPU is x86-64, see ``futex.py``). Every rank sees the same data, so every
   rank reaches the same verdict and none waits for a transport the others
   gave up on.
2. ``ctl/<rank>``: the name prefix of the rank's segments, the number of its
   control segment and a random cookie written into it.
3. ``ok/<rank>``: whether this rank could map every peer's control segment
   and read the right cookie back -- the proof that /dev/shm really is shared
   (two containers may share a hostname but not /dev/shm).

Afterwards every control segment is unlinked: all peers hold a mapping, so a
``kill -9`` cannot leak it.
"""

from __future__ import annotations

import itertools
import json
import os
import secrets
from datetime import timedelta
from typing import Any

from gradring.comm.store import instance_prefix
from gradring.comm.transports.shm import futex, segments, sigterm, space
from gradring.comm.transports.shm.layout import HEADER, MAGIC, control_size
from gradring.comm.transports.shm.segments import Segment
from gradring.comm.transports.shm.transport import ShmTransport, live_transports
from gradring.comm.transports.topology import host_identity

_transport_counter = itertools.count()
_cleaned = False


def _gather(store: Any, prefix: str, world_size: int, timeout: float) -> list[Any]:
    keys = [f"{prefix}{p}" for p in range(world_size)]
    store.wait(keys, timedelta(seconds=timeout))
    return [json.loads(store.get(k)) for k in keys]


def _cleanup_once() -> None:
    global _cleaned
    if not _cleaned:
        _cleaned = True
        segments.remove_stale_segments()


def connect(store: Any, rank: int, world_size: int, timeout: float) -> tuple[
        ShmTransport | None, str]:
    """Rendezvous through ``store`` (a store private to the group); collective.

    Returns ``(transport, "")``, or ``(None, reason)`` when the ranks do not
    share a host. At the first connect in a process, segments left by dead
    processes are removed (see [Note: segment names and leaks]).
    """
    key = instance_prefix(store, "shm", world_size)  # one generation per group instance
    me = dict(host_identity(), pid=os.getpid(), secret=secrets.token_hex(16))
    store.set(f"{key}info/{rank}", json.dumps(me))
    infos = _gather(store, f"{key}info/", world_size, timeout)
    ident = host_identity()
    others = [p for p, i in enumerate(infos) if {k: i[k] for k in ident} != ident]
    if not futex.AVAILABLE:
        return None, "shared-memory futexes need Linux on x86-64"
    if others:
        return None, f"ranks {others} run on another host, boot or pid namespace"
    _cleanup_once()
    base = segments.segment_base(os.getpid(), ident["pidns"], next(_transport_counter))
    secret = str(infos[0]["secret"])  # the job's naming key: never in a name
    cookie = secrets.randbits(63)
    ctl: Segment | None = None
    try:
        ctl, ctl_no = _create_control(base, secret, world_size, rank == 0)
        stamp_control(ctl, rank, world_size, cookie)
        mine = {"base": base, "ctl": ctl_no, "cookie": cookie}
    except OSError as exc:  # e.g. /dev/shm full: everybody falls back together
        mine = {"error": str(exc)}
        if isinstance(exc, segments.ShmFull):
            mine["needed"] = exc.needed
    store.set(f"{key}ctl/{rank}", json.dumps(mine))
    ctls = _gather(store, f"{key}ctl/", world_size, timeout)
    failed = [f"rank {p}: {c['error']}" for p, c in enumerate(ctls) if "error" in c]
    if failed or ctl is None:
        if ctl is not None:
            ctl.close()
        short = [c["needed"] for c in ctls if "needed" in c]
        if short:
            space.warn_once(space.advice(max(short), 0, world_size) + "; gradring uses the "
                            "process group's transport instead (slower)")
        return None, "cannot create control segments: " + "; ".join(failed)
    peers: list[Segment | None] = [None] * world_size
    problem = ""
    for p, c in enumerate(ctls):
        if p == rank:
            continue
        try:
            name = segments.segment_name(segments.check_name(c["base"]), secret, int(c["ctl"]))
            seg = Segment.open(name, keep_fd=p == 0,  # rank 0's: the group lock
                               min_size=control_size(world_size))
            peers[p] = seg
            if not control_matches(seg, infos[p]["pid"], p, world_size, c["cookie"]):
                problem = f"rank {p}'s control segment is not what it announced"
        except (OSError, ValueError) as exc:
            problem = f"cannot map rank {p}'s control segment: {exc}"
    store.set(f"{key}ok/{rank}", json.dumps(problem))
    verdicts = _gather(store, f"{key}ok/", world_size, timeout)
    ctl.unlink()  # every peer has mapped it (or given up): no name left to leak
    bad = [f"rank {p}: {v}" for p, v in enumerate(verdicts) if v]
    if bad:
        for seg in peers:
            if seg is not None:
                seg.close()
        ctl.close()
        return None, "; ".join(bad)
    sigterm.install(live_transports)
    return ShmTransport(rank=rank, world_size=world_size, base=base, ctl=ctl,
                        peer_ctls=peers, peer_bases=[c["base"] for c in ctls],
                        pids=[i["pid"] for i in infos], timeout=timeout, secret=secret,
                        first_segno=ctl_no + 1), ""


def _create_control(base: str, secret: str, world_size: int,
                    keep_fd: bool) -> tuple[Segment, int]:
    """This rank's control segment under the first free name (squatted names skipped)."""
    for segno in range(16):
        try:
            seg = Segment.create(segments.segment_name(base, secret, segno),
                                 control_size(world_size), keep_fd=keep_fd)
        except FileExistsError:
            continue
        seg.segno = segno
        return seg, segno
    raise FileExistsError(f"16 fresh control-segment names of {base} all exist already")


def stamp_control(seg: Segment, rank: int, world_size: int, cookie: int) -> None:
    """Write the header of a fresh control segment."""
    HEADER.pack_into(seg.mm, 0, MAGIC, os.getpid(), rank, world_size, 0, cookie)


def control_matches(seg: Segment, pid: int, rank: int, world_size: int, cookie: int) -> bool:
    """Whether a mapped control segment carries the header its owner announced."""
    magic, ppid, prank, pworld, _, pcookie = HEADER.unpack_from(seg.mm, 0)
    return (magic, ppid, prank, pworld, pcookie) == (MAGIC, pid, rank, world_size, cookie)
