"""gradring's threads under a thread-policing test suite, and at a group's end.

Lightning's autouse fixture ``thread_police_duuu_daaa_duuu_daaa`` records the
threads alive before a test; after it, every new thread must be a daemon with a
callable ``stop()`` (or ``exit()``), which it calls and then asserts the thread is
dead; any other new thread fails the test. :func:`_police` runs exactly that logic
around a DDP step and around a ``gradring.comm`` call, on each transport. The
step is then taken again, so gradring must start its threads anew, and its
gradients are compared with torch's own DDP on the same data. A group that ends
with ``destroy_process_group()`` takes its threads with it.
"""

from __future__ import annotations

import contextlib
import copy
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradring
from gradring import comm
from gradring.comm import threads

pytestmark = pytest.mark.timeout(180)


def _police(body: Callable[[], Any]) -> tuple[Any, list[str]]:
    """``body()`` under Lightning's thread-police logic; its result and the names of
    the threads the logic stopped. gradring's threads are stopped first, as the
    fixture would have done after an earlier test, so whatever of them runs after
    ``body()`` is new."""
    for t in threads.live():
        t.stop()
    before = set(threading.enumerate())
    result = body()
    stopped = []
    for thread in set(threading.enumerate()) - before:
        stop = getattr(thread, "stop", None) or getattr(thread, "exit", None)
        if thread.daemon and callable(stop):
            stop()
            assert not thread.is_alive(), f"stop() returned, yet {thread} is alive"
            stopped.append(thread.name)
        else:
            raise AssertionError(f"Test left zombie thread: {thread}")
    return result, sorted(stopped)


@contextlib.contextmanager
def _transport(name: str) -> Iterator[None]:
    old = os.environ.get("GRADRING_TRANSPORT")
    os.environ["GRADRING_TRANSPORT"] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("GRADRING_TRANSPORT", None)
        else:
            os.environ["GRADRING_TRANSPORT"] = old


def _step(ddp: nn.Module, rank: int) -> list[torch.Tensor]:
    torch.manual_seed(100 + rank)
    ddp.zero_grad(set_to_none=True)
    ddp(torch.randn(8, 4)).square().sum().backward()
    return [p.grad.detach().clone() for p in ddp.parameters()]


def _tasks() -> int:
    """The process's threads, Python's and native ones (gloo's)."""
    return len(os.listdir("/proc/self/task"))


def _task_names() -> list[str]:
    """The kernel's names of the process's threads (for a failure's message)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError), open(f"/proc/self/task/{tid}/comm") as f:
            names.append(f.read().strip())
    return sorted(names)


def _settled_tasks(want: int, wait_s: float = 5.0) -> int:
    """The thread count once it has come down to ``want``, or after ``wait_s``: a
    native thread that was told to end may take a moment to be gone from /proc."""
    deadline = time.monotonic() + wait_s
    while (n := _tasks()) != want and time.monotonic() < deadline:
        time.sleep(0.05)
    return n


def _threads_rank(rank: int, world_size: int, transport: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    with _transport(transport):
        for t in threads.live():
            t.stop()
        tasks_before = _tasks()
        names_before = _task_names()
        group = dist.new_group(list(range(world_size)))
        torch.manual_seed(0)
        base = nn.Linear(4, 4).double().float()
        model = {"ours": gradring.DistributedDataParallel(copy.deepcopy(base),
                                                          process_group=group)}
        model["theirs"] = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base),
                                                                    process_group=group)
        out["ours"], out["stopped_step"] = _police(lambda: _step(model["ours"], rank))
        # Its threads were stopped: the next step starts them again.
        out["ours_again"], out["stopped_again"] = _police(lambda: _step(model["ours"], rank))
        out["theirs"] = _step(model["theirs"], rank)

        t = torch.arange(6, dtype=torch.float32) * (rank + 1)
        work, out["stopped_comm"] = _police(lambda: comm.all_reduce(t, group=group,
                                                                   async_op=True))
        work.wait()
        out["comm"] = t.clone()
        out["comm_oracle"] = torch.arange(6, dtype=torch.float32) * sum(
            r + 1 for r in range(world_size))

        # A group's end takes its threads along, without any stop().
        comm.all_reduce(t, group=group, async_op=True).wait()
        name = f"gradring-comm-{group.group_name}"
        out["alive_before_destroy"] = [x.name for x in threads.live() if x.name == name]
        model.clear()
        out["tasks_with_group"] = _tasks()
        model["group"], group = group, None
        dist.destroy_process_group(model.pop("group"))  # this frame keeps no reference
        out["alive_after_destroy"] = [x.name for x in threading.enumerate() if x.name == name]
        # Nothing of gradring keeps the destroyed group: gloo's own threads are gone too.
        for t in threads.live():
            t.stop()
        out["tasks"] = (tasks_before, _settled_tasks(tasks_before))
        out["task_names"] = (names_before, _task_names())
    return out


@pytest.mark.parametrize("transport", ["shm", "torch"])
def test_threads_stop_like_lightning_wants_and_start_again(pools, transport: str) -> None:
    results = pools.run(2, _threads_rank, transport)
    for r in results:
        stopped = {k: r[k] for k in ("stopped_step", "stopped_again", "stopped_comm")}
        # Each policed body started gradring threads (the engine thread at least for an
        # asynchronous call), and each stop() killed them.
        assert all(stopped.values()), stopped
        assert any(n.startswith("gradring-comm-") for n in r["stopped_comm"]), stopped
        assert all(n.startswith("gradring-") for v in stopped.values() for n in v), stopped
        for got, want in zip(r["ours"], r["theirs"]):
            torch.testing.assert_close(got, want)
        for got, want in zip(r["ours_again"], r["theirs"]):
            torch.testing.assert_close(got, want)
        torch.testing.assert_close(r["comm"], r["comm_oracle"])
        assert r["alive_before_destroy"], r
        assert r["alive_after_destroy"] == [], r
        assert r["tasks_with_group"] > r["tasks"][0], r
        assert r["tasks"][1] == r["tasks"][0], (r["tasks"], r["task_names"])


def _child_sleeps() -> None:
    time.sleep(0.05)


def _forked_worker_rank(rank: int, world_size: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    comm.all_reduce(torch.ones(4))  # gradring's state and threads exist in the parent
    child = multiprocessing.get_context("fork").Process(target=_child_sleeps)
    # The pool's ranks are daemonic processes, which multiprocessing keeps from having
    # children; a training process is not one.
    config = multiprocessing.current_process()._config  # type: ignore[attr-defined]
    daemon = config.pop("daemon", None)
    try:
        child.start()
    finally:
        if daemon is not None:
            config["daemon"] = daemon
    child.join(60)
    hung = child.exitcode is None
    if hung:
        child.kill()
        child.join()
    # The parent's group still works after its forked worker ended.
    t = torch.full((3,), float(rank + 1))
    comm.all_reduce(t)
    return {"code": child.exitcode, "hung": hung, "sum": t.tolist()}


def test_a_forked_worker_exits_without_touching_the_parents_group(pools) -> None:
    # A DataLoader worker is such a child: its exit must neither destroy nor join the
    # gloo group (and threads) it inherited from its rank.
    for r in pools.run(2, _forked_worker_rank):
        assert not r["hung"] and r["code"] == 0, r
        assert r["sum"] == [3.0, 3.0, 3.0], r
