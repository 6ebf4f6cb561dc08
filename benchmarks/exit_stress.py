"""Deaths at exit: jobs that end with collectives in flight, run many times beside CPU hogs.

A process whose threads sit in a C++ call (a gloo wait, gloo's own worker) when
the interpreter finalizes can die of SIGABRT ("terminate called without an
active exception") after it printed its result or its error: see [Note: how a
gradring process exits] in ``gradring/comm/leaving.py``. This script runs the
jobs that showed it, each ``--runs`` times with ``--hogs`` processes spinning
beside them, with gradring's collectives and with torch's own, and prints for
each how many runs ended with a death at exit (a rank killed by a signal, or
"terminate called" on its stderr) and how many with another status than the
one the script chose:

- ``inflight``: both ranks do one warm-up all-reduce; rank 0 then starts an
  asynchronous all-reduce of 65,536 floats and calls ``sys.exit(3)`` 0.3 s
  later, while rank 1 sleeps ``--peer-sleep`` seconds (6) and then tries the
  same all-reduce (it reports the error it gets and exits 0). gradring runs it
  on the shared-memory transport and on ``GRADRING_TRANSPORT=torch``, with
  ``GRADRING_TIMEOUT=4``; torch's control is ``dist.all_reduce(async_op=True)``.
  The ranks are forked from this script (torch is imported once) and end as a
  script's main module does, through the interpreter's finalization.
- ``floor``: the 8-byte floor benchmark's shape: ``mp.start_processes`` (spawn),
  2 ranks, a file store; 5 rounds of 400 all-reduces of 2 floats with
  gradring's and 400 with ``dist.all_reduce`` (torch's control: both blocks
  torch's), a barrier and a MAX all-reduce of a float64 between blocks, then
  ``destroy_process_group()`` and a normal return (exit 0).

``ending`` and ``destroy`` give the variants the tests use (an error exit,
an uncaught exception, a clean exit; with or without destroying the group),
``launcher`` spawn, fork, torchrun, or script (ranks forked from the job
process that end as a script's main module: the interpreter finalizes).
``--job`` runs one job and prints its outcome as JSON; ``--batch`` runs several
from one process, which imports torch once (the tests call it that way).
Exit status 1 with ``--fail-on-death`` when any gradring run died.

    python benchmarks/exit_stress.py --runs 10 --hogs 2
    python benchmarks/exit_stress.py --runs 50 --hogs 2 --scenarios inflight-torch
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)

#: Scenario name -> (kind, GRADRING_TRANSPORT or "").
SCENARIOS = {
    "inflight-shm": ("inflight", "shm"),
    "inflight-torch": ("inflight", "torch"),
    "floor": ("floor", ""),
}
#: How a rank process that dies at exit shows it.
TERMINATE = "terminate called"


@dataclass
class Job:
    """One job: what runs in the ranks and how they are launched."""

    kind: str = "inflight"  # inflight | floor
    impl: str = "gradring"  # gradring | torch
    transport: str = ""  # GRADRING_TRANSPORT for gradring's collectives ("": default)
    ending: str = "error"  # error (sys.exit(3)) | raise (exception) | clean (return)
    destroy: bool = False  # rank calls destroy_process_group() before it ends
    launcher: str = "spawn"  # spawn | fork | script | torchrun
    peer_sleep: float = 6.0  # inflight, ending error/raise: rank 1's sleep
    timeout: str = "4"  # GRADRING_TIMEOUT
    env: dict[str, str] = field(default_factory=dict)

    def expected(self) -> list[int]:
        """Each rank's exit status as the script chooses it."""
        if self.kind == "inflight" and self.ending == "error":
            return [3, 0]
        if self.kind == "inflight" and self.ending == "raise":
            return [1, 0]
        return [0, 0]

    def name(self) -> str:
        t = f"/{self.transport}" if self.transport else ""
        d = "+destroy" if self.destroy else ""
        return f"{self.kind}{t}:{self.impl}:{self.ending}{d}:{self.launcher}"


# ------------------------------------------------------------------ rank side
def _rank_body(job: Job, rank: int, world: int, init: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if init == "env://":
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    if job.impl == "gradring":
        from gradring import comm
        reduce_ = comm.all_reduce
    else:
        reduce_ = dist.all_reduce
    if job.kind == "floor":
        _floor(reduce_, job.impl == "gradring")
        dist.destroy_process_group()
        return
    t = torch.ones(65536)
    reduce_(t)  # warm-up
    if rank == 0:
        reduce_(t, async_op=True)
        time.sleep(0.3)
        if job.ending == "error":
            sys.exit(3)
        if job.ending == "raise":
            raise RuntimeError("rank 0 gives up (the exit test's own error)")
    elif job.ending in ("error", "raise"):
        time.sleep(job.peer_sleep)
        try:
            reduce_(t)
        except Exception as exc:  # noqa: BLE001 - the peer's error is what is reported
            print(f"rank 1 error: {str(exc).splitlines()[0][:300]}", file=sys.stderr,
                  flush=True)
        return
    else:
        reduce_(t, async_op=True)
        time.sleep(0.3)
    if job.destroy:
        dist.destroy_process_group()


def _floor(reduce_: Any, mixed: bool) -> None:
    import torch
    import torch.distributed as dist

    x = torch.ones(2)
    for _ in range(5):
        for use_gradring in (mixed, False):
            t0 = time.perf_counter()
            for _ in range(400):
                (reduce_ if use_gradring else dist.all_reduce)(x)
            dist.barrier()
            took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)


def _mp_rank(rank: int, job: dict[str, Any], init: str, err_path: str) -> None:
    """A multiprocessing rank: its stdout and stderr go to ``err_path``."""
    fd = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.update(job["env"])
    _rank_body(Job(**job), rank, 2, init)


class _RankExit(BaseException):
    """Carries a ``script`` rank's outcome up to this file's main level, where the
    forked rank ends as a script's main module would (see :func:`_run_script`)."""

    def __init__(self, error: BaseException | None) -> None:
        super().__init__()
        self.error = error

    def finish(self) -> None:
        if self.error is not None:
            raise self.error  # SystemExit: its code; anything else: a traceback, exit 1


# ------------------------------------------------------------------ launcher side
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def job_env(job: Job) -> dict[str, str]:
    env = {"GRADRING_TIMEOUT": job.timeout, "OMP_NUM_THREADS": "1", "GRADRING_QUIET": "1"}
    if job.transport:
        env["GRADRING_TRANSPORT"] = job.transport
    env.update(job.env)
    return env


def _run_mp(job: Job, work: str, limit: float) -> dict[str, Any]:
    ctx = multiprocessing.get_context(job.launcher)
    init = f"file://{work}/store"
    spec = asdict(job)
    spec["env"] = job_env(job)
    errs = [os.path.join(work, f"rank{r}.err") for r in range(2)]
    procs = [ctx.Process(target=_mp_rank, args=(r, spec, init, errs[r])) for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + limit
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    hung = [p for p in procs if p.exitcode is None]
    for p in hung:
        p.kill()
        p.join()
    codes = [p.exitcode if p not in hung else "hung" for p in procs]
    text = ""
    for r, path in enumerate(errs):
        if os.path.exists(path):
            with open(path, errors="replace") as f:
                text += f"[rank {r}]\n" + f.read()
    return {"codes": codes, "stderr": text}


def _run_script(job: Job, work: str, limit: float) -> dict[str, Any]:
    """Ranks forked from this process (torch imported once) that end as a script's main
    module does: the interpreter finalizes, with the status the body chose."""
    init = f"file://{work}/store"
    errs = [os.path.join(work, f"rank{r}.err") for r in range(2)]
    pids = []
    for r in range(2):
        pid = os.fork()
        if pid == 0:
            fd = os.open(errs[r], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)
            os.environ.update(job_env(job))
            try:
                _rank_body(job, r, 2, init)
            except BaseException as exc:  # noqa: BLE001 - ends the rank at the top
                raise _RankExit(exc) from None
            raise _RankExit(None)
        pids.append(pid)
    deadline = time.monotonic() + limit
    codes: list[Any] = ["hung", "hung"]
    left = dict(zip(pids, range(2)))
    while left and time.monotonic() < deadline:
        for pid, r in list(left.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[r] = os.waitstatus_to_exitcode(status)
                del left[pid]
        time.sleep(0.02)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    text = ""
    for r, path in enumerate(errs):
        if os.path.exists(path):
            with open(path, errors="replace") as f:
                text += f"[rank {r}]\n" + f.read()
    return {"codes": codes, "stderr": text}


def _run_torchrun(job: Job, work: str, limit: float) -> dict[str, Any]:
    spec = json.dumps(asdict(job))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           os.path.abspath(__file__), "--rank-main", spec]
    env = dict(os.environ, **job_env(job))
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=limit)
        out, code = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as exc:
        out, code = str(exc.stdout or "") + str(exc.stderr or ""), "hung"
    # torchrun's summary names each failed worker: "exitcode  : 3 (pid: ...)".
    codes: list[Any] = [0, 0]
    for m in re.finditer(r"local_rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", out, re.S):
        codes[int(m.group(1))] = int(m.group(2))
    if code == "hung":
        codes = ["hung", "hung"]
    return {"codes": codes, "stderr": out, "launcher_code": code}


def run_job(job: Job, limit: float = 120.0) -> dict[str, Any]:
    """Run ``job`` once; its outcome: each rank's status, stderr, and the verdict."""
    work = tempfile.mkdtemp(prefix="gradring-exit-")
    owner = os.getpid()
    try:
        t0 = time.monotonic()
        if job.launcher == "torchrun":
            out = _run_torchrun(job, work, limit)
        elif job.launcher == "script":
            out = _run_script(job, work, limit)
        else:
            out = _run_mp(job, work, limit)
        out["seconds"] = round(time.monotonic() - t0, 2)
    finally:
        if os.getpid() == owner:  # not in a forked rank on its way out
            shutil.rmtree(work, ignore_errors=True)
    out.update(verdict(job, out["codes"], out["stderr"]))
    out["stderr"] = out["stderr"][-4000:]
    out["job"] = job.name()
    return out


def verdict(job: Job, codes: list[Any], stderr: str) -> dict[str, Any]:
    """Whether a run died at exit (a signal other than torchrun's SIGTERM of a survivor,
    or "terminate called") and whether every status is the script's."""
    expected = job.expected()
    died = TERMINATE in stderr or any(
        isinstance(c, int) and c < 0 and not (job.launcher == "torchrun" and r == 1
                                              and c == -signal.SIGTERM)
        for r, c in enumerate(codes))
    hung = "hung" in codes
    ok_codes = all(c == e or (job.launcher == "torchrun" and r == 1 and c == -signal.SIGTERM)
                   for r, (c, e) in enumerate(zip(codes, expected)))
    return {"died": died, "hung": hung, "as_chosen": ok_codes and not died and not hung,
            "expected": expected}


# ------------------------------------------------------------------ stress
def _hogs(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def stress(runs: int, hogs: int, names: list[str], peer_sleep: float,
           parallel: int) -> dict[str, Any]:
    """Every row's job ``runs`` times, interleaved (so load drifts hit every row
    alike), ``parallel`` at a time, beside ``hogs`` spinning processes."""
    rows: list[tuple[str, Job]] = []
    for name in names:
        kind, transport = SCENARIOS[name]
        for impl in ("gradring", "torch"):
            if impl == "torch" and any(k == kind and i == "torch" for k, i in
                                       ((j.kind, j.impl) for _, j in rows)):
                continue  # torch's control does not depend on gradring's transport
            row = f"{kind}:{impl}" if impl == "torch" else f"{name}:{impl}"
            # The in-flight job's ranks are scripts (forked, then finalized as a
            # script's main module is); the floor job spawns them, as the benchmark did.
            rows.append((row, Job(kind=kind, impl=impl,
                                  transport=transport if impl == "gradring" else "",
                                  ending="error" if kind == "inflight" else "clean",
                                  destroy=kind == "floor",
                                  launcher="script" if kind == "inflight" else "spawn",
                                  peer_sleep=peer_sleep)))
    plan = [rj for _ in range(runs) for rj in rows]
    table: dict[str, Any] = {row: {"runs": 0, "died": 0, "other_status": 0, "hung": 0,
                                   "seconds": 0.0} for row, _ in rows}
    spinners = _hogs(hogs)
    try:
        for (row, _), out in zip(plan, _run_many([j for _, j in plan], parallel)):
            r = table[row]
            r["runs"] += 1
            r["died"] += int(bool(out.get("died")))
            r["hung"] += int(bool(out.get("hung")))
            r["other_status"] += int(not out.get("as_chosen") and not out.get("died"))
            r["seconds"] += out.get("seconds", 0.0)
            if out.get("died") or out.get("hung") or "error" in out:
                tail = str(out.get("stderr", out.get("error", "")))[-600:].replace("\n", " | ")
                print(f"  {row}: {out.get('codes')} {tail}", flush=True)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    return table


def _print_table(table: dict[str, Any], runs: int, hogs: int) -> None:
    print(f"deaths at exit, {runs} runs each, {hogs} CPU hogs beside them")
    print(f"{'job:collectives':28} {'runs':>5} {'died':>5} {'other status':>13} "
          f"{'hung':>5} {'s/run':>6}")
    for row, r in table.items():
        print(f"{row:28} {r['runs']:5d} {r['died']:5d} {r['other_status']:13d} "
              f"{r['hung']:5d} {r['seconds'] / max(1, r['runs']):6.1f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=10, help="runs of each job (10)")
    ap.add_argument("--hogs", type=int, default=2, help="CPU-spinning processes beside (2)")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS),
                    help=f"comma-separated, of {', '.join(SCENARIOS)}")
    ap.add_argument("--peer-sleep", type=float, default=6.0,
                    help="inflight: seconds rank 1 sleeps before its all-reduce (6)")
    ap.add_argument("--fail-on-death", action="store_true",
                    help="exit 1 when a gradring run died at exit, hung, or ended with "
                         "another status than the script's")
    ap.add_argument("--json", help="also write the table here")
    ap.add_argument("--job", help="run one job (JSON of its fields) and print its outcome")
    ap.add_argument("--batch", help="run several jobs (a JSON list), --parallel at a time")
    ap.add_argument("--parallel", type=int, default=2, help="jobs at a time (2)")
    ap.add_argument("--rank-main", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank_main:  # a torchrun worker
        job = Job(**json.loads(args.rank_main))
        os.environ.update(job_env(job))
        _rank_body(job, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://")
        return 0
    if args.job:
        print(json.dumps(run_job(Job(**json.loads(args.job)))))
        return 0
    if args.batch:
        return _batch([Job(**spec) for spec in json.loads(args.batch)], args.parallel)
    names = [n for n in args.scenarios.split(",") if n]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        ap.error(f"unknown scenario {unknown[0]!r}; expected one of {', '.join(SCENARIOS)}")
    table = stress(args.runs, args.hogs, names, args.peer_sleep, args.parallel)
    _print_table(table, args.runs, args.hogs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1)
    bad = sum(r["died"] + r["hung"] + r["other_status"] for k, r in table.items()
              if k.endswith(":gradring"))
    return 1 if args.fail_on_death and bad else 0


def _run_many(jobs: list[Job], parallel: int) -> list[dict[str, Any]]:
    """Run ``jobs``, ``parallel`` at a time, each in a process forked from this one
    (which imports torch and gradring once); their outcomes, in order."""
    import torch  # noqa: F401 - imported once, before the forks

    import gradring.comm  # noqa: F401
    gc.freeze()  # forked ranks' collections then skip (and do not copy) the parent's heap
    results: dict[int, dict[str, Any]] = {}
    pending = list(enumerate(jobs))
    running: dict[int, Any] = {}
    while pending or running:
        while pending and len(running) < parallel:
            i, job = pending.pop(0)
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(r)
                try:
                    text = json.dumps(run_job(job))
                except _RankExit:
                    raise
                except BaseException as exc:  # noqa: BLE001 - reported to the parent
                    text = json.dumps({"job": job.name(), "error": repr(exc)})
                os.write(w, text.encode())
                os._exit(0)
            os.close(w)
            running[pid] = (i, r)
        pid, _ = os.wait()
        if pid in running:
            i, r = running.pop(pid)
            chunks = []
            while True:
                b = os.read(r, 1 << 16)
                if not b:
                    break
                chunks.append(b)
            os.close(r)
            results[i] = json.loads(b"".join(chunks) or b'{"error": "no result"}')
    return [results.get(i, {"error": "no result"}) for i in range(len(jobs))]


def _batch(jobs: list[Job], parallel: int = 2) -> int:
    """Run ``jobs`` (see :func:`_run_many`); one JSON line per job, in order."""
    for out in _run_many(jobs, parallel):
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    try:
        status = main()
    except _RankExit as rank_exit:
        rank_exit.finish()
        status = 0
    sys.exit(status)
