"""Shared-memory transport for ranks on one host (the default for CPU tensors there).

Each rank owns a *control segment* that every peer maps (every offset in
``layout.py``). Words one rank writes (barrier, sent, acked) are plain stores;
words several ranks bump (the doorbell) use the kernel's atomic add ([Note:
spin, then block] in ``futex.py``). Data buffers live in further segments that
peers map lazily by name (``memory.py``, owned as ``transport.memory``). A
waiting rank reads its peers' status (``status.py``): a dead pid, or a peer
that shut gradring down or failed, ends the wait at the next 50 ms slice.
Ring and tree messages go through the mailboxes (``mailbox.py``); the direct
algorithms read exposed buffers. Ranks find each other through
``rendezvous.connect``.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from gradring import config
from gradring.comm import desync
from gradring.comm.ops import Op
from gradring.comm.transport import Collective, CollectiveError, Exchange
from gradring.comm.transports.shm import futex, segments, space, verdict
from gradring.comm.transports.shm import status as shm_status
from gradring.comm.transports.shm.layout import (
    BARRIER_WORD,
    CHAN_MAPPED,
    DESC,
    INLINE_BYTES,
    chan_word,
    desc_offset,
    inline_offset,
)
from gradring.comm.transports.shm.mailbox import Mailboxes
from gradring.comm.transports.shm.memory import SegmentBook
from gradring.comm.transports.shm.segments import Segment

_HAS_BUFFER, _ZERO_COPY, _NO_ROOM, _INLINE, _AT_LIMIT = 1, 2, 4, 8, 16
_MASK, _HALF = 0xFFFFFFFF, 0x80000000

#: Busy polls before yielding, then how long to poll with sched_yield before
#: sleeping in the kernel (``GRADRING_SHM_YIELD_US``); see [Note: spin, then
#: block]. Short, because inside DDP a bucket's collective mostly waits for the
#: peer's backward to reach the same bucket, milliseconds later, and each yield
#: hands the GIL to the backward's hooks and takes it back; long enough that a
#: small all-reduce whose peer is already there never sleeps. 50 us beat 1 ms
#: and sleeping at once, and 500 us or 3 ms did no better (the figures are in
#: benchmarks/results/2026-12-04-yield-window-under-load.md).
SPIN_ITERS = 64
YIELD_S = config.current().shm_yield_us * 1e-6
#: Sleep slices: how often a blocked wait checks peer liveness and the deadline.
SLICE_S = 0.05
#: A ``sched_yield`` that returns later than this gave the core to another process;
#: two such within ``_CONFIRM_S`` mark the core contended, and then the yield window
#: is skipped for ``_CONTENDED_S``.
_LOST_CORE_S = 100e-6
_CONFIRM_S = 0.05
_CONTENDED_S = 0.5
#: Only the main thread's waits judge the core: the comm thread's yields hand the
#: core to the process's own training thread, which is what they are for.
_MAIN = threading.main_thread()
#: Busy polls before sleeping while the core is contended.
_CONTENDED_SPIN = 4

_DTYPE_CODES = desync.DTYPE_CODES

_live: weakref.WeakSet[ShmTransport] = weakref.WeakSet()


class _Settled(Exception):  # noqa: N818 - control flow, never escapes this module
    """Raised by ``_fail`` when, under the group lock, the barrier turned out complete."""


class ShmTransport:
    """One rank's end of a shared-memory group. Built by ``rendezvous.connect``."""

    name = "shm"

    def __init__(self, *, rank: int, world_size: int, base: str, ctl: Segment,
                 peer_ctls: list[Segment | None], peer_bases: list[str], pids: list[int],
                 timeout: float, keys: list[bytes], first_segno: int = 1) -> None:
        # This rank and the group size (group ranks, not global ones).
        self.rank = rank
        self.world_size = world_size
        # This rank's control segment (layout in the module docstring).
        self._ctl = ctl
        # Every rank's control segment, this rank's own included.
        self._ctls = [ctl if p == rank else peer_ctls[p] for p in range(world_size)]
        # Their 32-bit word views, indexed [rank][word] in the hot loops.
        self._words = [c.words for c in self._ctls]  # type: ignore[union-attr]
        self._own_words = ctl.words
        self._wake_barrier = futex.Waker(ctl.address + 4 * BARRIER_WORD)
        # Every rank's two inline data slots as byte tensors, [rank][slot]
        # (see ``exchange_inline``).
        self._inline = [[c.bytes[inline_offset(world_size, k):  # type: ignore[union-attr]
                                 inline_offset(world_size, k) + INLINE_BYTES]
                         for k in (0, 1)] for c in self._ctls]
        # This rank's inline slots' addresses, and typed views of every rank's slots by
        # (slot, shape, dtype), made once: slicing a tensor costs more than the copy.
        self._inline_addr = [ctl.address + inline_offset(world_size, k) for k in (0, 1)]
        self._inline_views: dict[tuple[int, torch.Size, torch.dtype], list[torch.Tensor]] = {}
        # Process ids, to tell a dead peer from a slow one.
        self._pids = pids
        # Seconds a collective may wait for its peers.
        self._timeout = timeout
        # Number of barriers this rank has arrived at (mirrors its barrier word).
        self._epoch = 0
        # Collective in flight (for errors) and when it must be done.
        self._info: Collective | None = None
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
        # The data segments, own and peers' (``memory.py``); the transport's
        # ``expose``, ``empty`` and ``locate`` are its methods, bound here so the
        # collective path makes no extra call.
        self.memory = SegmentBook(
            rank=rank, world_size=world_size, base=base, keys=keys,
            peer_bases=peer_bases, words=self._words, first_segno=first_segno,
            reserved=segments.page_round(ctl.size) if ctl is not None else 0,
            cannot_map=self._cannot_map, bad_peer=self._fail_peer)
        self.expose = self.memory.expose
        self.empty = self.memory.empty
        self.locate = self.memory.locate
        # Point-to-point messages (ring, tree), through the control segments' slots.
        self._mail = Mailboxes(rank, self._ctls, check_sender=self._check_sender,
                               fail=self._fail, block=self._block)
        # The group's verdict (rank 0's words) and its lock: see [Note: sticky failures].
        self._leader = self._words[0]
        self._glock = verdict.GroupLock(self._ctls[0].fd,  # type: ignore[union-attr]
                                        self._leader, rank)
        # While a barrier wait runs: "has everybody arrived?", re-checked under the lock
        # before this rank fails the barrier.
        self._settle: Any = None
        # Whether the collective in flight did data work after its last barrier (then
        # ``finish`` adds the closing barrier).
        self._open = False
        # Until when (``time.perf_counter``) waits skip the yield window: a yield lost
        # the core to another process (see [Note: yield only while it is free]).
        self._contended_until = 0.0
        self._lost_core_at = -1.0
        # A collective is between start() and a successful finish() (SIGTERM reports it).
        self._busy = False
        _live.add(self)

    # -- lifecycle and errors ----------------------------------------------------
    def start(self, info: Collective) -> None:
        if self._broken is not None:
            raise CollectiveError(
                f"gradring {info.describe()}: the shared-memory transport is unusable "
                f"after an earlier failure ({self._broken})")
        self._info = info
        self._deadline = time.monotonic() + self._timeout
        self._open = False
        self._busy = True
        first = verdict.read(self._leader)
        if first is not None:
            raise self._fail_sticky(first)
        full = self._full_check = desync.enabled()
        self._fp = fp = tuple(desync.fingerprint_words(
            info.seq, info.kind, info.nbytes, info.dtype, info.shape, info.label, full=full)[:6])
        shm_status.publish(self._ctl.mm, self._ctl.words, info, fp[3], fp[4])
        self._mail.begin(info.seq)

    def usable(self) -> bool:
        """Neither failed nor closed (a call may still find the group failed by a peer)."""
        return self._broken is None

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
        if os.getpid() == self._pid:
            self.memory.remove_dead_peer_names(self._dead_peers())  # killed peers' names
        self.memory.close()
        self._words = []
        self._inline = []
        self._inline_views = {}
        self._mail.close()
        for seg in self._ctls:
            if seg is not None:
                seg.close()
        self._ctls = []
        self._ctl = None  # type: ignore[assignment]
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

    def _note(self, p: int, seq: int) -> str:
        """Rank ``p``'s situation in words, with its own reason if it failed."""
        st = self._status(p)
        note = shm_status.describe(p, self._pids[p], st, alive=segments.pid_alive(self._pids[p]),
                                   seq=seq, stopped=segments.pid_stopped(self._pids[p]))
        if st.state == shm_status.FAILED:
            text = verdict.read_reason(self._ctls[p].mm)
            note += f": {text}" if text else ""
        return note

    def _decide(self, why: int, reason: str = "") -> None:
        """Fail for the whole group, under its lock (see [Note: sticky failures]); raise
        :class:`_Settled` instead if the barrier being waited for completed after all."""
        if self._ctl is None or os.getpid() != self._pid:
            return
        locked = self._glock.acquire(time.monotonic() + 1.0)
        try:
            if self._settle is not None and self._settle():
                raise _Settled
            verdict.write_reason(self._ctl.mm, reason or shm_status.WHY.get(why, "failed"))
            verdict.set_first(self._leader, self.rank, self._info.seq if self._info else 0)
            self._set_state(shm_status.FAILED, why)
        finally:
            if locked:
                self._glock.release()

    def _dead_cause(self) -> tuple[int, str]:
        """``(rank, words)`` of the first peer whose process is gone, or ``(-1, "")``.

        [Note: the original cause]
        When a rank dies every survivor must name *it*, whichever noticed first:
        one that finds the verdict set by another survivor would name that one.
        So every failure looks for a dead peer first (dead peers that never
        failed first: one that had failed is a survivor that exited after its
        error), puts it at the head of the error and writes it as its reason.
        Only the failure path pays for the pid checks."""
        if not self._ctls:
            return -1, ""
        mine = self._info.seq if self._info else 0
        dead = self._dead_peers()
        # A dead peer that had failed first is a survivor that exited after its error.
        dead.sort(key=lambda p: self._status(p).state == shm_status.FAILED)
        self.memory.remove_dead_peer_names(dead)  # nothing of theirs outlives the job
        return (dead[0], self._note(dead[0], mine)) if dead else (-1, "")

    def _dead_peers(self) -> list[int]:
        """Peers whose process is gone."""
        return [p for p in range(self.world_size)
                if p != self.rank and not segments.pid_alive(self._pids[p])]

    def _fail(self, what: str, waiting_for: Sequence[int],
              why: int = shm_status.LOST_PEER) -> CollectiveError:
        dead, cause = self._dead_cause()  # see [Note: the original cause]
        reason = f"{shm_status.WHY.get(why, 'failed')} ({what})"
        self._decide(why, f"{cause}; {reason}" if cause else reason)
        info = self._info.describe() if self._info else "collective"
        mine = self._info.seq if self._info else 0
        notes = [self._note(p, mine) for p in sorted(waiting_for) if self._ctls and p != dead]
        arrived = [p for p in range(self.world_size) if p not in waiting_for]
        msg = (f"gradring {info} failed on rank {self.rank}: " + (f"{cause}; " if cause else "")
               + f"ranks {sorted(waiting_for)} did not arrive ({what}); ranks {arrived} "
               f"arrived; " + "; ".join(notes))
        self._broken = msg
        return CollectiveError(msg)

    def _fail_sticky(self, first: tuple[int, int]) -> CollectiveError:
        """The group already failed (rank ``first[0]`` in #``first[1]``): so does this rank."""
        r, seq = first
        self._settle = None
        # Name the original cause, not only the rank that failed first: a dead peer
        # seen from here, else the reason rank r relays (see [Note: the original cause]).
        _, cause = self._dead_cause()
        self._decide(shm_status.LOST_PEER, cause or f"stopped after rank {r} failed #{seq}")
        info = self._info.describe() if self._info else "collective"
        note = self._note(r, seq) if 0 <= r < self.world_size and self._ctls else ""
        msg = (f"gradring {info} failed on rank {self.rank}: " + (f"{cause}; " if cause else "")
               + f"rank {r} gave up on collective #{seq} of this group first, so no rank "
               f"may complete it; {note}")
        self._broken = msg
        return CollectiveError(msg)

    def _cannot_map(self, p: int, name: str, exc: Exception) -> CollectiveError:
        """Rank ``p``'s segment ``name`` did not map: fail, naming ``p`` if it is gone."""
        self._check_alive(f"mapping {name}", [p])
        return self._fail(f"cannot map its segment {name}: {exc}", [p])

    def _fail_peer(self, p: int, what: str) -> CollectiveError:
        """Rank ``p`` published something impossible: fail (for the group), naming it."""
        self._decide(shm_status.LOST_PEER, f"rank {p} published a bad descriptor")
        info = self._info.describe() if self._info else "collective"
        msg = f"gradring {info} failed on rank {self.rank}: rank {p} is unusable: {what}"
        self._broken = msg
        return CollectiveError(msg)

    def mark_failed(self, exc: BaseException) -> None:
        """Any other exception on the collective path: fail for the group, so peers stop
        waiting at their next slice and can name the exception."""
        if self._broken is not None or self._ctl is None:
            return
        text = f"{type(exc).__name__}: {exc}"
        self._settle = None
        self._decide(shm_status.ERROR, text)
        self._broken = f"rank {self.rank} raised {text}"

    def check_verdict(self) -> None:
        """Raise if any rank has failed this group (before writing into peers' memory)."""
        first = verdict.read(self._leader)
        if first is not None:
            raise self._fail_sticky(first)

    def finish(self) -> None:
        """End of a collective: the closing agreement when data work followed the last
        barrier (see [Note: sticky failures])."""
        if self._open:
            self.barrier("at the closing barrier of the collective")
        self._busy = False

    # -- SIGTERM (sigterm.py) -------------------------------------------------------------
    def pending_error(self) -> str:
        """A failure not raised yet, or the collective in flight and where every peer is;
        peers whose process is gone come first, in flight or not (torchrun's SIGTERM
        often comes before this rank saw the death itself)."""
        if self._ctl is None:
            return ""
        seq = self._info.seq if self._info else 0
        # Peers that died without ending gradring: a peer that marked itself closed or
        # failed first is a survivor stopped by the same SIGTERM, or one that exited
        # after its own error -- not the cause.
        dead = [p for p in self._dead_peers()
                if self._status(p).state == shm_status.RUNNING]
        gone = "; ".join(self._note(p, seq) for p in dead)
        if self._broken is not None:
            return self._broken if not gone or all(
                f"rank {p} (pid {self._pids[p]})" in self._broken for p in dead) \
                else f"{gone}; {self._broken}"
        if not self._busy or self._info is None:
            if not gone:
                return ""
            last = f"it last started {self._info.describe()}" if self._info else \
                "it had not started a collective"
            return (f"gradring on rank {self.rank}: {gone}; no collective was in flight "
                    f"here ({last})")
        return ((f"{gone}; " if gone else "")
                + f"gradring {self._info.describe()} was in flight on rank {self.rank}: "
                + "; ".join(self._note(p, seq) for p in range(self.world_size)
                            if p != self.rank and p not in dead))

    def peer_progress(self) -> dict[int, dict[str, Any]]:
        """Each peer's status block as this rank reads it (for the flight recorder)."""
        if self._ctl is None:
            return {}
        states = {shm_status.RUNNING: "running", shm_status.CLOSED: "closed",
                  shm_status.FAILED: "failed"}
        out = {}
        for p in range(self.world_size):
            if p != self.rank:
                st = self._status(p)
                out[p] = {"seq": st.seq, "state": states.get(st.state, "?"), "what": st.last(),
                          "alive": segments.pid_alive(self._pids[p]), "source": "shm status"}
        return out

    def release_names(self) -> None:
        """Unlink every segment name this process owns (mappings stay) and tell peers
        this rank is gone. Safe from a signal handler."""
        if self._ctl is None or os.getpid() != self._pid:
            return
        self.memory.release_names(self._pid)
        self.memory.remove_dead_peer_names(self._dead_peers())  # killed peers' names
        self._ctl.unlink()
        if self._broken is None:
            self._set_state(shm_status.CLOSED)

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
                text = verdict.read_reason(self._ctls[p].mm)
                gave_up.append(f"rank {p} {st.reason()} in {st.last()} first"
                               + (f" ({text})" if st.why == shm_status.ERROR and text else ""))
        if gone:
            raise self._fail(what, sorted(set(gone) | set(waiting_for)))
        if gave_up:
            raise self._fail(f"{what}; " + ", ".join(gave_up), waiting_for)

    def _block(self, p: int, word: int, until: Any, what: str,
               waiting_for: Sequence[int], settle: Any = None) -> None:
        """Wait until ``until(value of rank p's word)``: spin, yield, then sleep in
        the kernel with a deadline; see [Note: spin, then block] in ``futex.py``.
        ``settle``: a barrier's "everybody arrived", re-checked before failing it."""
        if settle is None:
            self._wait(p, word, until, what, waiting_for)
            return
        self._settle = settle
        try:
            self._wait(p, word, until, what, waiting_for)
        except _Settled:
            return
        finally:
            self._settle = None

    def _wait(self, p: int, word: int, until: Any, what: str,
              waiting_for: Sequence[int]) -> None:
        """[Note: yield only while it is free]
        The yield window helps only while this rank has a core to itself: a
        ``sched_yield`` then returns at once, handing the GIL to the process's
        other threads meanwhile. When other processes want the core, a yield
        hands it to them for a whole time slice, while a sleeping waiter would
        have been woken the moment the peer arrived. So a yield that returns
        late (``_LOST_CORE_S``) ends the window, and a second within
        ``_CONFIRM_S`` (one is as often a VM's hiccup) makes the waits sleep
        at once for ``_CONTENDED_S``. Only the main thread's waits judge: the
        comm thread's yields hand the core to the process's own training
        thread. The measurements are in docs/collectives.md ("Async engine").
        """
        words = self._words[p]
        clock = time.perf_counter
        now = clock()
        for _ in range(SPIN_ITERS if now >= self._contended_until else _CONTENDED_SPIN):
            if until(words[word]):
                return
        if now >= self._contended_until:  # see [Note: yield only while it is free]
            yield_end = now + YIELD_S
            while now < yield_end:
                os.sched_yield()
                after = clock()
                if after - now > _LOST_CORE_S and threading.current_thread() is _MAIN:
                    if after - self._lost_core_at < _CONFIRM_S:
                        self._contended_until = after + _CONTENDED_S
                    self._lost_core_at = after
                    break
                if until(words[word]):
                    return
                now = after
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
                segments.sweep_if_due(time.monotonic())  # idle: see [Note: a live job sweeps too]

    # -- point-to-point (the mailboxes) ------------------------------------------------
    def isend(self, buf: torch.Tensor, dst: int) -> Any:
        self._open = True
        return self._mail.isend(buf, dst)

    def irecv(self, buf: torch.Tensor, src: int, op: Op | None = None) -> Any:
        self._open = True
        return self._mail.irecv(buf, src, op)

    def wait_all(self, reqs: Sequence[Any]) -> None:
        self._mail.wait_all(reqs)

    # -- barrier -------------------------------------------------------------------
    def arrive(self) -> None:
        """Arrive at the next barrier -- under the group lock, and only while no rank
        has failed (see [Note: sticky failures])."""
        if not self._glock.acquire(self._deadline):
            raise self._lock_timeout()
        try:
            first = verdict.read(self._leader)
            if first is None:
                self._epoch += 1
                self._own_words[BARRIER_WORD] = self._epoch & _MASK  # this rank's word only
        finally:
            self._glock.release()
        if first is not None:
            raise self._fail_sticky(first)
        # Woken after the lock is released: a woken peer that preempts this rank then
        # never finds the lock held.
        self._wake_barrier()

    def _lock_timeout(self) -> CollectiveError:
        """The group's lock stayed taken to the deadline: fail, naming its holder and
        whether that process is stopped (SIGSTOP, a debugger)."""
        holder = self._glock.holder()
        what = f"waiting for the group's lock, timed out after {self._timeout:g}s"
        if not 0 <= holder < self.world_size or holder == self.rank:
            return self._fail(f"{what} (its holder is unknown)", [], shm_status.TIMEOUT)
        pid = self._pids[holder]
        state = ("is stopped (SIGSTOP or a debugger: process state T)"
                 if segments.pid_stopped(pid) else
                 "is alive but did not release it" if segments.pid_alive(pid) else "has exited")
        return self._fail(f"{what}: rank {holder} (pid {pid}) holds it and {state}",
                          [holder], shm_status.TIMEOUT)

    def wait_arrivals(self, what: str = "at a barrier inside the collective") -> None:
        target = self._epoch
        reached = lambda v: ((v - target) & _MASK) < _HALF
        everybody = lambda: all(reached(self._words[q][BARRIER_WORD])
                                for q in range(self.world_size) if q != self.rank)
        for p in range(self.world_size):
            if p != self.rank and not reached(self._words[p][BARRIER_WORD]):
                late = [q for q in range(self.world_size)
                        if q != self.rank and not reached(self._words[q][BARRIER_WORD])]
                self._block(p, BARRIER_WORD, reached, what, late, settle=everybody)
        self._open = False

    def barrier(self, what: str = "at a barrier inside the collective") -> None:
        self.arrive()
        self.wait_arrivals(what)

    def exchange(self, info: Collective, exposed: torch.Tensor | None, *,
                 zero_copy: bool) -> Exchange:
        mem = self.memory
        slot, no_room, segno, offset = mem.outgoing(exposed)
        nbytes, dcode = info.nbytes, _DTYPE_CODES.get(info.dtype, 0)
        flags = 0
        self._last_staged = 0
        if no_room:  # a process limit, not /dev/shm, where _AT_LIMIT: see space.py
            flags, offset, exposed = _NO_ROOM | (_AT_LIMIT if mem.no_room_limit else 0), \
                no_room, None
        elif exposed is not None:
            flags = _HAS_BUFFER | (_ZERO_COPY if zero_copy else 0)
            self._last_staged = 0 if zero_copy else segno
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
                self._desync(p, theirs, before_data=True)
            if not pflags & _HAS_BUFFER:
                mem.collect_retired(p)
                views.append(None)
                continue
            staged = not pflags & _ZERO_COPY
            if not staged:
                any_zero_copy = True
            views.append(mem.peer_view(p, slot, staged, psegno, poff, pbytes, info.dtype))
        self._open = any(v is not None for v in views)
        return Exchange(views, any_zero_copy)

    def exchange_inline(self, info: Collective, flat: torch.Tensor) -> list[torch.Tensor]:
        """``DirectTransport.exchange_inline``: every rank's copy of its ``flat`` (at most
        ``INLINE_BYTES``), in rank order, after one barrier.

        [Note: inline exchange]
        The input travels in this exchange's inline slot of the control segment
        (slots alternate per exchange, like the descriptors), so a small
        collective maps and stages nothing and needs one barrier: a rank writes
        slot ``k`` again only after the barrier of the exchange in between, which
        every peer reached after reading slot ``k``; and after the barrier
        nothing can fail (control segments were mapped at connect; what is left
        is comparing descriptors, which every rank does alike, and a local sum),
        so no closing agreement is needed ([Note: sticky failures]).
        """
        nbytes, dtype = info.nbytes, flat.dtype
        if nbytes > INLINE_BYTES:
            raise ValueError(f"gradring {info.describe()}: {nbytes} bytes do not fit an "
                             f"inline slot ({INLINE_BYTES} bytes)")
        slot, _, _, _ = self.memory.outgoing(None)
        shape = flat.shape
        key = (slot, shape, dtype)
        views = self._inline_views.get(key)
        if views is None:
            if len(self._inline_views) > 64:
                self._inline_views.clear()
            views = self._inline_views[key] = [
                slots[slot][:nbytes].view(dtype).view(shape) for slots in self._inline]
        ctypes.memmove(self._inline_addr[slot], flat.data_ptr(), nbytes)
        desc_off = desc_offset(slot)
        dcode = _DTYPE_CODES.get(dtype, 0)
        DESC.pack_into(self._ctl.mm, desc_off, info.seq, int(info.kind), _INLINE, nbytes,
                       dcode, 0, 0, self._fp[4], self._fp[5])
        self.arrive()
        self.wait_arrivals("at the start of the collective")
        expected = (info.seq, int(info.kind), nbytes, dcode)
        for p in range(self.world_size):
            if p != self.rank:
                seq, kind, pflags, pbytes, pcode, _, _, pshape, plabel = DESC.unpack_from(
                    self._ctls[p].mm, desc_off)
                theirs = (seq, kind, pbytes, pcode, pshape, plabel)
                if theirs[:4] != expected or not pflags & _INLINE or \
                        self._full_check and theirs[4:] != self._fp[4:]:
                    self._desync(p, theirs, before_data=True)
        self._open = False
        return views

    def _check_room(self, desc_off: int, flags: int, needed: int) -> None:
        """Every rank reads every descriptor after the start barrier: if any rank had
        no room for its buffer, all of them raise :class:`space.ShmExhausted` here."""
        short = {self.rank: needed} if flags & _NO_ROOM else {}
        limited = [self.rank] if flags & _AT_LIMIT else []
        for p in range(self.world_size):
            if p != self.rank:
                _, _, pflags, _, _, _, poff, _, _ = DESC.unpack_from(self._ctls[p].mm, desc_off)
                if pflags & _NO_ROOM:
                    short[p] = poff
                if pflags & _AT_LIMIT:
                    limited.append(p)
        if short:
            info = self._info.describe() if self._info else "collective"
            need = max(short.values())
            raise space.ShmExhausted(
                f"gradring {info}: ranks {sorted(short)} could not reserve a "
                f"{need}-byte buffer in {segments.SHM_DIR}", need, sorted(limited))

    def release_for_fallback(self) -> None:
        """Every rank gave shared memory up in the same collective: close without
        waiting for peers to map a staged buffer (none of them will)."""
        self._last_staged = 0
        self.close()

    def _desync(self, p: int, theirs: Sequence[int], *, before_data: bool = False) -> None:
        """Raise the desync with rank ``p``; sticky unless ``before_data`` shows only
        the arguments differ.

        [Note: different arguments, same collective]
        Ranks in the same collective (sequence number and kind) with different
        sizes, dtypes or shapes see it in the descriptors after the start
        barrier, before any byte moved, and every rank sees it: all raise the
        DesyncError in the same exchange with their counters in step, and the
        group stays usable, as after a call refused for its arguments ([Note:
        arguments are checked before the collective is issued] in ``api.py``).
        Other desyncs fail the group for good."""
        info = self._info
        assert info is not None
        err = desync.mismatch(info, self.rank, p, theirs,
                              desync.difference(self._fp, theirs) or "descriptors")
        self._settle = None
        if before_data and tuple(theirs[:2]) == (info.seq, int(info.kind)):
            self._busy = self._open = False
            self._last_staged = 0
            raise err
        self._decide(shm_status.DESYNC)
        self._broken = str(err)
        raise err

    def _check_sender(self, src: int, strict: bool = False) -> None:
        """Before consuming ``src``'s first message of this collective: same collective?
        ``strict`` (a message of the wrong size arrived): any difference is a desync,
        even a sender that seems to have moved on."""
        info = self._info
        assert info is not None
        st = self._status(src)
        if st.seq > info.seq and not strict:
            return  # it finished this collective and moved on; the message is ours
        theirs = (st.seq, st.kind, st.nbytes, st.dtype, st.shape, self._fp[5])
        if theirs[:4] != self._fp[:4] or self._full_check and theirs != self._fp:
            self._desync(src, theirs)


def live_transports() -> list[ShmTransport]:
    """Every shm transport of this process that is not closed yet."""
    return list(_live)


@atexit.register
def _close_all() -> None:
    for t in list(_live):
        t.close()
