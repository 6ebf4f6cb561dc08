"""gradring.comm across real processes: shm and torch transports, async API,
subgroups, zero-copy buffers, two jobs on one host, dead and silent peers.

Sweeps run on the session's rank pools (``pools`` fixture); each rank checks
its own results against closed-form expectations and returns the mismatches.
Tests that kill processes start their own small jobs: this file doubles as
the job script (``python tests/jobs/test_comm_multiprocess.py --scenario ...``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from gradring import comm
from gradring.comm import context as comm_context
from gradring.comm import select
from gradring.comm.ops import Op
from gradring.comm.transports.shm import segments

if __name__ == "__main__":  # run as a script by its own tests: import tests/ from the root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.support import comm_oracle  # noqa: E402

pytestmark = pytest.mark.timeout(180)

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64)
OPS = {"SUM": dist.ReduceOp.SUM, "AVG": dist.ReduceOp.AVG, "MAX": dist.ReduceOp.MAX,
       "MIN": dist.ReduceOp.MIN}
COUNTS = (0, 1, 4, 100, 1000, 10007)


def rank_data(rank: int, count: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Small integers: exact under any summation order, in every dtype."""
    i = torch.arange(count, dtype=torch.int64)
    return ((i * 7 + rank * 13 + salt * 5) % 11 - 5).to(dtype)


class _Env:
    """Set GRADRING_* variables on a pooled rank and restore them afterwards."""

    def __init__(self, **values: str | None) -> None:
        self.values = {f"GRADRING_{k.upper()}": v for k, v in values.items()}
        self.saved: dict[str, str | None] = {}

    def __enter__(self) -> None:
        for k, v in self.values.items():
            self.saved[k] = os.environ.get(k)
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    def __exit__(self, *exc: object) -> None:
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# --------------------------------------------------------------------------- sweeps
def _sweep(rank: int, world: int, transport: str, algo: str | None) -> list[str]:
    bad: list[str] = []
    with _Env(transport=transport, algo=algo):
        seq = 0
        for count in COUNTS:
            for dtype in DTYPES:
                for name, op in OPS.items():
                    seq += 1
                    x = rank_data(rank, count, dtype, seq)
                    want = comm_oracle.oracle_all_reduce(
                        [rank_data(r, count, dtype, seq) for r in range(world)], Op(name))
                    if seq % 3 == 0:
                        comm.all_reduce(x, op=op, async_op=True).wait()
                    else:
                        comm.all_reduce(x, op=op)
                    if not torch.equal(x, want):
                        bad.append(f"all_reduce {count} {dtype} {name}")
            for dtype in (torch.float32, torch.bfloat16, torch.int64):
                inp = rank_data(rank, world * count, dtype, 1)
                out = torch.empty(count, dtype=dtype)
                comm.reduce_scatter_tensor(out, inp, op=dist.ReduceOp.MAX)
                want = comm_oracle.oracle_reduce_scatter(
                    [rank_data(r, world * count, dtype, 1) for r in range(world)], Op("MAX"))
                if not torch.equal(out, want[rank]):
                    bad.append(f"reduce_scatter {count} {dtype}")
                gathered = torch.empty(world, count, dtype=dtype)
                comm.all_gather_into_tensor(gathered, rank_data(rank, count, dtype, 2))
                want = torch.stack([rank_data(r, count, dtype, 2) for r in range(world)])
                if not torch.equal(gathered, want):
                    bad.append(f"all_gather {count} {dtype}")
                src = count % world
                b = rank_data(rank, count, dtype, 3)
                comm.broadcast(b, src=src)
                if not torch.equal(b, rank_data(src, count, dtype, 3)):
                    bad.append(f"broadcast {count} {dtype}")
        comm.barrier()
    return bad


SWEEPS = [("shm", None), ("torch", None), ("torch", "ring"), ("shm", "ring"), ("shm", "tree")]


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("transport,algo", SWEEPS)
def test_collectives_match_oracle(pools, world: int, transport: str, algo: str | None) -> None:
    if world == 4 and algo is not None:
        pytest.skip("forced algorithms are covered at world 2 and 3; keeps the suite short")
    results = pools.run(world, _sweep, transport, algo, timeout=150)
    assert results == [[]] * world


def _large_messages(rank: int, world: int) -> list[str]:
    """Messages of many mailbox slots (flow control) and uneven chunks."""
    bad = []
    for transport, algo in (("shm", "ring"), ("shm", "tree"), ("torch", "ring"), ("shm", None)):
        with _Env(transport=transport, algo=algo):
            for n in (300_001, 1_000_003):
                x = rank_data(rank, n, torch.float32)
                comm.all_reduce(x)
                want = comm_oracle.oracle_all_reduce([rank_data(r, n, torch.float32)
                                                for r in range(world)], Op("SUM"))
                if not torch.equal(x, want):
                    bad.append(f"{transport}/{algo} {n}")
                b = rank_data(rank, n, torch.float32, 1)
                comm.broadcast(b, src=world - 1)
                if not torch.equal(b, rank_data(world - 1, n, torch.float32, 1)):
                    bad.append(f"broadcast {transport}/{algo} {n}")
    return bad


@pytest.mark.parametrize("world", [2, 3])
def test_large_messages(pools, world: int) -> None:
    assert pools.run(world, _large_messages, timeout=150) == [[]] * world


def _world_one(rank: int, world: int) -> list[bool]:
    x = torch.tensor([1.0, 2.0])
    comm.all_reduce(x, op=dist.ReduceOp.AVG)
    out = torch.empty(2)
    comm.all_gather_into_tensor(out, x)
    rs = torch.empty(2)
    comm.reduce_scatter_tensor(rs, x)
    fut = comm.all_reduce(x, async_op=True).get_future()
    y = comm.empty(3)
    return [torch.equal(x, torch.tensor([1.0, 2.0])), torch.equal(out, x), torch.equal(rs, x),
            fut.wait()[0] is x, y.shape == (3,), comm.barrier() is None]


def test_world_size_one_is_a_no_op(pools) -> None:
    assert all(pools.run(1, _world_one)[0])


# --------------------------------------------------------------------- async API
def _async(rank: int, world: int) -> dict[str, object]:
    xs = [torch.full((1000 * (i + 1),), float(rank + i)) for i in range(8)]
    works = [comm.all_reduce(x, async_op=True) for x in xs]
    seen: list[int] = []
    chained = works[0].get_future().then(lambda f: seen.append(int(f.value()[0][0])) or 7)
    for w in works:
        w.wait()
    ok_values = all(torch.all(x == sum(range(world)) + world * i) for i, x in enumerate(xs))
    ok_futures = all(w.get_future().value()[0] is x for w, x in zip(works, xs))
    # sync calls queue behind pending async ones and keep issue order
    a = torch.ones(5)
    b = torch.ones(5)
    wa = comm.all_reduce(a, async_op=True)
    comm.all_reduce(b)
    wa.wait()
    # broadcast / all_gather / reduce_scatter futures resolve to their output
    out = torch.empty(world * 3)
    wg = comm.all_gather_into_tensor(out, torch.full((3,), float(rank)), async_op=True)
    # a failure reaches wait() and the future, it is not lost in a thread
    sub = dist.new_group(list(range(world)))
    comm.all_reduce(torch.ones(1), group=sub)  # connect
    if rank == 0:
        bad = comm.all_reduce(torch.ones(10), group=sub, async_op=True)
    else:
        bad = comm.broadcast(torch.ones(10), src=0, group=sub, async_op=True)
    err = ""
    try:
        bad.wait()
    except comm.CollectiveError as exc:
        err = str(exc)
    fut_err = ""
    try:
        bad.get_future().wait()
    except RuntimeError as exc:
        fut_err = type(exc).__name__
    comm.shutdown(sub)
    return {"values": bool(ok_values), "futures": ok_futures, "then": chained.wait() == 7,
            "seen": seen == [sum(range(world))], "order": bool(torch.all(a == world)
                                                              and torch.all(b == world)),
            "gather": wg.get_future().wait()[0] is out and wg.is_completed(),
            "error": err, "future_error": fut_err, "success": bad.is_success()}


def test_async_work_and_futures(pools) -> None:
    for res in pools.run(2, _async):
        assert res["values"] and res["futures"] and res["then"] and res["seen"]
        assert res["order"] and res["gather"]
        assert "different collectives" in res["error"] or "did not arrive" in res["error"]
        assert res["future_error"] and res["success"] is False


# -------------------------------------------------------------------- subgroups
def _subgroups(rank: int, world: int) -> list[object]:
    pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    trio = dist.new_group([1, 2, 3])
    mine = pairs[rank % 2]
    x = torch.full((1001,), float(rank))
    comm.all_reduce(x, group=mine)
    expect_pair = float(rank % 2 + rank % 2 + 2)
    b = torch.full((7,), float(rank))
    comm.broadcast(b, src=2 if rank % 2 == 0 else 3, group=mine)  # src: a global rank
    t = torch.full((10,), float(rank))
    r = comm.all_reduce(t, group=trio)
    out = []
    if rank == 0:
        out.append(r is None and torch.all(t == 0).item())  # not a member: untouched
    else:
        out.append(torch.all(t == 6).item())
        g = torch.empty(3)
        comm.all_gather_into_tensor(g, torch.tensor([float(rank)]), group=trio)
        out.append(g.tolist() == [1.0, 2.0, 3.0])
        e = comm.empty(64, group=trio)
        e.fill_(rank)
        comm.all_reduce(e, group=trio)
        out.append(bool(torch.all(e == 6)) and comm.in_transport_memory(e, group=trio))
    out += [torch.all(x == expect_pair).item(), torch.all(b == (2 if rank % 2 == 0 else 3)).item()]
    for g in (*pairs, trio):
        comm.shutdown(g)
    return out


def test_subgroups_translate_ranks(pools) -> None:
    for res in pools.run(4, _subgroups):
        assert all(res), res


def _other_host(rank: int, world: int) -> dict[str, object]:
    """Ranks that do not share a host fall back to the torch transport, together."""
    from gradring.comm.transports.shm import rendezvous

    real = rendezvous.host_identity
    if rank == 1:  # pretend rank 1 booted another machine
        rendezvous.host_identity = lambda: dict(real(), host="elsewhere")
    try:
        sub = dist.new_group(list(range(world)))
        e = comm.empty(100, group=sub)  # connects: falls back to an ordinary tensor
        e.fill_(rank + 1)
        comm.all_reduce(e, group=sub)
        ctx = comm_context.context(sub)
        forced = ""
        with _Env(transport="shm"):
            try:
                comm.all_reduce(torch.ones(3), group=sub)
            except RuntimeError as exc:
                forced = str(exc)
        zero_copy = comm.in_transport_memory(e, group=sub)
        comm.shutdown(sub)
    finally:
        rendezvous.host_identity = real
    return {"sum": bool(torch.all(e == world * (world + 1) / 2)),
            "shm": ctx.transports.existing_shm() is not None, "zero_copy": zero_copy,
            "forced": forced}


def test_ranks_on_different_hosts_use_torch_transport(pools) -> None:
    for res in pools.run(2, _other_host):
        assert res["sum"] and not res["shm"] and not res["zero_copy"]
        assert "GRADRING_TRANSPORT=shm" in res["forced"] and "another host" in res["forced"]


# ------------------------------------------------------------------ zero copy
def _zero_copy(rank: int, world: int) -> dict[str, object]:
    ctx = comm_context.context(None)
    shm = ctx.transports.shm()
    # Above the one-shot size: one-shot always stages (it needs the inputs intact).
    row = select.oneshot_max_bytes(world) // 4 + 1
    x = comm.empty((10, row))
    x.fill_(rank + 1)
    before = shm.memory.staged_bytes
    comm.all_reduce(x)
    view = x[2:5]  # a contiguous view of comm.empty memory is zero-copy too
    comm.all_reduce(view, op=dist.ReduceOp.MAX)
    zero_copy_staged = shm.memory.staged_bytes - before
    # Above the inline size: inputs up to it travel in the control segments instead.
    user = torch.full((select.INLINE_MAX_BYTES // 4 + 1,), float(rank + 1))
    comm.all_reduce(user)
    tri = world * (world + 1) / 2
    mine = [n for n in os.listdir(segments.SHM_DIR) if n.startswith(f"gradring-{os.getpid()}-")]
    return {"sum": bool(torch.all(x[:2] == tri) and torch.all(x[5:] == tri)),
            "view": bool(torch.all(view == tri)), "in_memory": comm.in_transport_memory(x),
            "user_in_memory": comm.in_transport_memory(user),
            "zero_copy_staged": zero_copy_staged, "user_staged": shm.memory.staged_bytes - before,
            "segments": len(mine), "user": bool(torch.all(user == tri))}


@pytest.mark.parametrize("world", [2, 3])
def test_empty_is_zero_copy(pools, world: int) -> None:
    for res in pools.run(world, _zero_copy):
        assert res["sum"] and res["view"] and res["user"]
        assert res["in_memory"] and not res["user_in_memory"]
        assert res["zero_copy_staged"] == 0 and res["user_staged"] > 0
        assert res["segments"] >= 1


# ----------------------------------------------------- randomized stress (shm)
def _stress(rank: int, world: int, seed: int, steps: int) -> list[str]:
    rng = random.Random(seed)  # identical on every rank: same collective sequence
    bad = []
    pending = []
    for step in range(steps):
        kind = rng.choice(["ar", "ar", "ar", "bc", "ag", "rs"])
        count = rng.choice([1, 3, rng.randrange(1, 300), rng.randrange(300, 200_000)])
        dtype = rng.choice(DTYPES)
        zero_copy = rng.random() < 0.4
        if rng.random() < 0.3:  # mixed: odd ranks expose the other kind of memory
            zero_copy = zero_copy != (rank % 2 == 1)
        async_op = rng.random() < 0.5
        name = rng.choice(list(OPS))
        make = (lambda n, dt: comm.empty(n, dtype=dt)) if zero_copy else (
            lambda n, dt: torch.empty(n, dtype=dt))
        if kind == "ar":
            x = make(count, dtype)
            x.copy_(rank_data(rank, count, dtype, step))
            want = comm_oracle.oracle_all_reduce(
                [rank_data(r, count, dtype, step) for r in range(world)], Op(name))
            w = comm.all_reduce(x, op=OPS[name], async_op=async_op)
        elif kind == "bc":
            x = make(count, dtype)
            x.copy_(rank_data(rank, count, dtype, step))
            src = step % world
            want = rank_data(src, count, dtype, step)
            w = comm.broadcast(x, src=src, async_op=async_op)
        elif kind == "ag":
            inp = make(count, dtype)
            inp.copy_(rank_data(rank, count, dtype, step))
            x = torch.empty(world * count, dtype=dtype)
            want = torch.cat([rank_data(r, count, dtype, step) for r in range(world)])
            w = comm.all_gather_into_tensor(x, inp, async_op=async_op)
        else:
            inp = make(world * count, dtype)
            inp.copy_(rank_data(rank, world * count, dtype, step))
            x = torch.empty(count, dtype=dtype)
            want = comm_oracle.oracle_reduce_scatter(
                [rank_data(r, world * count, dtype, step) for r in range(world)], Op(name))[rank]
            w = comm.reduce_scatter_tensor(x, inp, op=OPS[name], async_op=async_op)
        pending.append((step, kind, x, want, w))
        if not async_op or len(pending) > 6:
            for s, k, got, exp, work in pending:
                if work is not None:
                    work.wait()
                if not torch.equal(got, exp):
                    bad.append(f"step {s} {k}")
            pending = []
    for s, k, got, exp, work in pending:
        if work is not None:
            work.wait()
        if not torch.equal(got, exp):
            bad.append(f"step {s} {k}")
    return bad


@pytest.mark.parametrize("world", [2, 3])
def test_randomized_stress_changing_sizes(pools, world: int) -> None:
    assert pools.run(world, _stress, 77 + world, 250, timeout=150) == [[]] * world


# -------------------------------------------------------------------- teardown
def _teardown(rank: int, world: int) -> dict[str, object]:
    def my_segments() -> set[str]:
        return {n for n in os.listdir(segments.SHM_DIR)
                if n.startswith(f"gradring-{os.getpid()}-")}

    g = dist.new_group(list(range(world)))  # gloo's own sockets are not ours to count
    fds_before = len(os.listdir("/proc/self/fd"))
    segs_before = my_segments()
    threads_before = {t.name for t in threading.enumerate()}
    e = comm.empty(4096, group=g)
    e.fill_(1)
    works = [comm.all_reduce(e, group=g, async_op=True) for _ in range(3)]
    works.append(comm.all_reduce(torch.ones(100_000), group=g, async_op=True))
    for w in works:
        w.wait()
    during = len(my_segments() - segs_before)
    del e, works
    comm.shutdown(g)
    import gc

    gc.collect()
    threads_after = {t.name for t in threading.enumerate()}
    return {"during": during, "segments_left": sorted(my_segments() - segs_before),
            "fds_delta": len(os.listdir("/proc/self/fd")) - fds_before,
            "threads_left": sorted(threads_after - threads_before)}


def test_shutdown_leaves_no_threads_fds_or_segments(pools) -> None:
    for res in pools.run(2, _teardown):
        assert res["during"] >= 1
        assert res["segments_left"] == [] and res["threads_left"] == []
        assert res["fds_delta"] <= 0, res


def _fork_then_exit(rank: int, world: int) -> dict[str, object]:
    """A forked child that exits normally (gradring's exit hooks run) must not tear
    down the parent's shared memory."""
    import weakref

    from gradring.comm.transports.shm import transport as shm_transport

    x = comm.empty(70_000)
    x.fill_(1)
    comm.all_reduce(x)
    mine = lambda: {n for n in os.listdir(segments.SHM_DIR)
                    if n.startswith(f"gradring-{os.getpid()}-")}
    before = mine()
    pid = os.fork()
    if pid == 0:  # child: gradring's exit handlers, as a normal exit would run them
        try:  # (only ours: the pool's pipes and gloo sockets are shared with the parent)
            comm_context.shutdown(all_groups=True, timeout=1.0)
            shm_transport._close_all()
            weakref.finalize._exitfunc()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    after = mine()
    x.fill_(rank + 1)
    comm.all_reduce(x)
    return {"kept": before <= after, "sum": bool(torch.all(x == world * (world + 1) / 2))}


def test_forked_child_does_not_unlink_parent_segments(pools) -> None:
    for res in pools.run(2, _fork_then_exit):
        assert res == {"kept": True, "sum": True}


# --------------------------------------------------- separate jobs (subprocess)
def _job_main(argv: list[str]) -> None:
    """A small standalone job; see the tests below for the scenarios."""
    p = argparse.ArgumentParser()
    p.add_argument("--scenario", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--store", required=True)
    p.add_argument("--steps", type=int, default=200)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(a.store, a.world), rank=a.rank,
                            world_size=a.world, timeout=timedelta(seconds=60))
    report: dict[str, object] = {"pid": os.getpid(), "rank": a.rank}
    if a.scenario == "sums":
        wrong = 0
        for step in range(a.steps):
            x = comm.empty(5000) if step % 2 else torch.empty(5000)
            x.fill_(1000.0 + a.rank + step)
            comm.all_reduce(x)
            wrong += int(not torch.all(x == a.world * (1000.0 + step) + sum(range(a.world))))
        report["wrong"] = wrong
    elif a.scenario == "failures":
        # [Note: faults by events, not durations]
        # The silent rank stays alive until every survivor has seen `sub` time out
        # (its own deadline, 10 s), and the survivors issue the next collectives
        # only once it is dead, on the world group whose deadline is longer (60 s).
        # So a silent peer can only be a timeout, and a dead one must be detected:
        # an error naming the exit (not "timed out") could not come from a deadline.
        last = a.world - 1
        pids: list[object] = [None] * a.world
        dist.all_gather_object(pids, os.getpid())
        sub = dist.new_group(list(range(a.world)), timeout=timedelta(seconds=10))
        comm.all_reduce(torch.ones(4), group=sub)  # connect while everybody is there
        keep = comm.empty(100_000)  # a data segment a kill -9 leaves behind
        comm.all_reduce(keep)
        report["segments"] = sorted(n for n in os.listdir(segments.SHM_DIR)
                                    if n.startswith(f"gradring-{os.getpid()}-"))
        print(json.dumps(report), flush=True)
        seen = lambda r: os.path.join(os.path.dirname(a.store), f"silent-seen-{r}")  # noqa: E731
        if a.rank == last:
            _wait_until(lambda: all(os.path.exists(seen(r)) for r in range(last)))  # silent ...
            os.kill(os.getpid(), signal.SIGKILL)  # ... then dead
        for label, group, transport in (("silent", sub, "shm"), ("dead", None, "shm"),
                                        ("dead_torch", None, "torch")):
            if label == "dead":
                report["saw_it_dead"] = _wait_until(lambda: not segments.pid_alive(pids[last]))
            os.environ["GRADRING_TRANSPORT"] = transport
            try:
                comm.all_reduce(torch.ones(1000), group=group)
                report[label] = "no error"
            except Exception as exc:  # noqa: BLE001 - reported to the test
                report[label] = f"{type(exc).__name__}: {exc}"
            if label == "silent":
                open(seen(a.rank), "w").close()
    print(json.dumps(report), flush=True)
    comm.shutdown()
    os._exit(0)  # the process group may be wedged by the dead peer


def _wait_until(ready, limit_s: float = 120.0) -> bool:
    """Poll ``ready`` until it holds; False if it still does not after ``limit_s``
    (a bound on a broken job's wait, not a measurement: the test fails then)."""
    give_up = time.monotonic() + limit_s
    while not ready():
        if time.monotonic() > give_up:
            return False
        time.sleep(0.01)
    return True


def _start_job(scenario: str, world: int, tmp: str, env: dict[str, str] | None = None,
               **extra: object) -> list[subprocess.Popen]:
    # Imported here: run as a job script, this file does not import tests.support.
    from tests.support import jobs

    store = os.path.join(tmp, f"{scenario}-store")
    extra_args = [f"--{k}={v}" for k, v in extra.items()]
    return jobs.start(os.path.abspath(__file__), world,
                      lambda r: ["--scenario", scenario, "--rank", str(r), "--world",
                                 str(world), "--store", store, *extra_args],
                      jobs.job_env(env, drop=()))


def _reports(procs: list[subprocess.Popen], timeout: float) -> list[list[dict]]:
    from tests.support import jobs

    return [r["reports"] for r in jobs.collect(procs, timeout)]


def _sums_on_pool(rank: int, world: int, steps: int) -> int:
    wrong = 0
    for step in range(steps):
        x = comm.empty(5000) if step % 2 else torch.empty(5000)
        x.fill_(float(rank + step))
        comm.all_reduce(x)
        wrong += int(not torch.all(x == world * step + sum(range(world))))
    return wrong


def test_two_jobs_on_one_host_do_not_collide(pools, tmp_path) -> None:
    pools.run(2, _sums_on_pool, 1)  # pool up before the other job starts
    procs = _start_job("sums", 2, str(tmp_path), steps=600)
    wrong_pool = 0
    while any(p.poll() is None for p in procs):  # overlap as long as the other job runs
        wrong_pool += sum(pools.run(2, _sums_on_pool, 100))
    reports = _reports(procs, timeout=120)
    assert wrong_pool == 0
    assert [r[-1]["wrong"] for r in reports] == [0, 0], reports


def test_dead_or_silent_peer_raises_and_leaves_no_segments(tmp_path) -> None:
    world = 3
    procs = _start_job("failures", world, str(tmp_path))
    reports = _reports(procs, timeout=300)
    assert procs[-1].returncode == -signal.SIGKILL
    dead = reports[-1][0]
    for rank in range(world - 1):
        final = reports[rank][-1]
        assert final["saw_it_dead"], final
        # Silent: only its group's deadline (10 s) can end the wait.
        msg = final["silent"]
        assert "CollectiveError" in msg and "all_reduce #2" in msg, msg
        assert f"ranks [{world - 1}] did not arrive" in msg and "timed out" in msg, msg
        # Dead: detected, not timed out (the world group's deadline is 60 s; see
        # [Note: faults by events, not durations]).
        msg = final["dead"]
        assert "CollectiveError" in msg and f"rank {world - 1} (pid {dead['pid']}) has exited" \
            in msg, msg
        assert "timed out" not in msg, msg
        msg = final["dead_torch"]
        assert msg != "no error", msg
    # Survivors unlinked their own segments at exit.
    names = set(os.listdir(segments.SHM_DIR))
    for rank in range(world - 1):
        assert not any(n.startswith(f"gradring-{reports[rank][0]['pid']}-") for n in names)
    # The killed rank could not; its peers removed its segments when they saw it dead
    # (faults round 2; before, they stayed until the next start of a shm transport).
    assert dead["segments"]  # it did own some
    assert not [n for n in dead["segments"] if n in names]
    segments.remove_stale_segments()
    assert not any(n.startswith(f"gradring-{dead['pid']}-") for n in os.listdir(segments.SHM_DIR))



# ------------------------------------------- multiprocessing children (fork)
def _mp_rank(rank: int, world: int, store: str, how: str) -> None:
    """A rank of a ``multiprocessing`` fork child, as torch's MultiProcessTestCase runs
    them: its target returns (after ``destroy_process_group``) or calls ``sys.exit``,
    and multiprocessing then ends it with ``os._exit``: no atexit."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    x = comm.empty(20_000)  # a comm.empty segment
    x.fill_(1)
    comm.all_reduce(x)
    comm.all_reduce(torch.ones(30_000))  # a staging segment
    owned = [n for n in os.listdir(segments.SHM_DIR) if n.startswith(f"gradring-{os.getpid()}-")]
    with open(f"{store}-rank{rank}.json", "w") as f:  # both ranks share one stdout
        json.dump({"owned": owned, "sum": bool(torch.all(x == world))}, f)
    if how == "destroy":
        dist.destroy_process_group()
    else:
        sys.exit(0)


def _mp_job(how: str, tmp: str) -> None:
    """Run 2 ranks as forked multiprocessing children; report what they left."""
    import multiprocessing

    world, ctx, store = 2, multiprocessing.get_context("fork"), os.path.join(tmp, "store")
    procs = [ctx.Process(target=_mp_rank, args=(r, world, store, how)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    for p in procs:
        if p.exitcode is None:
            p.kill()
            p.join()
    left = sorted(n for n in os.listdir(segments.SHM_DIR)
                  if any(n.startswith(f"gradring-{p.pid}-") for p in procs))
    for n in left:  # the test reports them; they must not outlive it
        segments.unlink_quietly(n)
    ranks = []
    for r in range(world):
        with contextlib.suppress(OSError, ValueError), open(f"{store}-rank{r}.json") as f:
            ranks.append(json.load(f))
    print(json.dumps({"codes": [p.exitcode for p in procs], "ranks": ranks, "left": left}),
          flush=True)


@pytest.mark.parametrize("how", ["destroy", "sys_exit"])
def test_multiprocessing_fork_children_leave_no_segments(tmp_path, how: str) -> None:
    # See [Note: multiprocessing children skip atexit] in gradring/comm/context.py.
    from tests.support import jobs

    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--mp-job", how,
                          str(tmp_path)], capture_output=True, text=True, timeout=150,
                         env=jobs.job_env(), cwd=jobs.ROOT)
    reports = jobs.reports_of(out.stdout)
    assert out.returncode == 0 and reports, out.stderr[-5000:]
    final = reports[-1]
    assert final["codes"] == [0, 0] and len(final["ranks"]) == 2, out.stderr[-5000:]
    assert all(r["sum"] and r["owned"] for r in final["ranks"])  # they owned segments ...
    assert final["left"] == []  # ... and released them at exit


def test_stale_segments_of_dead_owners_are_removed() -> None:
    # What a dead process left (its peers gone too) goes at the next transport start;
    # remove_dead_owners (a peer's prefix) takes only that prefix.
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # a pid that is dead now
    ns = segments.pid_namespace()
    names = [f"gradring-{child.pid}-{ns}-0-aa", f"gradring-{child.pid}-{ns}-1-bb"]
    for n in names:
        open(os.path.join(segments.SHM_DIR, n), "w").close()
    try:
        assert segments.remove_dead_owners(f"gradring-{child.pid}-{ns}-1") == names[1:]
        assert set(names[:1]) <= set(segments.remove_stale_segments())
    finally:
        for n in names:
            segments.unlink_quietly(n)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--mp-job"]:
        _mp_job(sys.argv[2], sys.argv[3])
    else:
        _job_main(sys.argv[1:])
