"""The shm transport's data memory: its own segments and the peers' it maps.

A mixin of :class:`~gradring.comm.transports.shm.transport.ShmTransport`
(which owns every attribute used here): ``comm.empty`` segments, the two
staging sets, the address index that makes a tensor zero-copy, and the
peers' segments mapped lazily by number -- with the retired-segment
announcements that tell a peer when it may unmap one (see [Note: segment
names and leaks] in ``segments.py``).
"""

from __future__ import annotations

import bisect
import os
import weakref
from collections import deque
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
    """Own and peers' data segments of one shm transport (a mixin, see the module)."""

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
                    lambda name: segments.user_segment(name, nbytes))
            except segments.ShmFull as exc:  # ordinary memory: collectives on it are staged
                space.warn_once(space.advice(exc.needed, self.reserved, self.world_size)
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
                self._no_room = exc.needed
                return torch.empty(flat.numel(), dtype=flat.dtype), False
        segno = self._segno_of(seg)
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

    def _segno_of(self, seg: Segment) -> int:
        return seg.segno

    def _fresh(self, make: Any) -> tuple[int, str, Any]:
        """``(segno, name, make(name))`` for the next segment number whose name is free:
        a name someone else created first (``FileExistsError``) is skipped."""
        for _ in range(16):
            segno = next(self._segnos)
            name = segments.segment_name(self._base, self._secret, segno)
            try:
                return segno, name, make(name)
            except FileExistsError:
                continue  # squatted (or left over): the next number has another name
        raise FileExistsError(f"16 fresh shared-memory names of {self._base} all exist "
                              f"already in {segments.SHM_DIR}: is someone squatting them?")

    def _grow_staging(self, k: int, nbytes: int) -> Segment:
        old = self._staging[k]
        size = max(nbytes, 64 * 1024, 2 * old.size if old else 0)
        with self._lock:
            segno, _, seg = self._fresh(lambda name: Segment.create(name, size))
            seg.segno = segno
            self._register(seg.address, seg.size, segno, seg.mm)
        self.reserved += seg.size - (old.size if old else 0)
        self._staging[k] = seg
        self._views.clear()
        if old is not None:
            # Safe: peers finished the collective that used it (module note).
            old.close()
        return seg

    def _peer_segment(self, p: int, segno: int) -> Segment:
        seg = self._peer_segs[p].get(segno)
        if seg is None:
            name = segments.segment_name(self._peer_bases[p], self._secret, segno)
            try:
                seg = Segment.open(name)
                seg.segno = segno
            except (OSError, ValueError) as exc:
                self._check_alive(f"mapping {name}", [p])
                raise self._fail(f"cannot map its segment {name}: {exc}", [p]) from exc
            self._peer_segs[p][segno] = seg
            mine, idx = self._words[self.rank], chan_word(p, CHAN_MAPPED)
            if segno > mine[idx]:
                mine[idx] = segno  # p may unlink it now, see _let_peers_map
        return seg

    def _forget_peer_segment(self, p: int, segno: int) -> None:
        seg = self._peer_segs[p].pop(segno, None)
        if seg is not None:
            self._views.clear()
            seg.close()

    # -- exchange ----------------------------------------------------------------------
    def _announce_retired(self) -> None:
        words = self._ctl.words
        while self._retired:
            segno = self._retired.popleft()
            words[RETIRED_WORD + 1 + self._retired_count % RETIRED_RING] = segno
            self._retired_count += 1
            words[RETIRED_WORD] = self._retired_count & _MASK

    def _collect_retired(self, p: int) -> None:
        """Unmap what rank ``p`` retired since we last looked.

        The ring holds the last ``RETIRED_RING`` numbers only, and ``p`` may
        overwrite slots while we read them (it can be one collective ahead). If
        more were retired than the ring holds, the missed numbers are unknown:
        then every mapping of ``p``'s ``comm.empty`` segments goes (live ones are
        mapped again by name when next used), so nothing leaks however many
        buckets are freed at once."""
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

