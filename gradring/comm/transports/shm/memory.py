"""The shm transport's data memory: its own segments and the peers' it maps.

:class:`SegmentBook`, owned by the transport (``transport.memory``), holds the
``comm.empty`` segments, the two staging sets, the address index that makes a
tensor zero-copy, and the peers' segments mapped lazily by number, with the
retired-segment announcements that say when a peer may unmap one. The
transport hands it the control segments' word views and two ways to fail.
"""

from __future__ import annotations

import bisect
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from gradring.comm.transports.shm import segments, space
from gradring.comm.transports.shm.layout import (
    CHAN_MAPPED,
    RETIRED_RING,
    RETIRED_WORD,
    chan_word,
)
from gradring.comm.transports.shm.segments import Segment

_MASK = 0xFFFFFFFF


def _retire(name: str, segno: int, retired: deque[int], pid: int) -> None:
    """Finalizer of a ``comm.empty`` mapping: free the name, tell peers to unmap."""
    segments.unlink_quietly(name, pid)
    retired.append(segno)


class SegmentBook:
    """Own and peers' data segments of one rank's shm transport (see the module)."""

    def __init__(self, *, rank: int, world_size: int, base: str, keys: list[bytes],
                 peer_bases: list[str], words: list[Any], first_segno: int, reserved: int,
                 cannot_map: Callable[[int, str, Exception], Exception],
                 bad_peer: Callable[[int, str], Exception]) -> None:
        # This rank and the group size (group ranks).
        self.rank = rank
        self.world_size = world_size
        # Name prefix of every segment this rank creates.
        self._base = base
        # Every rank's naming key (read from its control segment, never the store):
        # turns (prefix, segno) into that rank's names (segments.segment_name).
        self._keys = keys
        # Name prefixes of the peers' segments, to map their buffers by segno.
        self._peer_bases = peer_bases
        # Every rank's control-segment words: the mapped and retired words live there.
        self._words = words
        # Exchanges so far: picks the descriptor slot and staging set (see outgoing()).
        self._exchanges = 0
        # Next segment number (those below are the control segment or were squatted).
        self._next_segno = first_segno
        # Two staging segments, used alternately (see [Note: direct algorithms]).
        self._staging: list[Segment | None] = [None, None]
        # Own data memory, sorted by address: (start, end, segno, weakref to mapping).
        self._regions: list[tuple[int, int, int, Any]] = []
        # Finalizers of comm.empty segments, to unlink them at close.
        self._finalizers: list[weakref.finalize] = []
        # Segment numbers of freed comm.empty mappings, to announce to peers.
        self._retired: deque[int] = deque()
        # Count of retirements announced in the control segment so far.
        self._retired_count = 0
        # Peers' data segments mapped here: [rank] -> {segno: Segment}.
        self._peer_segs: list[dict[int, Segment]] = [{} for _ in range(world_size)]
        # Which segno each peer last used for each staging set, to unmap old ones.
        self._peer_staging: list[list[int]] = [[0, 0] for _ in range(world_size)]
        # Retirements seen per peer.
        self._peer_retired = [0] * world_size
        # Typed views of buffers, reused while sizes repeat: (rank, segno, offset,
        # nbytes, dtype) -> tensor. Cleared before any segment is unmapped.
        self._views: dict[tuple[int, int, int, int, torch.dtype], torch.Tensor] = {}
        # Where the buffer passed to expose() lives: (segno, offset), until outgoing().
        self._exposed: tuple[int, int] | None = None
        # Bytes of a staging buffer this rank could not reserve for the exchange in
        # progress (0: none), see space.py.
        self._no_room = 0
        # Whether that was a process limit (open files...), not /dev/shm's room.
        self.no_room_limit = False
        # Guards allocation state touched from the caller's thread (empty()).
        self._lock = threading.Lock()
        # Bytes of /dev/shm this rank holds (for the advice when it runs out).
        self.reserved = reserved
        # Bytes copied into staging so far (tests check comm.empty avoids it).
        self.staged_bytes = 0
        # The transport's errors: a peer's segment cannot be mapped (``(peer, name,
        # exc)``), or a peer published something impossible (``(peer, what)``).
        self._cannot_map = cannot_map
        self._bad_peer = bad_peer

    def _register(self, start: int, nbytes: int, segno: int, mapping: Any) -> None:
        self._regions = [r for r in self._regions if r[3]() is not None]
        bisect.insort(self._regions, (start, start + nbytes, segno, weakref.ref(mapping)))

    def locate(self, t: torch.Tensor) -> tuple[int, int] | None:
        """``(segno, offset)`` if ``t``'s bytes lie in this rank's shared memory."""
        nbytes = t.numel() * t.element_size()
        if not nbytes:
            return None
        ptr = t.data_ptr()
        regions = self._regions
        i = bisect.bisect_right(regions, (ptr, _MASK << 32)) - 1
        if i >= 0:
            start, end, segno, ref = regions[i]
            if ptr + nbytes <= end and ref() is not None:
                return segno, ptr - start
        return None

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat tensor in a fresh segment of this rank: zero-copy for collectives."""
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        if nbytes == 0:
            return torch.empty(numel, dtype=dtype)
        with self._lock:
            try:
                segno, name, (raw, mm) = self._fresh(
                    lambda name: segments.user_segment(name, nbytes), nbytes)
            except segments.ShmFull as exc:  # ordinary memory: collectives on it are staged
                space.warn_once(space.explain(exc, self.reserved, self.world_size, self.rank)
                                + "; comm.empty() returns ordinary memory meanwhile (and "
                                "collectives fall back to the process group if staging "
                                "does not fit either)")
                return torch.empty(numel, dtype=dtype)
            self.reserved += len(mm)
            self._finalizers.append(
                weakref.finalize(mm, _retire, name, segno, self._retired, os.getpid()))
            self._register(raw.data_ptr(), len(mm), segno, mm)
        return raw.view(dtype)

    def expose(self, flat: torch.Tensor, *,
               force_staging: bool = False) -> tuple[torch.Tensor, bool]:
        """``DirectTransport.expose``: ``flat`` itself if it lies in this rank's shared
        memory, else the staging set of the next exchange (grown to fit)."""
        nbytes = flat.numel() * flat.element_size()
        if not force_staging:
            loc = self.locate(flat)
            if loc is not None:
                self._exposed = loc
                return flat, True
        k = self._exchanges & 1
        seg = self._staging[k]
        if seg is None or seg.size < nbytes:
            try:
                seg = self._grow_staging(k, nbytes)
            except segments.ShmFull as exc:
                # Tell the peers in the exchange (see space.py); fill a scratch buffer.
                if isinstance(exc, (segments.NamesTaken, segments.LimitReached)):
                    # Say why here (taken names, a process limit); peers see "no room".
                    space.warn_once(space.explain(exc, self.reserved, self.world_size)
                                    + "; gradring runs this group's collectives over the "
                                    "process group instead (slower)")
                self._no_room = exc.needed
                self.no_room_limit = isinstance(exc, segments.LimitReached)
                return torch.empty(flat.numel(), dtype=flat.dtype), False
        segno = seg.segno
        self._exposed = (segno, 0)
        self.staged_bytes += nbytes
        return self._view(self.rank, seg, segno, 0, nbytes, flat.dtype), False

    def _view(self, p: int, seg: Segment, segno: int, offset: int, nbytes: int,
              dtype: torch.dtype) -> torch.Tensor:
        key = (p, segno, offset, nbytes, dtype)
        view = self._views.get(key)
        if view is None:
            if len(self._views) > 256:
                self._views.clear()
            view = self._views[key] = seg.view(offset, nbytes, dtype)
        return view

    def _fresh(self, make: Any, nbytes: int) -> tuple[int, str, Any]:
        """``(segno, name, make(name))`` for the next segment number whose name is free:
        a name someone else created first (``FileExistsError``) is skipped; 16 in a row
        raise :class:`~segments.NamesTaken` (the caller falls back, see ``space.py``)."""
        key = self._keys[self.rank]
        for _ in range(16):
            segno = self._next_segno
            self._next_segno += 1
            name = segments.segment_name(self._base, key, segno)
            try:
                return segno, name, make(name)
            except FileExistsError:
                continue  # squatted (or left over): the next number has another name
        raise segments.NamesTaken(self._base, 16, nbytes)

    def _grow_staging(self, k: int, nbytes: int) -> Segment:
        old = self._staging[k]
        size = max(nbytes, 64 * 1024, 2 * old.size if old else 0)
        with self._lock:
            segno, _, seg = self._fresh(lambda name: Segment.create(name, size), size)
            seg.segno = segno
            self._register(seg.address, seg.size, segno, seg.mm)
        self.reserved += seg.size - (old.size if old else 0)
        self._staging[k] = seg
        self._views.clear()
        if old is not None:
            # Safe: peers finished the collective that used it (module note).
            old.close()
        return seg

    def _map_peer(self, p: int, segno: int) -> Segment:
        """Map rank ``p``'s segment ``segno`` (first use) and tell ``p`` it may unlink it."""
        name = segments.segment_name(self._peer_bases[p], self._keys[p], segno)
        try:
            seg = Segment.open(name)
            seg.segno = segno
        except (OSError, ValueError) as exc:
            raise self._cannot_map(p, name, exc) from exc
        self._peer_segs[p][segno] = seg
        mine, idx = self._words[self.rank], chan_word(p, CHAN_MAPPED)
        if segno > mine[idx]:
            mine[idx] = segno  # p may unlink it now, see ShmTransport._let_peers_map
        return seg

    def _forget_peer_segment(self, p: int, segno: int) -> None:
        seg = self._peer_segs[p].pop(segno, None)
        if seg is not None:
            self._views.clear()
            seg.close()

    # -- exchange ----------------------------------------------------------------------
    def outgoing(self, exposed: torch.Tensor | None) -> tuple[int, int, int, int]:
        """At the start of an exchange: announce retired segments, and take what
        ``expose()`` left. ``(slot, no_room, segno, offset)``: the descriptor slot and
        staging set of this exchange, the bytes this rank could not reserve (0: it
        could), and where ``exposed`` lives (zeros for None)."""
        slot = self._exchanges & 1
        self._exchanges += 1
        if self._retired:
            self._announce_retired()
        no_room, segno, offset = self._no_room, 0, 0
        if no_room:
            self._no_room = 0
        elif exposed is not None:
            loc = self._exposed or self.locate(exposed)
            assert loc is not None, "exchange() of a buffer expose() did not return"
            segno, offset = loc
        self._exposed = None
        return slot, no_room, segno, offset

    def peer_view(self, p: int, slot: int, staged: bool, segno: int, offset: int,
                  nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """Rank ``p``'s buffer as its descriptor in ``slot`` gives it (``staged``: in its
        staging set, not ``comm.empty`` memory), mapped on first use."""
        if self._peer_retired[p] != self._words[p][RETIRED_WORD]:
            self._collect_retired(p)
        if staged:
            old = self._peer_staging[p][slot]
            if old != segno:  # the peer grew this staging set: drop the old map
                self._forget_peer_segment(p, old)
                self._peer_staging[p][slot] = segno
        seg = self._peer_segs[p].get(segno)
        if seg is None:
            seg = self._map_peer(p, segno)
        if offset + nbytes > seg.size:  # offsets are unsigned: only the end can overflow
            raise self._bad_peer(p, f"its descriptor points past the end of its segment "
                                    f"{seg.name} (bytes {offset}..{offset + nbytes} of "
                                    f"{seg.size})")
        return self._view(p, seg, segno, offset, nbytes, dtype)

    def collect_retired(self, p: int) -> None:
        """Unmap what rank ``p`` retired, if anything (a peer that exposed no buffer)."""
        if self._peer_retired[p] != self._words[p][RETIRED_WORD]:
            self._collect_retired(p)

    def _announce_retired(self) -> None:
        words = self._words[self.rank]
        while self._retired:
            segno = self._retired.popleft()
            words[RETIRED_WORD + 1 + self._retired_count % RETIRED_RING] = segno
            self._retired_count += 1
            words[RETIRED_WORD] = self._retired_count & _MASK

    def _collect_retired(self, p: int) -> None:
        """Unmap what rank ``p`` retired since we last looked. The ring holds the last
        ``RETIRED_RING`` numbers, which ``p`` may overwrite as we read (it can be one
        collective ahead); if more were retired, every mapping of ``p``'s
        ``comm.empty`` segments goes (live ones are mapped again when next used)."""
        words = self._words[p]
        count = words[RETIRED_WORD]
        seen = self._peer_retired[p]
        if count == seen:
            return
        lost = ((count - seen) & _MASK) > RETIRED_RING
        if not lost:
            segnos = [words[RETIRED_WORD + 1 + i % RETIRED_RING]
                      for i in range(seen, seen + ((count - seen) & _MASK))]
            lost = ((words[RETIRED_WORD] - seen) & _MASK) > RETIRED_RING  # overwritten?
        if lost:
            keep = set(self._peer_staging[p])
            segnos = [n for n in self._peer_segs[p] if n not in keep]
        for segno in segnos:
            self._forget_peer_segment(p, segno)
        self._peer_retired[p] = count

    # -- names and release --------------------------------------------------------------
    def next_names(self, count: int) -> list[str]:
        """The names the next ``count`` segments of this rank will try, in order."""
        return [segments.segment_name(self._base, self._keys[self.rank], self._next_segno + i)
                for i in range(count)]

    def remove_dead_peer_names(self, dead: list[int]) -> None:
        """Unlink what the dead peers ``dead`` left in /dev/shm (see [Note: segment names
        and leaks]). Safe from a signal handler."""
        for p in dead:
            if p != self.rank:
                segments.remove_dead_owners(self._peer_bases[p])

    def staging_size(self, segno: int) -> int:
        """Bytes of this rank's staging segment ``segno`` (0 if it is none of them)."""
        return next((seg.size for seg in self._staging
                     if seg is not None and seg.segno == segno), 0)

    def release_names(self, pid: int) -> None:
        """Unlink the name of every own data segment (mappings stay). Safe from a signal
        handler."""
        for fin in list(self._finalizers):
            found = fin.peek()
            if found is not None:
                segments.unlink_quietly(found[2][0], pid)
        for seg in self._staging:
            if seg is not None:
                seg.unlink()

    def close(self) -> None:
        """Unlink every own segment and unmap everything, own and peers'."""
        for fin in self._finalizers:
            fin()
        self._finalizers = []
        self._views.clear()
        for seg in self._staging:
            if seg is not None:
                seg.close()
        self._staging = [None, None]
        for segs in self._peer_segs:
            for seg in segs.values():
                seg.close()
            segs.clear()
        self._regions = []
        self._words = []
