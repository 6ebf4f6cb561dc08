"""What a group does when one of its collectives fails: record it, tell the peers,
and give the caller an error that says as much as the ranks know.

Every failure goes through :meth:`Failures.record` (recorder entry, "failed" on
the board, dump); the caller's error is completed with what the board says
(:meth:`Failures.with_board`) or, for a desync, what the others issued.
"""

from __future__ import annotations

import time
from typing import Any

from gradring.comm import desync, peers
from gradring.comm.board import PeerBoard, describe_status
from gradring.comm.recorder import RECORDER, Entry
from gradring.comm.transport import CollectiveError
from gradring.comm.watchdog import WatchdogError


class Failures:
    """The failure state of one group and the errors it reports."""

    def __init__(self, board: PeerBoard, rank: int, world_size: int, group: str) -> None:
        # The group's fail-fast markers (what peers posted about themselves).
        self.board = board
        self.rank = rank
        self.world_size = world_size
        # The group's name, for messages.
        self.group = group
        # Whether a collective of this group failed here (then no "left" marker at close).
        self.failed = False
        # Set when the watchdog failed a collective the engine is still blocked in:
        # later collectives fail at once instead of queueing behind it.
        self.broken: str | None = None
        # What this rank can see of its peers' progress ({rank: {"seq", "state", ...}}),
        # noted in the flight recorder at every failure (set by the group's context).
        self.progress: Any = None

    def record(self, entry: Entry | None, err: BaseException) -> None:
        """Flight recorder, board, dump: what every failure of this group goes through."""
        self.failed = True
        if self.progress is not None:
            try:
                RECORDER.note_peers(self.group, self.progress())
            except Exception:  # noqa: BLE001 - diagnostics only
                pass
        if entry is not None:
            entry.fail(str(err))
            self.board.post("failed", entry.seq, entry.describe(), str(err),
                            type(err).__name__)
        RECORDER.dump(f"group {self.group}: {err}")

    def with_board(self, err: CollectiveError) -> CollectiveError:
        """``err`` plus what peers posted about their own failure or departure: a gloo
        error only names the neighbour, whose own failure may have named the culprit."""
        dead = self.board.dead_peers()
        for _ in range(3):  # a closed socket may show before the process is reaped
            if dead:
                break
            time.sleep(0.05)
            dead = self.board.dead_peers()
        if dead:
            err = type(err)(f"{err}; " + "; ".join(peers.exited(p, pid) for p, pid in dead))
        told = {p: s for p, s in self.board.read().items() if s["state"] in ("failed", "left")}
        cut_off = self.board.store_unreachable()
        if cut_off is not None:  # the peers' reports cannot be read
            err = type(err)(f"{err}; {cut_off}, so rank {self.rank} cannot learn what its "
                            "peers reported (a network partition, or the store's host is down)")
        else:  # peers whose heartbeat stopped: cut off (see [Note: heartbeats])
            cut = self.board.cut_off({p for p, _ in dead})
            if cut:
                err = type(err)(f"{err}; " + "; ".join(cut))
        if not told:
            return err
        cls = desync.DesyncError if any(s.get("error") == "DesyncError"
                                        for s in told.values()) else type(err)
        return cls(f"{err}; the peers' own reports: " + "; ".join(
            describe_status(p, s).splitlines()[0][:300] for p, s in sorted(told.items())))

    def desync(self, entry: Entry | None, exc: desync.DesyncError) -> desync.DesyncError:
        """Add what the other ranks say they issued (they post it too), then record."""
        self.record(entry, exc)
        seq = entry.seq if entry else -1
        deadline = time.monotonic() + 1.0
        while True:
            others = {p: s for p, s in self.board.read().items()
                      if s["state"] == "failed" and s["seq"] == seq}
            if len(others) == self.world_size - 1 or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        said = "; ".join(f"rank {p} issued {s['what']}" for p, s in sorted(others.items()))
        err = desync.DesyncError(f"{exc}" + (f". Their own words: {said}" if said else ""))
        if entry is not None:
            entry.error = str(err)
        return err

    def watched(self, entry: Entry, exc: BaseException) -> BaseException:
        """The error a watched collective fails with (gloo's, or the watchdog's verdict)."""
        if isinstance(exc, CollectiveError):
            return exc  # the runner already recorded it
        cls = desync.DesyncError if getattr(exc, "peer_error", "") == "DesyncError" \
            else CollectiveError
        err = cls(f"gradring {entry.describe()} failed on rank {self.rank} "
                  f"(group {self.group}, algo {entry.algo}): {exc}")
        if isinstance(exc, WatchdogError):
            self.broken = str(err)  # its verdict came from the board already
        else:
            err = self.with_board(err)
        self.record(entry, err)
        return err

    def refused(self, entry: Entry) -> CollectiveError:
        """The error of a collective issued after the group became unusable."""
        err = CollectiveError(f"gradring {entry.describe()} not run on rank {self.rank}: "
                              f"group {self.group} is unusable after an earlier failure; "
                              f"call comm.shutdown() on every rank to start afresh. "
                              f"Earlier: {self.broken}")
        entry.fail(str(err))
        return err
