"""What a process that can write the job's store can make a rank say: the limit of
the checks in [Note: the store is not trusted] (gradring/comm/board.py).

torch's stores (TCPStore, FileStore) have no authentication. gradring checks that
every board value has the shape and types gradring writes, so a malformed value
fails the waiting collective with an error naming the key
(tests/unit/test_board_values.py, tests/jobs/test_store_forgery.py). A value of
the right shape is believed: these tests pin down what it can do. The wait ends
with an error, never with a result, but the error blames whichever rank the
forger named, although that rank is alive (docs/reliability.md, "What an
attacker with store access can and cannot do")."""

from __future__ import annotations

import json
import os

import pytest

from gradring.comm.watchdog import Watchdog
from tests.unit.test_board_values import WAIT_S, _boards, _watch

KEY = "gradring/board/0/1"  # rank 1's status in the default group's first board


def _forged(**fields: object) -> bytes:
    status = {"state": "failed", "seq": 7, "what": "all_reduce #7", "why": "FORGED",
              "error": "", "fp": None, "pid": os.getpid(), "time": 1.0}
    status.update(fields)
    return json.dumps(status).encode()


@pytest.fixture
def dog():
    d = Watchdog()
    yield d
    d.stop()


FORGERIES = [
    (dict(), "rank 1 failed in all_reduce #7: FORGED"),
    (dict(state="waiting", why="", fp=[1, 2, 3]),
     "gradring desync on rank 0: rank 0 issued all_reduce #7 (16 bytes, float32, shape [4]) "
     "but rank 1 issued all_reduce #7"),
    (dict(state="left", seq=3, what="all_reduce #3"),
     f"rank 1 (pid {os.getpid()}) left gradring after all_reduce #3, so it skipped #7"),
    # A rank that exits with #7 in flight posts "left" in #7 (context.close): the wait
    # in #7 ends too, and the words do not say that it skipped #7.
    (dict(state="left", seq=7, what="#7", why="abandoned"),
     f"rank 1 (pid {os.getpid()}) left gradring in #7, abandoning it"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("fields", "said"), FORGERIES,
                         ids=["failed", "desync", "left", "left-in-it"])
def test_a_well_formed_forged_status_blames_a_live_rank(dog: Watchdog, fields: dict,
                                                        said: str) -> None:
    store, (b0, b1) = _boards()
    store.set(KEY, _forged(**fields))
    done, outcome = _watch(dog, b0, timeout=60.0)
    assert done.wait(WAIT_S), "the watched collective never ended"
    err = outcome["error"]
    # The forger's story becomes the diagnosis, naming rank 1 ...
    assert said in err, err
    assert "timed out" not in err and "StoreValueError" not in err, err
    # ... which is alive: its board is attached and its process (this one) runs.
    assert b0.dead_peers() == [] and not b1._dead


@pytest.mark.timeout(120)
def test_a_forged_waiting_status_of_the_same_collective_changes_nothing(dog: Watchdog) -> None:
    """No board value completes a collective: with rank 1 "waiting" in the same
    collective (same fingerprint), rank 0 still waits for the data, to its deadline."""
    store, (b0, _) = _boards()
    from gradring.comm.recorder import Entry

    fp = Entry("0", 7, "all_reduce", 16, __import__("torch").float32, [4]).fingerprint()
    store.set(KEY, _forged(state="waiting", why="", fp=fp))
    done, outcome = _watch(dog, b0, timeout=1.0)
    assert done.wait(WAIT_S), "the watched collective never ended"
    assert "timed out after 1s" in outcome["error"], outcome
