"""The synchronous small all-reduce on the caller's thread ([Note: the small
synchronous path] in gradring/comm/runner.py): when it runs, that it keeps
issue order behind asynchronous work, that its results are the general path's
bits, and that its errors name the peer."""

from __future__ import annotations

import math
import threading

import pytest
import torch
import torch.distributed as dist

from gradring import comm
from gradring.comm import context as comm_context
from gradring.comm import runner, select
from gradring.comm.ops import Op
from gradring.comm.recorder import RECORDER
from tests.support import comm_oracle
from tests.support.env import environ

pytestmark = pytest.mark.timeout(180)

OPS = {"SUM": dist.ReduceOp.SUM, "AVG": dist.ReduceOp.AVG, "MAX": dist.ReduceOp.MAX,
       "MIN": dist.ReduceOp.MIN}
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64,
          torch.int32, torch.uint8)


def _data(rank: int, count: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * salt + rank)
    if dtype.is_floating_point:
        return torch.randn(count, generator=g).to(dtype)
    return torch.randint(0, 50, (count,), generator=g).to(dtype)


class _Calls:
    """Counts the small path's calls, and the threads they ran on."""

    def __init__(self) -> None:
        self.threads: list[str] = []
        self._real = runner.run_small_all_reduce

    def __enter__(self) -> _Calls:
        def spy(*args, **kwargs):
            self.threads.append(threading.current_thread().name)
            return self._real(*args, **kwargs)
        runner.run_small_all_reduce = spy
        return self

    def __exit__(self, *exc: object) -> None:
        runner.run_small_all_reduce = self._real


def _until_idle() -> None:
    ctx = comm_context.existing_context(None)
    assert ctx is not None
    while ctx.engine.pending():
        pass


def _every_case(rank: int, world: int) -> dict[str, object]:
    """Each (dtype, op, size) twice: on the small path, and on the general path
    (``GRADRING_ALGO=tree`` runs it elsewhere; the engine path with an
    ``async_op`` runs ``direct/inline`` too). All three must equal the naive oracle."""
    comm.all_reduce(torch.ones(1))  # connect shm
    wrong: list[str] = []
    salt = 0
    with _Calls() as calls:
        for dtype in DTYPES:
            for name, op in OPS.items():
                for count in (1, 3, 1000, select.INLINE_MAX_BYTES // 8):
                    salt += 1
                    want = comm_oracle.oracle_all_reduce(
                        [_data(r, count, dtype, salt) for r in range(world)], Op(name))
                    small = _data(rank, count, dtype, salt)
                    _until_idle()  # the engine may still be ending the last async call
                    comm.all_reduce(small, op=op)
                    queued = _data(rank, count, dtype, salt)
                    comm.all_reduce(queued, op=op, async_op=True).wait()
                    if not torch.equal(small, want) or not torch.equal(queued, want):
                        wrong.append(f"{dtype} {name} {count}")
        # Any contiguous shape: the small path sums into the caller's tensor without a
        # flat view of it (the inline slots are viewed in its shape).
        for shape in ((), (3, 5), (2, 1, 4)):
            for name in ("SUM", "AVG"):
                salt += 1
                count = math.prod(shape)
                want = comm_oracle.oracle_all_reduce(
                    [_data(r, count, torch.float32, salt) for r in range(world)], Op(name))
                small = _data(rank, count, torch.float32, salt).view(shape)
                _until_idle()
                comm.all_reduce(small, op=OPS[name])
                if small.shape != shape or not torch.equal(small.reshape(-1), want):
                    wrong.append(f"shape {shape} {name}")
        small_calls = len(calls.threads)
        on_callers_thread = set(calls.threads) == {threading.current_thread().name}
        # Not taken: too big, not contiguous, an override.
        big = torch.ones(select.INLINE_MAX_BYTES // 4 + 1)
        comm.all_reduce(big)
        strided = torch.ones(20)[::2]
        comm.all_reduce(strided)
        with environ(GRADRING_ALGO="tree"):
            comm.all_reduce(torch.ones(3))
        refused = len(calls.threads) - small_calls
        right = bool(torch.all(big == world) and torch.all(strided == world))
    return {"wrong": wrong, "small_calls": small_calls, "cases": salt,
            "on_callers_thread": on_callers_thread, "refused": refused, "right": right}


def test_small_path_runs_on_the_callers_thread_with_the_general_paths_bits(pools) -> None:
    for world in (2, 3):
        for res in pools.run(world, _every_case):
            assert res["wrong"] == [], res
            assert res["small_calls"] == res["cases"], res  # every synchronous small call
            assert res["on_callers_thread"], res
            assert res["refused"] == 0 and res["right"], res


def _behind_async(rank: int, world: int) -> dict[str, object]:
    """A synchronous small call issued while an asynchronous one is in flight must
    queue behind it (issue order on every rank), not overtake it on the caller's thread."""
    comm.all_reduce(torch.ones(1))
    events: list[str] = []
    with _Calls() as calls:
        big = torch.full((4_000_000,), float(rank))
        work = comm.all_reduce(big, async_op=True)
        work.get_future().add_done_callback(lambda _: events.append("async done"))
        small = torch.tensor([float(rank + 1)])
        comm.all_reduce(small)
        events.append("sync returned")
        work.wait()
        seqs = [(e.kind, e.nbytes, e.seq) for e in RECORDER.entries()[-2:]]
    return {"events": events, "small_path": len(calls.threads), "seqs": seqs,
            "small": small.item(), "big": bool(torch.all(big == sum(range(world))))}


def test_small_call_queues_behind_async_work_in_issue_order(pools) -> None:
    for res in pools.run(2, _behind_async):
        assert res["events"] == ["async done", "sync returned"], res
        assert res["small_path"] == 0, res  # the engine was busy: the general path
        (_, big_bytes, big_seq), (_, small_bytes, small_seq) = res["seqs"]
        assert big_bytes == 16_000_000 and small_bytes == 4 and small_seq == big_seq + 1
        assert res["small"] == 3.0 and res["big"], res


def _desync(rank: int, world: int) -> str:
    comm.all_reduce(torch.ones(1))
    with _Calls() as calls:
        try:
            comm.all_reduce(torch.ones(2 if rank == 1 else 3))
            out = "no error"
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out = f"{type(exc).__name__}: {exc}"
    comm.shutdown()  # the group is unusable after a desync: the next test starts afresh
    assert calls.threads, "the small path was not taken"
    return out


def test_small_path_desync_names_the_peer(pools) -> None:
    msgs = pools.run(2, _desync)
    assert "DesyncError" in msgs[0] and "rank 1" in msgs[0], msgs
    assert "DesyncError" in msgs[1] and "rank 0" in msgs[1], msgs


def _recorded(rank: int, world: int) -> dict[str, object]:
    comm.all_reduce(torch.ones(1))
    ctx = comm_context.existing_context(None)
    assert ctx is not None
    x = torch.ones(5)
    comm.all_reduce(x)
    last = RECORDER.entries()[-1]
    return {"algo": last.algo, "state": last.state, "seq": last.seq,
            "last_seq": ctx.last_seq}


def test_small_path_leaves_a_flight_recorder_entry(pools) -> None:
    for res in pools.run(2, _recorded):
        assert res["algo"] == "direct/inline over shm" and res["state"] == "completed", res
        assert res["seq"] == res["last_seq"], res
