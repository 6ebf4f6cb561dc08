#!/usr/bin/env python3
"""Run torch's own DDP tests against gradring (and against torch's DDP as the reference).

    python scripts/torch_ddp_tests.py                      # gradring, the selection below
    python scripts/torch_ddp_tests.py --both               # torch's DDP first, then gradring
    python scripts/torch_ddp_tests.py --impl torch -k uneven --jobs 1
    python scripts/torch_ddp_tests.py --list               # what is selected, run or skipped, why
    python scripts/torch_ddp_tests.py --impl torch --run-skipped   # re-check the skip table

The tests are ``DistributedTest._DistTestBase`` from torch's installed
``torch/testing/_internal/distributed/distributed_test.py``, run the way upstream's
``test/distributed/test_distributed_spawn.py`` runs them: ``BACKEND=gloo``,
``WORLD_SIZE=2``, a fresh pair of rank processes per test (forked: [Note: fork, not
spawn]), a temporary ``TEMP_DIR`` and a file:// rendezvous made by the harness's own
``setUp``; tests that want GPUs only to place tensors run on the CPU under the shim of
scripts/torch_ddp_cpu_shim.py ([Note: the CPU shim]; ``--no-cpu-shim`` turns it off,
for both implementations alike). Needs the
``expecttest`` package (torch's test helpers import it): ``pip install expecttest``.
See docs/torch-tests.md.

[Note: which of torch's tests are DDP tests]
A test method of ``_DistTestBase`` is selected when its name contains ``ddp`` or
``DistributedDataParallel`` (any case), or when its body names
``DistributedDataParallel`` (or ``DDP``) itself or through a ``self._helper(...)`` it
calls, followed transitively through the class's own helpers. That picks up the DDP
tests whose names do not say so (test_grads_same_across_ranks_with_no_sync,
test_invalid_static_graph, test_skip_all_reduce_unused_parameters,
test_compute_bucket_assignment_by_size_sparse_error_with_logger, the no_sync /
post-localSGD / static-graph ones) without a hand-kept list that goes stale when torch
is upgraded. ``--list`` prints, per test, which half of the rule selected it.

[Note: the skip table]
scripts/torch_ddp_tests.txt names the selected tests that are not run, one per line
with its reason, and every reason holds against torch's own DDP on this CPU-only gloo
setup under the CPU shim ("needs CUDA": torch skips it, or fails it because it needs a
real GPU; "NCCL only"; torch's own decorators skip it; too slow on CPU). So every test that
is run passes under torch's DDP, which is what lets a gradring-only run (the default,
the one that must fit in ten minutes) call each of its failures a regression against
the reference without running the reference. ``--impl torch`` checks that claim
(a failure there means the table is stale); ``--run-skipped`` runs the listed tests
too, e.g. after a torch upgrade or on a machine with GPUs.

[Note: lifting torch's own skips]
A few DDP tests carry a static ``unittest.skipIf(IS_LINUX, "<upstream issue>")`` (or
``skip_but_pass_in_sandcastle``) that skips them on every Linux machine, although torch's
DDP passes them here. The skip table names them with a leading ``+``, and ``--unskip
TEST`` names more: while torch's test module is imported, ``unittest.skip`` lets these
functions through undecorated, and the flag that ``skip_but_pass_in_sandcastle`` sets is
cleared afterwards. Runtime skips (``skip_if_lt_x_gpu``'s exit codes) are not touched.

[Note: fork, not spawn]
Upstream spawns each test's ranks; a spawned rank re-imports torch, its test module and
gradring, which costs 10-30 s per test on a loaded two-core machine and puts a full run
far over ten minutes. By default the ranks are forked from the worker that already
imported everything (no process group, no thread pool exists there yet, so the fork is
clean); ``--start-method spawn`` restores upstream's way.

[Note: how the swap reaches every DDP the tests build]
``--impl gradring`` calls ``gradring.install()`` (which rebinds
``torch.nn.parallel.DistributedDataParallel`` and
``torch.nn.parallel.distributed.DistributedDataParallel``; the tests reach the class
through ``nn.parallel.`` and ``torch.nn.parallel.``) and then rebinds every module
global under ``torch.testing._internal`` that still holds torch's class (e.g. the
``DistributedDataParallel`` that distributed_test imported by name). isinstance checks
elsewhere in torch keep torch's class, which gradring's subclasses. The swap is done
at import of this file, so it happens in the spawned rank processes too (spawn
re-imports this file as ``__mp_main__``); the implementation is passed to them in the
environment (``GRADRING_TORCH_TESTS_IMPL``).
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import os
import re
import selectors
import signal
import subprocess
import sys
import tempfile
import time
import unittest
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SKIP_TABLE = Path(__file__).with_suffix(".txt")
IMPL_ENV = "GRADRING_TORCH_TESTS_IMPL"
START_ENV = "GRADRING_TORCH_TESTS_START"
SHIM_ENV = "GRADRING_TORCH_TESTS_CPU_SHIM"
UNSKIP_ENV = "GRADRING_TORCH_TESTS_UNSKIP"
IMPLS = ("torch", "gradring")

# The environment upstream's spawn test requires, set before torch's test module is
# imported (it reads BACKEND and WORLD_SIZE at import). setUp replaces TEMP_DIR and
# INIT_METHOD with fresh per-test ones; these only satisfy the import.
os.environ.setdefault("BACKEND", "gloo")
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("TEMP_DIR", tempfile.gettempdir())
os.environ.setdefault("INIT_METHOD", "env://")
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))



class _LiftTorchSkips:
    """While torch's test module is imported, let the named tests through torch's static
    ``unittest.skip``/``skipIf`` decorators; see [Note: lifting torch's own skips]."""

    def __init__(self, names: set[str]) -> None:
        self._names = names  # the test functions whose static skips are ignored
        self._saved = unittest.skip  # the decorator factory to put back afterwards

    def __enter__(self) -> None:
        original, names = self._saved, self._names

        def skip(reason: str):  # noqa: ANN202 - mirrors unittest.skip
            decorate = original(reason)
            return lambda item: item if getattr(item, "__name__", None) in names else decorate(
                item)

        unittest.skip = unittest.case.skip = skip

    def __exit__(self, *exc: object) -> None:
        unittest.skip = unittest.case.skip = self._saved


_LIFTED = set(filter(None, os.environ.get(UNSKIP_ENV, "").split(",")))
try:
    with _LiftTorchSkips(_LIFTED):
        import torch
        from torch.testing._internal import common_distributed
        from torch.testing._internal.distributed import distributed_test
        from torch.testing._internal.distributed.distributed_test import (
            DistributedTest,
            TestDistBackend,
        )
except ModuleNotFoundError as _missing:  # torch's test helpers need expecttest
    if __name__ == "__main__":
        sys.exit(f"torch_ddp_tests: cannot import torch's distributed tests ({_missing}); "
                 "install the missing package, e.g. `pip install expecttest`")
    raise

for _name in _LIFTED:  # skip_but_pass_in_sandcastle only flags the function: unflag it
    _fn = getattr(DistributedTest._DistTestBase, _name, None)
    while _fn is not None:
        if getattr(_fn, "__unittest_skip__", False):
            _fn.__unittest_skip__ = False
        _fn = getattr(_fn, "__wrapped__", None)

from torch_ddp_cpu_shim import CpuDeviceMode, cpu_placed_ddp, fake_torch_for_tests  # noqa: E402

_TORCH_DDP = torch.nn.parallel.distributed.DistributedDataParallel


def swap_in_gradring() -> list[str]:
    """Make every place the tests take the DDP class from give gradring's.

    See [Note: how the swap reaches every DDP the tests build]. Returns the rebound
    names, for the log."""
    import gradring

    gradring.install()
    rebound = [f"{home}.DistributedDataParallel"
               for home in ("torch.nn.parallel", "torch.nn.parallel.distributed")]
    for mod_name, mod in _test_modules():
        for name, value in list(vars(mod).items()):
            if value is _TORCH_DDP:
                setattr(mod, name, gradring.DistributedDataParallel)
                rebound.append(f"{mod_name}.{name}")
    return rebound


def _test_modules() -> list[tuple[str, object]]:
    return [(name, mod) for name, mod in list(sys.modules.items())
            if mod is not None and name.startswith("torch.testing._internal")]


def apply_cpu_shim() -> None:
    """Let GPU-gated tests that only place tensors on a GPU run on the CPU; see
    [Note: the CPU shim] in scripts/torch_ddp_cpu_shim.py."""
    current = torch.nn.parallel.DistributedDataParallel  # torch's, or gradring's once swapped
    shimmed = cpu_placed_ddp(current)
    torch.nn.parallel.DistributedDataParallel = shimmed
    for _, mod in _test_modules():
        for name, value in list(vars(mod).items()):
            if value is current or value is _TORCH_DDP:
                setattr(mod, name, shimmed)
    fake = fake_torch_for_tests(int(os.environ["WORLD_SIZE"]))
    distributed_test.torch = fake
    common_distributed.torch = fake
    common_distributed.TEST_CUDA = True  # what skip_if_no_gpu reads instead of torch.cuda


SWAPPED: list[str] = swap_in_gradring() if os.environ.get(IMPL_ENV) == "gradring" else []
CPU_SHIM = os.environ.get(SHIM_ENV) == "1"
if CPU_SHIM:
    apply_cpu_shim()


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    """Upstream's test_distributed_spawn class: each test spawns WORLD_SIZE ranks."""

    def setUp(self) -> None:
        super().setUp()
        if os.environ.get(START_ENV, "fork") == "spawn":
            self._spawn_processes()
        else:  # [Note: fork, not spawn]
            self._start_processes(torch.multiprocessing.get_context("fork").Process)
        torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()

    def run_test(self, test_name: str, parent_pipe: object) -> None:
        """In a rank: the test itself, under the CPU shim's device mode when it is on."""
        if not CPU_SHIM:
            return super().run_test(test_name, parent_pipe)
        with CpuDeviceMode():
            return super().run_test(test_name, parent_pipe)


# ---------------------------------------------------------------- selection


def _method_source(name: str) -> str:
    try:
        return inspect.getsource(inspect.unwrap(getattr(DistributedTest._DistTestBase, name)))
    except (OSError, TypeError):
        return ""


def _names_ddp(name: str, seen: set[str]) -> bool:
    """Whether a method of _DistTestBase names the DDP class, itself or via its helpers."""
    if name in seen:
        return False
    seen.add(name)
    source = _method_source(name)
    if re.search(r"DistributedDataParallel|\bDDP\b", source):
        return True
    base = DistributedTest._DistTestBase
    return any(callable(getattr(base, helper, None)) and _names_ddp(helper, seen)
               for helper in sorted(set(re.findall(r"self\.(_\w+)\(", source))))


def select_tests() -> dict[str, str]:
    """The DDP tests, each with why it is selected; see [Note: which of torch's tests are
    DDP tests]."""
    chosen: dict[str, str] = {}
    for name in sorted(dir(DistributedTest._DistTestBase)):
        if not name.startswith("test_"):
            continue
        if re.search(r"ddp|distributeddataparallel", name, re.IGNORECASE):
            chosen[name] = "name"
        elif _names_ddp(name, set()):
            chosen[name] = "body uses DDP"
    return chosen


def read_skip_table(path: Path = SKIP_TABLE) -> tuple[dict[str, str], dict[str, str]]:
    """(tests not run, tests run with torch's static skip lifted), each name -> reason; see
    [Note: the skip table] and [Note: lifting torch's own skips]."""
    skipped: dict[str, str] = {}
    lifted: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, _, reason = line.partition(" ")
        table = lifted if name.startswith("+") else skipped
        table[name.lstrip("+")] = reason.strip() or "(no reason given)"
    return skipped, lifted


# ---------------------------------------------------------------- worker side


class _Recorder(unittest.TestResult):
    """Writes one JSON line per finished test to the driver's result pipe."""

    def __init__(self, out: object) -> None:
        super().__init__()
        self._out = out  # the pipe to the driver; one line per test
        self._started = 0.0  # when the current test began, for its duration

    def startTest(self, test: unittest.TestCase) -> None:
        super().startTest(test)
        self._started = time.monotonic()

    def _emit(self, test: unittest.TestCase, status: str, detail: str) -> None:
        record = {"test": test.id().rsplit(".", 1)[-1], "status": status, "detail": detail,
                  "seconds": round(time.monotonic() - self._started, 1)}
        self._out.write(json.dumps(record) + "\n")  # type: ignore[attr-defined]
        self._out.flush()  # type: ignore[attr-defined]

    def addSuccess(self, test: unittest.TestCase) -> None:
        self._emit(test, "passed", "")

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:
        self._emit(test, "skipped", reason)

    def addFailure(self, test: unittest.TestCase, err: tuple) -> None:
        self._emit(test, "failed", self._exc_info_to_string(err, test))

    def addError(self, test: unittest.TestCase, err: tuple) -> None:
        self._emit(test, "failed", self._exc_info_to_string(err, test))

    def addExpectedFailure(self, test: unittest.TestCase, err: tuple) -> None:
        self._emit(test, "passed", "expected failure")

    def addUnexpectedSuccess(self, test: unittest.TestCase) -> None:
        self._emit(test, "failed", "unexpected success")


def worker(result_fd: int) -> None:
    """Run the tests named on stdin, one per line, reporting each on ``result_fd``."""
    print(f"worker {os.getpid()}: impl={os.environ.get(IMPL_ENV)} swapped={SWAPPED}", flush=True)
    with os.fdopen(result_fd, "w") as out:
        recorder = _Recorder(out)
        TestDistBackendWithSpawn.setUpClass()
        for line in sys.stdin:
            name = line.strip()
            if not name:
                continue
            print(f"===== {name}", flush=True)
            TestDistBackendWithSpawn(name).run(recorder)
        TestDistBackendWithSpawn.tearDownClass()


# ---------------------------------------------------------------- driver side


@dataclass
class Outcome:
    """One test under one implementation."""

    status: str  # passed / failed / skipped / not run
    detail: str = ""  # the skip reason, or the harness's error with the ranks' tracebacks
    seconds: float = 0.0  # wall time of the test, ranks' start and teardown included


def one_line(detail: str, width: int = 320) -> str:
    """A failure in one line: where in torch's test it happened and the exception raised
    there, from the first failing rank's traceback (or from the detail itself)."""
    lines = detail.splitlines()
    start = next((i for i, x in enumerate(lines) if x.startswith("Process ")), -1) + 1
    lines = lines[start:]
    end = next((i for i, x in enumerate(lines)
                if x.startswith(("To execute this test", "Process "))), len(lines))
    lines = lines[:end]
    where, exc_at = "", None
    for i, line in enumerate(lines):
        frame = re.match(r'  File ".*/(distributed_test\.py)", line (\d+), in (\w+)', line)
        if frame:
            where = f"{frame.group(1)}:{frame.group(2)} {frame.group(3)}: "
        if line.startswith('  File "'):
            exc_at = None
        elif exc_at is None and line and not line[0].isspace() and i > 0:
            exc_at = i
    if exc_at is None:
        text = " ".join(x.strip() for x in lines if x.strip()) or detail.strip()
    else:
        text = " / ".join(x.strip() for x in lines[exc_at:] if x.strip())
    text = where + text
    if len(text) > width:
        half = (width - 5) // 2
        text = text[:half] + " ... " + text[-half:]
    return text


@dataclass
class _Slot:
    """A worker process and what the driver knows of it."""

    proc: subprocess.Popen  # the worker; its own session, so its ranks die with it
    reader: object  # the read end of its result pipe
    current: str | None = None  # the test it is running, None once its input is closed
    since: float = 0.0  # when that test was handed to it, for the watchdog
    buffer: str = ""  # a result line read only in part
    log: Path = field(default_factory=Path)  # where its and its ranks' output goes


class WorkerPool:
    """Runs tests under one implementation on ``jobs`` worker processes, handing each
    worker its next test when it reports the last one, so slow tests do not hold up a
    fixed shard."""

    def __init__(self, impl: str, jobs: int, test_timeout: int, env: dict[str, str],
                 log_dir: Path, verbose: bool) -> None:
        self._impl = impl  # whose DDP the workers swap in, for the lines printed
        self._jobs = jobs  # workers at once
        self._test_timeout = test_timeout  # the harness's limit, the watchdog's base
        self._env = env  # the workers' environment: impl, shim, lifted skips, timeout
        self._log_dir = log_dir  # where each worker's output goes
        self._verbose = verbose  # print full tracebacks of failures as they come
        self._pending: list[str] = []  # tests not yet handed out
        self._results: dict[str, Outcome] = {}  # what came back
        self._slots: list[_Slot] = []  # the live workers
        self._selector = selectors.DefaultSelector()  # waits on the workers' result pipes
        self._started = itertools.count()  # numbers the workers' log files

    def run(self, tests: list[str]) -> dict[str, Outcome]:
        self._pending = list(tests)
        try:
            for _ in range(min(self._jobs, len(self._pending))):
                self._feed(self._start())
            while self._slots:
                self._step()
        finally:  # ^C or an error here: the workers live in their own sessions, end them
            for slot in list(self._slots):
                self._retire(slot, kill=True)
        return {name: self._results.get(name, Outcome("not run")) for name in tests}

    def _watchdog(self, name: str) -> int:
        # The harness kills a hung test after the timeout (or torch's own longer limit for
        # a few tests); this is the backstop for a worker that hangs outside it (a rank
        # stuck in teardown, a deadlocked start).
        return max(self._test_timeout, common_distributed.TIMEOUT_OVERRIDE.get(name, 0)) + 90

    def _start(self) -> _Slot:
        rfd, wfd = os.pipe()
        log = self._log_dir / f"{self._impl}-worker{next(self._started)}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(
                [sys.executable, __file__, "--worker", str(wfd)], stdin=subprocess.PIPE,
                stdout=out, stderr=subprocess.STDOUT, env=self._env, pass_fds=(wfd,),
                start_new_session=True, text=True, cwd=REPO)
        os.close(wfd)
        slot = _Slot(proc=proc, reader=os.fdopen(rfd, "r"), log=log)
        self._selector.register(slot.reader, selectors.EVENT_READ, slot)
        self._slots.append(slot)
        return slot

    def _feed(self, slot: _Slot) -> None:
        if self._pending:
            slot.current = self._pending.pop(0)
            slot.since = time.monotonic()
            slot.proc.stdin.write(slot.current + "\n")
            slot.proc.stdin.flush()
        else:
            slot.current = None
            slot.proc.stdin.close()

    def _retire(self, slot: _Slot, kill: bool) -> None:
        self._selector.unregister(slot.reader)
        slot.reader.close()
        if kill:
            try:
                os.killpg(slot.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        slot.proc.wait()
        self._slots.remove(slot)

    def _lose(self, slot: _Slot, why: str) -> None:
        """The worker died or hung in a test: record it failed, replace the worker."""
        self._record(slot.current, Outcome("failed", f"{why}; see {slot.log}",
                                           time.monotonic() - slot.since))
        self._retire(slot, kill=True)
        if self._pending:
            self._feed(self._start())

    def _record(self, name: str, outcome: Outcome) -> None:
        self._results[name] = outcome
        mark = {"passed": "PASS", "failed": "FAIL", "skipped": "SKIP"}.get(outcome.status, "----")
        why = one_line(outcome.detail) if outcome.status == "failed" else outcome.detail
        print(f"  [{self._impl}] {mark} {name} ({outcome.seconds:.0f}s)"
              f"{'  ' + why if why else ''}", flush=True)
        if self._verbose and outcome.status == "failed":
            print(outcome.detail, flush=True)

    def _step(self) -> None:
        for key, _ in self._selector.select(timeout=5):
            slot = key.data
            chunk = os.read(slot.reader.fileno(), 1 << 16).decode()
            if not chunk:  # the worker exited
                if slot.current is not None:
                    try:
                        code = slot.proc.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        code = None
                    self._lose(slot, f"worker died (exit {code})")
                else:
                    self._retire(slot, kill=False)
                continue
            slot.buffer += chunk
            while "\n" in slot.buffer:
                line, slot.buffer = slot.buffer.split("\n", 1)
                rec = json.loads(line)
                self._record(rec["test"], Outcome(rec["status"], rec["detail"], rec["seconds"]))
                self._feed(slot)
        now = time.monotonic()
        for slot in list(self._slots):
            if slot.current is not None and now - slot.since > self._watchdog(slot.current):
                self._lose(slot, f"no result after {self._watchdog(slot.current)}s; worker killed")


def worker_env(impl: str, cpu_shim: bool, start_method: str, unskip: list[str],
               test_timeout: int) -> dict[str, str]:
    """The environment that tells a worker (and its ranks) how to set the tests up."""
    path = [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return dict(os.environ, **{IMPL_ENV: impl, SHIM_ENV: "1" if cpu_shim else "0",
                               UNSKIP_ENV: ",".join(unskip), START_ENV: start_method,
                               "DISTRIBUTED_TESTS_DEFAULT_TIMEOUT": str(test_timeout),
                               "PYTHONPATH": os.pathsep.join(path)})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--impl", choices=IMPLS, default="gradring",
                       help="whose DistributedDataParallel the tests build (default gradring)")
    which.add_argument("--both", action="store_true",
                       help="run torch's DDP (the reference) and then gradring's")
    parser.add_argument("-k", dest="patterns", action="append", default=[],
                        help="only tests whose name contains this (repeatable: any matches)")
    parser.add_argument("--jobs", type=int, default=2,
                        help="tests run at once, each with its own 2 ranks (default 2)")
    parser.add_argument("--test-timeout", type=int, default=180,
                        help="seconds before the harness kills a test's ranks (default 180)")
    parser.add_argument("--no-cpu-shim", dest="cpu_shim", action="store_false",
                        help="do not fake GPUs for tests that only place tensors on them")
    parser.add_argument("--start-method", choices=("fork", "spawn"), default="fork",
                        help="how each test starts its ranks (default fork; upstream: spawn)")
    parser.add_argument("--unskip", action="append", default=[], metavar="TEST",
                        help="run TEST even though torch's own decorators skip it (repeatable)")
    parser.add_argument("--run-skipped", action="store_true",
                        help="also run the tests the skip table names")
    parser.add_argument("--report-only", action="store_true",
                        help="exit 0 even when a test fails under gradring only")
    parser.add_argument("--list", action="store_true",
                        help="print the selection, what runs and why, and exit")
    parser.add_argument("--verbose", action="store_true", help="print full tracebacks")
    parser.add_argument("--json", type=Path, help="write every outcome here as JSON")
    parser.add_argument("--log-dir", type=Path,
                        help="keep the workers' logs here (default: a temporary folder)")
    args = parser.parse_args(argv)

    selected = select_tests()
    skip_table, lifted = read_skip_table()
    for name in sorted((set(skip_table) | set(lifted)) - set(selected)):
        print(f"note: skip table names {name}, which torch's tests no longer select",
              file=sys.stderr)
    if args.patterns:
        selected = {n: why for n, why in selected.items()
                    if any(p in n for p in args.patterns)}
    to_run = [n for n in selected if args.run_skipped or n not in skip_table]
    unskip = sorted(n for n in set(lifted) | set(args.unskip) if n in to_run)

    if args.list:
        for name, why in selected.items():
            state = (f"skip: {skip_table[name]}" if name in skip_table
                     else f"run, torch's skip lifted: {lifted[name]}" if name in lifted
                     else "run")
            print(f"{name:75} selected by {why:14} {state}")
        print(f"{len(selected)} selected, {len(to_run)} to run")
        return 0

    impls = list(IMPLS) if args.both else [args.impl]
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="torch_ddp_tests-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"torch {torch.__version__}, gloo, world 2: {len(selected)} DDP tests selected, "
          f"{len(to_run)} run, {len(selected) - len(to_run)} in the skip table; "
          f"impl {' and '.join(impls)}; jobs {args.jobs}; "
          f"CPU shim {'on' if args.cpu_shim else 'off'}; logs in {log_dir}", flush=True)
    outcomes: dict[str, dict[str, Outcome]] = {}
    took: dict[str, float] = {}
    for impl in impls:
        t0 = time.monotonic()
        env = worker_env(impl, args.cpu_shim, args.start_method, unskip, args.test_timeout)
        pool = WorkerPool(impl, args.jobs, args.test_timeout, env, log_dir, args.verbose)
        outcomes[impl] = pool.run(to_run)
        took[impl] = time.monotonic() - t0

    print("\nPer test:" + "".join(f" {impl:>10}" for impl in impls))
    for name in selected:
        if name not in to_run:
            print(f"  {name:75} {'skipped':>10}  (table) {skip_table[name]}")
            continue
        cells = [outcomes[impl][name] for impl in impls]
        notes = [f"{impl}: {one_line(o.detail) if o.status == 'failed' else o.detail}"
                 for impl, o in zip(impls, cells) if o.detail]
        print(f"  {name:75}" + "".join(f" {o.status:>10}" for o in cells)
              + (f"  {' | '.join(notes)}" if notes else ""))

    for impl in impls:
        counts: dict[str, int] = {}
        for o in outcomes[impl].values():
            counts[o.status] = counts.get(o.status, 0) + 1
        print(f"{impl}: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
              + f" in {took[impl]:.0f}s")

    # The list that matters: passes under torch's DDP, fails under gradring's. Without a
    # torch run, every test that runs is one torch's DDP passes ([Note: the skip table]).
    regressions: list[str] = []
    if "gradring" in outcomes:
        for name in to_run:
            ref_ok = "torch" not in outcomes or outcomes["torch"][name].status == "passed"
            if ref_ok and outcomes["gradring"][name].status in ("failed", "not run"):
                regressions.append(name)
    stale = [n for n in to_run if n not in skip_table and "torch" in outcomes
             and outcomes["torch"][n].status == "failed"]
    if stale:
        print(f"\nFail under torch's DDP too (the skip table should list them): {len(stale)}")
        for name in stale:
            print(f"  {name}: {one_line(outcomes['torch'][name].detail)}")
    print(f"\nPass under torch's DDP, fail under gradring's: {len(regressions)}")
    for name in regressions:
        print(f"  {name}: {one_line(outcomes['gradring'][name].detail)}")
    if args.json:
        args.json.write_text(json.dumps(
            {impl: {n: vars(o) for n, o in res.items()} for impl, res in outcomes.items()},
            indent=1))
    print(f"time: {sum(took.values()):.0f}s")
    return 1 if regressions and not args.report_only else 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]))
    else:
        sys.exit(main())
