"""Shared-memory transport for ranks on one host (the default for CPU tensors there).

Each rank owns a *control segment* that every peer maps; ``layout.py``
holds its every offset (header, barrier word, doorbell, status block,
descriptors, retired-segment ring, mailbox channels and slots).

Words written by one rank only (barrier, sent, acked) are plain stores;
words several ranks bump (the doorbell) use the kernel's atomic add, see
[Note: spin, then block] in ``futex.py``. Data buffers -- staging buffers and
``comm.empty`` tensors -- live in further segments that peers map lazily by
name, see [Note: segment names and leaks] in ``segments.py``.

A waiting rank reads its peers' status (``status.py``): a dead pid, or a
peer that shut gradring down or failed, ends the wait at the next 50 ms slice.
Descriptors and statuses also carry what the desync check compares, see
[Note: desync checks] in ``desync.py``.

Point-to-point messages (for ring and tree) go through the mailboxes
(``mailbox.py``, an object the transport owns): a sender copies fragments
into slots, the receiver copies (or reduces) them out.
The direct algorithms (``direct.py``) skip all that and read exposed buffers.
Ranks find each other through the store: ``rendezvous.connect``.
"""

from __future__ import annotations

import atexit
import bisect
import itertools
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from gradring.comm import desync
from gradring.comm.ops import Op
from gradring.comm.transport import CollectiveError, CollectiveInfo, Exchange
from gradring.comm.transports.shm import futex, segments, space
from gradring.comm.transports.shm import status as shm_status
from gradring.comm.transports.shm.layout import (
    BARRIER_WORD,
    CHAN_MAPPED,
    DESC,
    HEADER,
    MAGIC,
    RETIRED_RING,
    RETIRED_WORD,
    chan_word,
    desc_offset,
)
from gradring.comm.transports.shm.mailbox import Mailboxes
from gradring.comm.transports.shm.segments import Segment

_HAS_BUFFER, _ZERO_COPY, _NO_ROOM = 1, 2, 4
_MASK, _HALF = 0xFFFFFFFF, 0x80000000

#: Busy polls before yielding, then how long to poll with sched_yield before
#: sleeping in the kernel; see [Note: spin, then block].
SPIN_ITERS = 64
YIELD_S = float(os.environ.get("GRADRING_SHM_YIELD_US", "1000")) * 1e-6
#: Sleep slices: how often a blocked wait checks peer liveness and the deadline.
SLICE_S = 0.05

_DTYPE_CODES = desync.DTYPE_CODES

_live: weakref.WeakSet[ShmTransport] = weakref.WeakSet()


def _retire(name: str, segno: int, retired: deque[int], pid: int) -> None:
    """Finalizer of a ``comm.empty`` mapping: free the name, tell peers to unmap."""
    segments.unlink_quietly(name, pid)
    retired.append(segno)


class ShmTransport:
    """One rank's end of a shared-memory group. Built by ``rendezvous.connect``."""

    name = "shm"

    def __init__(self, *, rank: int, world_size: int, base: str, ctl: Segment,
                 peer_ctls: list[Segment | None], peer_bases: list[str], pids: list[int],
                 timeout: float) -> None:
        # This rank and the group size (group ranks, not global ones).
        self.rank = rank
        self.world_size = world_size
        # Name prefix of every segment this rank creates ("<base>-<segno>").
        self._base = base
        # This rank's control segment (layout in the module docstring).
        self._ctl = ctl
        # Every rank's control segment, this rank's own included.
        self._ctls = [ctl if p == rank else peer_ctls[p] for p in range(world_size)]
        # Their 32-bit word views, indexed [rank][word] in the hot loops.
        self._words = [c.words for c in self._ctls]  # type: ignore[union-attr]
        # Name prefixes of the peers' segments, to map their buffers by segno.
        self._peer_bases = peer_bases
        # Process ids, to tell a dead peer from a slow one.
        self._pids = pids
        # Seconds a collective may wait for its peers.
        self._timeout = timeout
        # Number of barriers this rank has arrived at (mirrors its barrier word).
        self._epoch = 0
        # Exchanges so far: picks the descriptor slot and staging set.
        self._exchanges = 0
        # Next segment number (0 is the control segment).
        self._segnos = itertools.count(1)
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
        # Where the buffer passed to expose() lives: (segno, offset), until exchange.
        self._exposed: tuple[int, int] | None = None
        # Collective in flight (for errors) and when it must be done.
        self._info: CollectiveInfo | None = None
        self._deadline = 0.0
        # Set after a failure: counters are out of step, every later call fails.
        self._broken: str | None = None
        # Set by abort(): a blocked wait gives up at its next slice (comm.shutdown()).
        self._abort: str | None = None
        # The process that connected: a forked child must not write our state word.
        self._pid = os.getpid()
        # Segment number of the staged buffer exposed last (peers read it after we
        # returned: close() lets them map it before the name goes).
        self._last_staged = 0
        # (seq, kind, bytes, dtype, shape hash, label hash) of the collective in flight;
        # the hashes (and their comparison) only with GRADRING_CHECK (``_full_check``).
        self._fp: tuple[int, ...] = (0,) * 6
        self._full_check = False
        # Guards allocation state touched from the caller's thread (empty()).
        self._lock = threading.Lock()
        # Bytes copied into staging so far (tests check comm.empty avoids it).
        self.staged_bytes = 0
        # Bytes of a staging buffer this rank could not reserve for the exchange in
        # progress (0: none), and bytes of /dev/shm it holds (for the advice).
        self._no_room = 0
        self.reserved = segments.page_round(ctl.size) if ctl is not None else 0
        # Point-to-point messages (ring, tree), through the control segments' slots.
        self._mail = Mailboxes(rank, self._ctls, check_sender=self._check_sender,
                               fail=self._fail, block=self._block)
        _live.add(self)

    # -- lifecycle and errors ----------------------------------------------------
    def start(self, info: CollectiveInfo) -> None:
        if self._broken is not None:
            raise CollectiveError(
                f"gradring {info.describe()}: the shared-memory transport is unusable "
                f"after an earlier failure ({self._broken})")
        self._info = info
        self._deadline = time.monotonic() + self._timeout
        full = self._full_check = desync.enabled()
        self._fp = fp = tuple(desync.fingerprint_words(
            info.seq, info.kind, info.nbytes, info.dtype, info.shape, info.label, full=full)[:6])
        shm_status.publish(self._ctl.mm, self._ctl.words, info, fp[3], fp[4])
        self._mail.begin(info.seq)

    def abort(self, reason: str) -> None:
        """Make a wait blocked in another thread raise at its next slice."""
        self._abort = reason

    def _set_state(self, state: int, why: int = 0) -> None:
        if self._ctl is not None and os.getpid() == self._pid:
            shm_status.set_state(self._ctl.words, state, why)

    def close(self) -> None:
        """Unlink every own segment and unmap everything (idempotent)."""
        if self._ctl is None:
            return
        if self._broken is None:
            self._let_peers_map()
            self._set_state(shm_status.CLOSED)  # peers still waiting for us stop at once
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
        self._words = []
        self._mail.close()
        for seg in self._ctls:
            if seg is not None:
                seg.close()
        self._ctls = []
        self._ctl = None  # type: ignore[assignment]
        self._regions = []
        self._broken = self._broken or "closed"
        _live.discard(self)

    def _let_peers_map(self, grace_s: float = 1.0) -> None:
        """Before unlinking: a collective without a closing barrier (staged one-shot)
        lets us return while peers still have to map our buffer by name. Give every
        peer that is still in that collective up to ``grace_s`` to do so."""
        segno, info = self._last_staged, self._info
        if not segno or info is None:
            return
        deadline = time.monotonic() + grace_s
        idx = chan_word(self.rank, CHAN_MAPPED)  # in each peer's own segment
        for p in range(self.world_size):
            while p != self.rank and self._words[p][idx] < segno \
                    and time.monotonic() < deadline:
                st = self._status(p)
                if st.seq != info.seq or st.state != shm_status.RUNNING \
                        or not segments.pid_alive(self._pids[p]):
                    break  # moved on (so it mapped it), never came, or gone
                time.sleep(0.001)

    def _status(self, p: int) -> shm_status.Status:
        return shm_status.read(self._ctls[p].mm, self._ctls[p].words)

    def _fail(self, what: str, waiting_for: Sequence[int],
              why: int = shm_status.LOST_PEER) -> CollectiveError:
        info = self._info.describe() if self._info else "collective"
        mine = self._info.seq if self._info else 0
        notes = [shm_status.describe(p, self._pids[p], self._status(p),
                                     alive=segments.pid_alive(self._pids[p]), seq=mine)
                 for p in sorted(waiting_for) if self._ctls]
        arrived = [p for p in range(self.world_size) if p not in waiting_for]
        msg = (f"gradring {info} failed on rank {self.rank}: ranks {sorted(waiting_for)} "
               f"did not arrive ({what}); ranks {arrived} arrived; " + "; ".join(notes))
        self._broken = msg
        self._set_state(shm_status.FAILED, why)
        return CollectiveError(msg)

    def _check_alive(self, what: str, waiting_for: Sequence[int]) -> None:
        """Raise if a peer we wait for died or left, a peer that has not reached this
        collective died or left (it never will), or any peer gave up on it."""
        if self._abort is not None:
            raise self._fail(f"{what}; aborted: {self._abort}", waiting_for,
                             shm_status.ABORTED)
        mine = self._info.seq if self._info else 0
        gone, gave_up = [], []
        for p in range(self.world_size):
            if p == self.rank:
                continue
            st = self._status(p)
            if (p in waiting_for or st.seq < mine) and (
                    st.state == shm_status.CLOSED or not segments.pid_alive(self._pids[p])):
                gone.append(p)
            elif st.state == shm_status.FAILED:
                gave_up.append(f"rank {p} {st.reason()} first")
        if gone:
            raise self._fail(what, sorted(set(gone) | set(waiting_for)))
        if gave_up:
            raise self._fail(f"{what}; " + ", ".join(gave_up), waiting_for)

    def _block(self, p: int, word: int, until: Any, what: str,
               waiting_for: Sequence[int]) -> None:
        """Wait until ``until(value of rank p's word)``: spin, yield, then sleep in
        the kernel with a deadline; see [Note: spin, then block] in ``futex.py``."""
        words = self._words[p]
        for _ in range(SPIN_ITERS):
            if until(words[word]):
                return
        clock = time.perf_counter
        yield_end = clock() + YIELD_S
        while clock() < yield_end:
            os.sched_yield()
            if until(words[word]):
                return
        addr = self._ctls[p].address + 4 * word
        while True:
            seen = words[word]
            if until(seen):
                return
            left = self._deadline - time.monotonic()
            if left <= 0:
                self._check_alive(what, waiting_for)
                raise self._fail(f"{what}, timed out after {self._timeout:g}s", waiting_for,
                                 shm_status.TIMEOUT)
            if not futex.wait(addr, seen, min(SLICE_S, left)):
                self._check_alive(what, waiting_for)

    # -- point-to-point (the mailboxes) ------------------------------------------------
    def isend(self, buf: torch.Tensor, dst: int) -> Any:
        return self._mail.isend(buf, dst)

    def irecv(self, buf: torch.Tensor, src: int, op: Op | None = None) -> Any:
        return self._mail.irecv(buf, src, op)

    def wait_all(self, reqs: Sequence[Any]) -> None:
        self._mail.wait_all(reqs)

    # -- barrier -------------------------------------------------------------------
    def arrive(self) -> None:
        self._epoch += 1
        futex.add_and_wake(self._ctl.address + 4 * BARRIER_WORD)

    def wait_arrivals(self, what: str = "at a barrier inside the collective") -> None:
        target = self._epoch
        reached = lambda v: ((v - target) & _MASK) < _HALF
        for p in range(self.world_size):
            if p != self.rank and not reached(self._words[p][BARRIER_WORD]):
                late = [q for q in range(self.world_size)
                        if q != self.rank and not reached(self._words[q][BARRIER_WORD])]
                self._block(p, BARRIER_WORD, reached, what, late)

    def barrier(self) -> None:
        self.arrive()
        self.wait_arrivals()

    # -- memory ----------------------------------------------------------------------
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
            segno = next(self._segnos)
            name = f"{self._base}-{segno}"
            try:
                raw, mm = segments.user_segment(name, nbytes)
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
        return int(seg.name.rsplit("-", 1)[1])

    def _grow_staging(self, k: int, nbytes: int) -> Segment:
        old = self._staging[k]
        size = max(nbytes, 64 * 1024, 2 * old.size if old else 0)
        with self._lock:
            seg = Segment.create(f"{self._base}-{next(self._segnos)}", size)
            self._register(seg.address, seg.size, self._segno_of(seg), seg.mm)
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
            name = f"{self._peer_bases[p]}-{segno}"
            try:
                seg = Segment.open(name)
            except OSError as exc:
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
        words = self._words[p]
        count = words[RETIRED_WORD]
        seen = self._peer_retired[p]
        if count == seen:
            return
        for i in range(max(seen, count - RETIRED_RING), count):
            self._forget_peer_segment(p, words[RETIRED_WORD + 1 + i % RETIRED_RING])
        self._peer_retired[p] = count

    def exchange(self, info: CollectiveInfo, exposed: torch.Tensor | None, *,
                 zero_copy: bool) -> Exchange:
        slot = self._exchanges & 1
        self._exchanges += 1
        if self._retired:
            self._announce_retired()
        nbytes, dcode = info.nbytes, _DTYPE_CODES.get(info.dtype, 0)
        flags, segno, offset = 0, 0, 0
        self._last_staged = 0
        if self._no_room:
            flags, offset, exposed = _NO_ROOM, self._no_room, None
            self._no_room = 0
        elif exposed is not None:
            loc = self._exposed or self.locate(exposed)
            assert loc is not None, "exchange() of a buffer expose() did not return"
            segno, offset = loc
            flags = _HAS_BUFFER | (_ZERO_COPY if zero_copy else 0)
            self._last_staged = 0 if zero_copy else segno
        self._exposed = None
        desc_off = desc_offset(slot)
        DESC.pack_into(self._ctl.mm, desc_off, info.seq, int(info.kind), flags, nbytes,
                        dcode, segno, offset, self._fp[4], self._fp[5])
        self.arrive()
        self.wait_arrivals("at the start of the collective")
        self._check_room(desc_off, flags, offset)
        views: list[torch.Tensor | None] = []
        any_zero_copy = zero_copy
        for p in range(self.world_size):
            if p == self.rank:
                views.append(exposed)
                continue
            seq, kind, pflags, pbytes, pcode, psegno, poff, pshape, plabel = DESC.unpack_from(
                self._ctls[p].mm, desc_off)
            theirs = (seq, kind, pbytes, pcode, pshape, plabel)
            if theirs[:4] != (info.seq, int(info.kind), nbytes, dcode) or \
                    self._full_check and theirs[4:] != self._fp[4:]:
                self._desync(p, theirs)
            if self._peer_retired[p] != self._words[p][RETIRED_WORD]:
                self._collect_retired(p)
            if not pflags & _HAS_BUFFER:
                views.append(None)
                continue
            if not pflags & _ZERO_COPY:
                old = self._peer_staging[p][slot]
                if old != psegno:  # the peer grew this staging set: drop the old map
                    self._forget_peer_segment(p, old)
                    self._peer_staging[p][slot] = psegno
            else:
                any_zero_copy = True
            views.append(self._view(p, self._peer_segment(p, psegno), psegno, poff, pbytes,
                                    info.dtype))
        return Exchange(views, any_zero_copy)

    def _check_room(self, desc_off: int, flags: int, needed: int) -> None:
        """Every rank reads every descriptor after the start barrier: if any rank had
        no room for its buffer, all of them raise :class:`space.ShmExhausted` here."""
        short = {self.rank: needed} if flags & _NO_ROOM else {}
        for p in range(self.world_size):
            if p != self.rank:
                _, _, pflags, _, _, _, poff, _, _ = DESC.unpack_from(self._ctls[p].mm, desc_off)
                if pflags & _NO_ROOM:
                    short[p] = poff
        if short:
            info = self._info.describe() if self._info else "collective"
            need = max(short.values())
            raise space.ShmExhausted(
                f"gradring {info}: ranks {sorted(short)} could not reserve a "
                f"{need}-byte buffer in {segments.SHM_DIR}", need)

    def release_for_fallback(self) -> None:
        """Every rank gave shared memory up in the same collective: close without
        waiting for peers to map a staged buffer (none of them will)."""
        self._last_staged = 0
        self.close()

    def _desync(self, p: int, theirs: Sequence[int]) -> None:
        info = self._info
        assert info is not None
        err = desync.mismatch(info, self.rank, p, theirs,
                              desync.difference(self._fp, theirs) or "descriptors")
        self._broken = str(err)
        self._set_state(shm_status.FAILED, shm_status.DESYNC)
        raise err

    def _check_sender(self, src: int) -> None:
        """Before consuming ``src``'s first message of this collective: same collective?"""
        info = self._info
        assert info is not None
        st = self._status(src)
        if st.seq > info.seq:
            return  # it finished this collective and moved on; the message is ours
        theirs = (st.seq, st.kind, st.nbytes, st.dtype, st.shape, self._fp[5])
        if theirs[:4] != self._fp[:4] or self._full_check and theirs != self._fp:
            self._desync(src, theirs)


def stamp_control(seg: Segment, rank: int, world_size: int, cookie: int) -> None:
    """Write the header of a fresh control segment."""
    HEADER.pack_into(seg.mm, 0, MAGIC, os.getpid(), rank, world_size, 0, cookie)


def control_matches(seg: Segment, pid: int, rank: int, world_size: int, cookie: int) -> bool:
    """Whether a mapped control segment carries the header its owner announced."""
    magic, ppid, prank, pworld, _, pcookie = HEADER.unpack_from(seg.mm, 0)
    return (magic, ppid, prank, pworld, pcookie) == (MAGIC, pid, rank, world_size, cookie)


@atexit.register
def _close_all() -> None:
    for t in list(_live):
        t.close()
