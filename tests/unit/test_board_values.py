"""Forged store values against the peer board and the watchdog thread.

Any local process that reaches the job's store can write a board key. The
board must reject what gradring did not write, naming the key (see [Note: the
store is not trusted] in gradring/comm/board.py), and the watchdog thread must
turn any such failure into the verdict on the collectives it watches instead
of dying (see [Note: the watchdog thread never dies] in watchdog.py). A fake,
dict-backed store stands in for torch's here; tests/jobs/test_store_forgery.py
forges a real job's store.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
import torch

from gradring.comm.board import PeerBoard, StoreValueError, parse_identity, parse_status
from gradring.comm.recorder import Entry
from gradring.comm.transport import CollectiveError
from gradring.comm.watchdog import Watchdog

#: Bounds a broken watchdog's silence; a working one answers within a poll or two.
WAIT_S = 60.0


class FakeStore:
    """The slice of torch's Store API the board uses, on a dict."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: str | bytes) -> None:
        self.data[key] = value.encode() if isinstance(value, str) else bytes(value)

    def get(self, key: str) -> bytes:
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def add(self, key: str, n: int) -> int:
        value = int(self.data.get(key, b"0")) + n
        self.data[key] = str(value).encode()
        return value


def _boards(world: int = 2) -> tuple[FakeStore, list[PeerBoard]]:
    store = FakeStore()
    boards = [PeerBoard(store, r, world) for r in range(world)]
    for b in boards:
        b.attach()
    return store, boards


GOOD_STATUS = {"state": "waiting", "seq": 3, "what": "all_reduce #3", "why": "", "error": "",
               "fp": [1, 2, 3], "pid": 4242, "time": 1.5}
BAD_STATUSES = [
    (b"42", "is a JSON int"),
    (b"[1, 2]", "is a JSON list"),
    (b"not json", "is not JSON"),
    (b"\xff\xfe", "is not JSON"),
    (json.dumps({**GOOD_STATUS, "state": "asleep"}).encode(), "state 'asleep'"),
    (json.dumps({k: v for k, v in GOOD_STATUS.items() if k != "seq"}).encode(), "seq None"),
    (json.dumps({**GOOD_STATUS, "seq": "3"}).encode(), "seq '3'"),
    (json.dumps({**GOOD_STATUS, "seq": -1}).encode(), "seq -1"),
    (json.dumps({**GOOD_STATUS, "seq": True}).encode(), "seq True"),
    (json.dumps({**GOOD_STATUS, "pid": 0}).encode(), "pid 0"),
    (json.dumps({**GOOD_STATUS, "pid": "1"}).encode(), "pid '1'"),
    (json.dumps({**GOOD_STATUS, "what": 7}).encode(), "what 7"),
    (json.dumps({**GOOD_STATUS, "fp": "x"}).encode(), "fp"),
    (json.dumps({**GOOD_STATUS, "fp": [1, "2"]}).encode(), "fp"),
    (json.dumps({**GOOD_STATUS, "time": "now"}).encode(), "time 'now'"),
    (b" " * (64 * 1024 + 1), "more than"),
]


def test_a_status_gradring_posts_reads_back() -> None:
    _, (b0, b1) = _boards()
    b1.post("failed", 5, "all_reduce #5", why="boom", error="CollectiveError", fp=[9, 8])
    got = b0.read()[1]
    assert (got["state"], got["seq"], got["what"], got["why"], got["fp"]) == \
        ("failed", 5, "all_reduce #5", "boom", [9, 8])
    assert parse_status("k", json.dumps(GOOD_STATUS).encode()) == GOOD_STATUS


@pytest.mark.parametrize("raw,problem", BAD_STATUSES, ids=[p for _, p in BAD_STATUSES])
def test_a_forged_status_names_the_key(raw: bytes, problem: str) -> None:
    store, (b0, _) = _boards()
    store.set("gradring/board/0/1", raw)
    with pytest.raises(StoreValueError, match=r"store key 'gradring/board/0/1'") as info:
        b0.read()
    assert problem in str(info.value)
    assert info.value.key == "gradring/board/0/1"
    assert isinstance(info.value, CollectiveError)  # handled as a failed collective


@pytest.mark.parametrize("raw,problem", [
    (b"42", "is not a [pid, host] pair"),
    (b'"x"', "is not a [pid, host] pair"),
    (b"[1, 2, 3]", "is not a [pid, host] pair"),
    (b'["1", "host"]', "pid '1'"),
    (b'[-5, "host"]', "pid -5"),
    (b"[7, 8]", "host 8"),
])
def test_a_forged_identity_names_the_key(raw: bytes, problem: str) -> None:
    store, (b0, _) = _boards()
    store.set("gradring/board/0/id/1", raw)
    with pytest.raises(StoreValueError, match=r"store key 'gradring/board/0/id/1'") as info:
        b0.dead_peers()
    assert problem in str(info.value)
    assert parse_identity("k", b'[12, "h"]') == (12, "h")


# ------------------------------------------------------------------------ the watchdog
def _watch(dog: Watchdog, board: Any, timeout: float = 30.0,
           on_fail: Any = None) -> tuple[threading.Event, dict[str, Any]]:
    """Watch a collective whose native future never completes; an event set when
    gradring's future ends, and what it ended with."""
    entry = Entry("0", 7, "all_reduce", 16, torch.float32, [4])
    native: torch.futures.Future = torch.futures.Future()
    fut = dog.watch(entry, native, timeout, board, 0, 2, [torch.zeros(4)],
                    on_fail or (lambda exc: exc))
    done, outcome = threading.Event(), {}

    def _record(f: torch.futures.Future) -> None:
        try:
            f.wait()
            outcome["error"] = None
        except Exception as exc:  # noqa: BLE001 - the test reads it
            outcome["error"] = str(exc)
        done.set()
    fut.add_done_callback(_record)
    return done, outcome


@pytest.fixture
def dog():
    d = Watchdog()
    yield d
    d.stop()


@pytest.mark.timeout(120)
def test_a_forged_board_value_fails_the_wait_naming_the_key(dog: Watchdog) -> None:
    """The report: ``"42"`` at a peer's board key killed the thread, and the rank
    waited forever instead of failing at its deadline."""
    store, (b0, _) = _boards()
    store.set("gradring/board/0/1", b"42")
    done, outcome = _watch(dog, b0)
    assert done.wait(WAIT_S), "the watched collective never ended: the watchdog died"
    err = outcome["error"]
    assert "StoreValueError" in err and "store key 'gradring/board/0/1'" in err, err
    assert "timed out" not in err, err  # ended by the forged value, not by the deadline
    # The thread lives on: a later collective is still watched to its deadline.
    store.set("gradring/board/0/1", json.dumps(GOOD_STATUS).encode())
    done2, outcome2 = _watch(dog, b0, timeout=1.0)
    assert done2.wait(WAIT_S), "the watchdog stopped watching after the forged value"
    assert "timed out after 1s" in outcome2["error"], outcome2


class BrokenBoard:
    """A board whose every read fails the way a bug would."""

    def post(self, *a: Any, **k: Any) -> None:
        pass

    def dead_peers(self) -> list[tuple[int, int]]:
        raise KeyError("surprise")

    def read(self) -> dict[int, dict[str, Any]]:
        return {}


@pytest.mark.timeout(120)
def test_any_error_in_a_check_fails_the_collective_not_the_thread(dog: Watchdog) -> None:
    done, outcome = _watch(dog, BrokenBoard())
    assert done.wait(WAIT_S), "the watched collective never ended: the watchdog died"
    assert "the watchdog could not check this collective: KeyError" in outcome["error"]
    assert dog._thread is not None and dog._thread.is_alive()


@pytest.mark.timeout(120)
def test_a_failing_error_path_still_ends_the_wait(dog: Watchdog) -> None:
    def on_fail(exc: BaseException) -> BaseException:
        raise RuntimeError("the error path broke")
    done, outcome = _watch(dog, None, timeout=0.5, on_fail=on_fail)
    assert done.wait(WAIT_S), "the watched collective never ended"
    assert "timed out after 0.5s" in outcome["error"], outcome
