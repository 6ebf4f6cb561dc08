"""Rank side of the shared-memory hardening tests (run by ``tests/support/shm_jobs.py``).

Each scenario is ``fn(rank, world, tmp) -> hard_exit``; it prints JSON reports
with :func:`tests.support.shm_jobs.say`. A true return value makes the rank leave with
``os._exit`` (its process group may be wedged by a failed peer).
"""

from __future__ import annotations

import copy
import gc
import hashlib
import json
import os
import signal
import sys
import time
import types

import torch
import torch.distributed as dist
from torch import nn

import gradring
from gradring import comm
from tests.support.shm_jobs import say


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


# ------------------------------------------------------------- 1: small /dev/shm
def _train(ddp: nn.Module, rank: int, steps: int = 3) -> None:
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(steps):
        g = torch.Generator().manual_seed(10 * step + rank)
        opt.zero_grad()
        ddp(torch.randn(4, 2048, generator=g)).pow(2).mean().backward()
        opt.step()


def small_shm(rank: int, world: int, tmp: str) -> bool:
    """A ~16 MiB model on an 8 MiB /dev/shm, against torch's DDP over gloo."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 8))
    ours, theirs = copy.deepcopy(model), copy.deepcopy(model)
    try:
        _train(gradring.DistributedDataParallel(ours), rank)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        say(rank=rank, error=_error(exc))
        return True
    _train(nn.parallel.DistributedDataParallel(theirs), rank)
    diff = max((a - b).abs().max().item() for a, b in zip(ours.parameters(),
                                                          theirs.parameters()))
    say(rank=rank, error=None, diff=diff)
    comm.shutdown()
    return False


def small_shm_forced(rank: int, world: int, tmp: str) -> bool:
    """GRADRING_TRANSPORT=shm on an 8 MiB /dev/shm: no fallback allowed."""
    os.environ["GRADRING_TRANSPORT"] = "shm"
    x = torch.ones(4 << 20)  # 16 MiB: its staging buffer cannot fit
    try:
        comm.all_reduce(x)
        say(rank=rank, error=None, value=float(x[0]))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        say(rank=rank, error=_error(exc))
    comm.shutdown()
    return False


# --------------------------------------------------------------- 2: late peers
def _attempt(fn) -> dict:
    try:
        fn()
        return {"error": None}
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return {"error": _error(exc)}


# [Note: late by events, not by sleeps]
# A late rank used to sleep 3.5 s against a 2 s deadline, so that it arrived
# after the others gave up; on a loaded machine the others could start late
# too. Now it waits for their flags: it arrives only once every other rank has
# returned from the collective it gave up on. Each wait is bounded only so that
# a broken job ends (the test then fails on the reports).
def _raise_flag(tmp: str, name: str) -> None:
    open(os.path.join(tmp, f"flag-{name}"), "w").close()


def _await_flags(tmp: str, names: list[str], limit_s: float = 120.0) -> None:
    give_up = time.monotonic() + limit_s
    while not all(os.path.exists(os.path.join(tmp, f"flag-{n}")) for n in names) \
            and time.monotonic() < give_up:
        time.sleep(0.01)


def late_small(rank: int, world: int, tmp: str) -> bool:
    """Small-message path: the last rank arrives after the others gave up
    (GRADRING_TIMEOUT); see [Note: late by events, not by sleeps]."""
    late = rank == world - 1
    dist.barrier()
    comm.all_reduce(torch.ones(8))  # connect
    dist.barrier()  # in step before the short deadline starts to matter
    if late:
        _await_flags(tmp, [f"late_small-gave-up-{r}" for r in range(world - 1)])
    x = torch.full((1000,), float(rank + 1))
    out = _attempt(lambda: comm.all_reduce(x))
    if not late:
        _raise_flag(tmp, f"late_small-gave-up-{rank}")
    say(rank=rank, case="late_small", value=float(x[0]), **out)
    return True


def late_zero_copy(rank: int, world: int, tmp: str) -> bool:
    """Zero-copy path (a ``comm.empty`` buffer, as DDP buckets): the last rank arrives
    after the others gave up; nobody's memory may change afterwards (see
    [Note: late by events, not by sleeps])."""
    late = rank == world - 1
    big = comm.empty(1 << 20)
    big.fill_(float(rank + 1))
    dist.barrier()  # in step before the short deadline starts to matter
    comm.all_reduce(torch.ones(8))  # connect, in step
    dist.barrier()
    if late:
        _await_flags(tmp, [f"late_zero_copy-gave-up-{r}" for r in range(world - 1)])
    out = _attempt(lambda: comm.all_reduce(big))
    before = big.clone()
    if late:
        _raise_flag(tmp, "late_zero_copy-late-done")
    else:
        _raise_flag(tmp, f"late_zero_copy-gave-up-{rank}")
        # The late rank arrives (and would write) meanwhile.
        _await_flags(tmp, ["late_zero_copy-late-done"])
    changed = int((big != before).sum())
    say(rank=rank, case="late_zero_copy", changed=changed, **out)
    return True


# -------------------------------------------------- 3: foreign exceptions inside
def _inject(rank: int, case: str):
    """Make rank 1 fail inside the collective with a non-gradring exception; returns
    the undo."""
    from gradring.comm import ops
    from gradring.comm.transports.shm import segments

    if rank != 1:
        return lambda: None
    if case == "mmap_value_error":
        orig = segments.Segment.open

        def bad_open(name: str, **kw: object) -> None:
            raise ValueError("mmap offset is greater than file size")
        segments.Segment.open = bad_open  # type: ignore[method-assign,assignment]
        return lambda: setattr(segments.Segment, "open", orig)
    if case == "torch_shape_error":
        orig_reduce = ops.reduce_into

        def bad_reduce(*args: object, **kw: object) -> None:
            torch.ones(2) + torch.ones(3)  # the size of tensor a (2) must match ...
        ops.reduce_into = bad_reduce  # type: ignore[assignment]
        return lambda: setattr(ops, "reduce_into", orig_reduce)
    if case == "file_exists":
        orig_create = segments.Segment.create

        def bad_create(name: str, size: int, **kw: object) -> None:
            raise FileExistsError(17, "File exists", name)
        segments.Segment.create = bad_create  # type: ignore[method-assign,assignment]
        return lambda: setattr(segments.Segment, "create", orig_create)
    raise ValueError(case)


def foreign_error(rank: int, world: int, tmp: str) -> bool:
    """Rank 1 raises something that is not a CollectiveError inside a collective (the
    staged one-shot for the shape error: above the inline size, whose failures after
    its barrier are ``inline_foreign_error``'s case)."""
    sizes = {"mmap_value_error": 1 << 20, "torch_shape_error": 20_000, "file_exists": 1 << 20}
    for case, numel in sizes.items():
        comm.all_reduce(torch.ones(8))  # connect (fresh transport per case)
        undo = _inject(rank, case)
        out = _attempt(lambda n=numel: comm.all_reduce(torch.ones(n)))
        undo()
        say(rank=rank, case=case, **out)
        comm.shutdown()
        dist.barrier()
    return True


# ---------------------------------------------------------------- 4: squatters
NOBODY = 65534


def _squat(names: list[str]) -> int:
    """Create ``names`` in /dev/shm as user nobody (a forked child); how many it got."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the squatter
        made = 0
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            for n in names:
                try:
                    os.close(os.open(os.path.join("/dev/shm", n),
                                     os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
                    made += 1
                except OSError:
                    pass
        finally:
            os.write(w, str(made).encode())
            os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    made = int(os.read(r, 64) or b"0")
    os.close(r)
    return made


def _guesses(pid: int) -> list[str]:
    """What an outsider can derive from the names it sees: the same prefix with the
    next numbers (the old scheme counted up), and the same for every visible prefix."""
    seen = [n for n in os.listdir("/dev/shm") if n.startswith(f"gradring-{pid}-")]
    prefixes = {n.rsplit("-", 1)[0] for n in seen} | {n.rsplit("-", 2)[0] for n in seen}
    return sorted({f"{p}-{k}" for p in prefixes for k in range(64)} - set(seen))


def squat(rank: int, world: int, tmp: str) -> bool:
    """User nobody pre-creates every name it can guess (and, white-box, the exact next
    two names of this rank); DDP must still build and train like torch's DDP."""
    from gradring.comm.context import context
    from gradring.comm.transports.shm import segments

    comm.all_reduce(torch.ones(1 << 17))  # connect; creates a staging segment
    names = _guesses(os.getpid())
    shm = context(None).transports.existing_shm()
    if hasattr(segments, "segment_name"):  # the exact next names: force the retry
        names += shm.memory.next_names(2)
    return _train_squatted(rank, names)


def _train_squatted(rank: int, names: list[str]) -> bool:
    """Squat ``names`` as nobody, then train gradring's DDP against torch's; report."""
    made = _squat(names)
    dist.barrier()
    try:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
        ours, theirs = copy.deepcopy(model), copy.deepcopy(model)
        for ddp, m in ((gradring.DistributedDataParallel(ours, bucket_cap_mb=0.02), ours),
                       (nn.parallel.DistributedDataParallel(theirs), theirs)):
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            for step in range(3):
                opt.zero_grad()
                g = torch.Generator().manual_seed(step * 10 + rank)
                ddp(torch.randn(8, 64, generator=g)).pow(2).mean().backward()
                opt.step()
        x = torch.full((1 << 20,), float(rank + 1))  # a larger staging set: a new name
        comm.all_reduce(x)
        diff = max((a - b).abs().max().item() for a, b in zip(ours.parameters(),
                                                              theirs.parameters()))
        say(rank=rank, error=None, squatted=made, diff=diff, value=float(x[0]))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        say(rank=rank, error=_error(exc), squatted=made)
    for n in names:
        try:
            if os.stat(os.path.join("/dev/shm", n)).st_uid == NOBODY:
                os.unlink(os.path.join("/dev/shm", n))
        except OSError:
            pass
    comm.shutdown()
    return False


def _store_values() -> list[dict]:
    """Every JSON object the shm rendezvous left in the job's store: what any local
    user can read from an unauthenticated TCPStore."""
    from gradring.comm.store import group_store

    store, out = group_store(dist.group.WORLD), []
    for gen in range(4):
        for what in ("info", "ctl"):
            for r in range(8):
                k = f"gradring/shm/{gen}/{what}/{r}"
                if store.check([k]):
                    v = json.loads(store.get(k))
                    if isinstance(v, dict):
                        out.append(v)
    return out


def _predict_from_store(count: int) -> list[str]:
    """The names an outsider derives from the store: with a naming secret published
    there, ``blake2b(base/segno, key=secret)`` for every announced prefix."""
    values = _store_values()
    secrets = [v["secret"] for v in values if isinstance(v.get("secret"), str)]
    bases = {v["base"] for v in values if isinstance(v.get("base"), str)}
    bases |= {v["name"].rsplit("-", 1)[0] for v in values if isinstance(v.get("name"), str)}
    return sorted({f"{b}-" + hashlib.blake2b(f"{b}/{k}".encode(), key=bytes.fromhex(sec),
                                             digest_size=8).hexdigest()
                   for sec in secrets for b in bases for k in range(count)})


def store_squat(rank: int, world: int, tmp: str) -> bool:
    """User nobody reads the job's store after the shm rendezvous and pre-creates every
    name it can derive from it (plus what /dev/shm lists); DDP must still train like
    torch's DDP."""
    comm.all_reduce(torch.ones(1 << 17))  # connect; creates a staging segment
    dist.barrier()
    predicted = _predict_from_store(400)
    say(rank=rank, predicted=len(predicted))
    return _train_squatted(rank, predicted + _guesses(os.getpid()))


def taken_names(rank: int, world: int, tmp: str) -> bool:
    """White-box: every one of rank 1's next 40 names is taken (as if guessed): no
    failure, a warning, the same result over the process group."""
    from gradring.comm.context import context

    comm.all_reduce(torch.ones(1 << 17))  # connect
    names = []
    if rank == 1:
        names = context(None).transports.existing_shm().memory.next_names(40)
    return _train_squatted(rank, names)


def bad_offset(rank: int, world: int, tmp: str) -> bool:
    """Rank 1 publishes an offset near the end of its staging segment."""
    from gradring.comm.transports.shm.memory import SegmentBook

    comm.all_reduce(torch.ones(8))
    if rank == 1:
        orig = SegmentBook.outgoing

        def lying(self, exposed):  # type: ignore[no-untyped-def]
            slot, no_room, segno, offset = orig(self, exposed)
            if exposed is not None and self.staging_size(segno):
                offset = self.staging_size(segno) - 4
            return slot, no_room, segno, offset
        SegmentBook.outgoing = lying  # type: ignore[method-assign]
    x = torch.full((20_000,), float(rank + 1))  # staged: above the inline size
    out = _attempt(lambda: comm.all_reduce(x))
    say(rank=rank, case="bad_offset", value=float(x[0]), **out)
    return True


def inline_foreign_error(rank: int, world: int, tmp: str) -> bool:
    """Rank 1 raises inside the sum of an inline all-reduce, after its one barrier
    ([Note: inline exchange]): it gets the error, the others complete with the right
    sum, and the group then refuses the next collective everywhere, naming rank 1."""
    from gradring.comm import ops

    comm.all_reduce(torch.ones(8))  # connect
    undo = lambda: None  # noqa: E731
    if rank == 1:
        orig = ops.reduce_into

        def bad_reduce(*args: object, **kw: object) -> None:
            torch.ones(2) + torch.ones(3)  # the size of tensor a (2) must match ...
        ops.reduce_into = bad_reduce  # type: ignore[assignment]
        undo = lambda: setattr(ops, "reduce_into", orig)  # noqa: E731
    x = torch.full((8,), float(rank + 1))
    out = _attempt(lambda: comm.all_reduce(x))
    undo()
    say(rank=rank, case="inline", value=float(x[0]), **out)
    out = _attempt(lambda: comm.all_reduce(torch.ones(8)))
    say(rank=rank, case="next", **out)
    return True


# ------------------------------------------------------------------- 5: leaks
def _gradring_maps() -> int:
    with open("/proc/self/maps") as f:
        return sum("gradring-" in line for line in f)


def leak_buckets(rank: int, world: int, tmp: str) -> bool:
    """40 bucket-like ``comm.empty`` buffers, large enough for the zero-copy two-shot
    (so peers map each one), all freed at once -- more than the 30-slot ring --
    five times over: mappings and fds must not grow."""
    counts = []
    for cycle in range(5):
        bufs = [comm.empty(1 << 17) for _ in range(40)]  # 512 KiB each
        for k, b in enumerate(bufs):
            b.fill_(float(rank + k))
            comm.all_reduce(b)
            if float(b[0]) != 2 * k + 1:
                raise AssertionError(f"cycle {cycle}, buffer {k}: {float(b[0])}")
        comm.all_reduce(torch.ones(8))  # the peer collects what was retired before
        gc.collect()
        counts.append([_gradring_maps(), len(os.listdir("/proc/self/fd"))])
        del bufs, b
        gc.collect()
    say(rank=rank, error=None, counts=counts)
    comm.shutdown()
    return False


def sigterm(rank: int, world: int, tmp: str) -> bool:
    """Rank 0 blocks in a collective rank 1 never joins; rank 1 sends it SIGTERM (as
    torchrun does) and looks for rank 0's segments afterwards."""
    from gradring.comm.transports.shm import segments

    pids: list = [None] * world
    dist.all_gather_object(pids, os.getpid())
    if rank == 0 and os.environ.get("SHM_TEST_PREV_HANDLER") == "raise":
        def theirs(signum: int, frame: object) -> None:
            print("previous handler ran", file=sys.stderr, flush=True)
            raise SystemExit(7)
        signal.signal(signal.SIGTERM, theirs)
    big = comm.empty(1 << 18)
    big.fill_(1.0)
    comm.all_reduce(big)
    comm.all_reduce(torch.ones(1 << 16))  # staged: a named staging segment
    mine = sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"gradring-{pids[rank]}-"))
    say(rank=rank, names=mine)
    if rank == 0:
        out = _attempt(lambda: comm.all_reduce(torch.ones(100)))
        say(rank=rank, case="blocked", **out)  # only with a previous handler that raises
        return True
    time.sleep(2.0)
    t_kill = time.time()
    os.kill(pids[0], signal.SIGTERM)
    deadline = time.monotonic() + 20
    while segments.pid_alive(pids[0]) and time.monotonic() < deadline:
        time.sleep(0.002)
    gone = time.time() - t_kill
    left = sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"gradring-{pids[0]}-"))
    say(rank=rank, error=None, leftover=left, gone_after=gone)
    for n in left:  # today's code leaves them: do not leak them into the machine
        segments.unlink_quietly(n)
    comm.shutdown()
    return False


# -------------------------------------------------------- also: flight, retries
def _small_ddp() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 4))
    ddp = gradring.DistributedDataParallel(model, bucket_cap_mb=0.005)
    dist.barrier()  # start training together: the deadlines here are short
    return ddp, torch.optim.SGD(ddp.parameters(), lr=0.01)


def _ddp_step(ddp: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> None:
    g = torch.Generator().manual_seed(100 * step + rank)
    opt.zero_grad()
    ddp(torch.randn(8, 16, generator=g)).pow(2).mean().backward()
    opt.step()


def flight_stall(rank: int, world: int, tmp: str) -> bool:
    """Rank 1 stalls at step 3; rank 0 times out, then kills it (as torchrun would):
    only rank 0 leaves a flight-recorder dump."""
    pids: list = [None] * world
    dist.all_gather_object(pids, os.getpid())
    ddp, opt = _small_ddp()
    for step in range(6):
        if rank == 1 and step == 3:
            time.sleep(60)
        try:
            _ddp_step(ddp, opt, step, rank)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            say(rank=rank, error=_error(exc), step=step)
            os.kill(pids[1], signal.SIGKILL)
            return True
    say(rank=rank, error=None)
    return True


def keep_training(rank: int, world: int, tmp: str) -> bool:
    """Rank 0 catches gradring's error and trains on; count the store waits it makes."""
    import gradring.comm.store as store_mod

    ddp, opt = _small_ddp()
    for step in range(2):
        _ddp_step(ddp, opt, step, rank)
    if rank == 1:
        time.sleep(5)
    first = _attempt(lambda: _ddp_step(ddp, opt, 2, rank))
    if rank == 1:  # it stops (or exits); only rank 0 trains on
        say(rank=rank, case="keep_training", first=first)
        time.sleep(6)
        return True
    # Over the torch transport the next backward fails inside its hooks (the group is
    # unusable), leaving the reduction unfinished: the step after that is the one
    # that used to wait for the peers' unused-parameter lists.
    second = _attempt(lambda: _ddp_step(ddp, opt, 3, rank))
    sleeps = []
    real = store_mod.time

    class CountingTime:  # only store.py's clock: count its polling sleeps
        monotonic = staticmethod(real.monotonic)

        @staticmethod
        def sleep(s: float) -> None:
            sleeps.append(s)
            real.sleep(s)
    store_mod.time = CountingTime  # type: ignore[assignment]
    again = _attempt(lambda: _ddp_step(ddp, opt, 4, rank))
    # What the reducer's unfinished-reduction error does first: swap the lists of
    # parameters without gradients with peers that will never answer.
    comm_like = types.SimpleNamespace(group=dist.distributed_c10d._get_default_group(),
                                      rank=rank, world_size=world)
    lists = store_mod.exchange_lists(comm_like, "unused/99", [3])
    store_mod.time = real
    say(rank=rank, case="keep_training", first=first, second=second, again=again,
        sleeps=len(sleeps), lists={str(k): v for k, v in lists.items()})
    return True
