"""Two "hosts" on one machine: network namespaces joined by a veth pair.

Each host is a network namespace with one end of a veth pair, an address in
a private test subnet (``GRADRING_MH_SUBNET``, default ``10.213.7``: the
hosts are ``.1`` and ``.2``, a /24 that exists only inside the two
namespaces). Every process of a host runs under ``unshare --uts --mount``
with its own hostname and a fresh tmpfs on ``/dev/shm``, so neither the
hostname nor shared memory can silently carry traffic that should cross the
link (see docs/multihost.md). ``torchrun`` runs on
both hosts with the c10d rendezvous hosted on host 0 (``is_host=1``) and
``GLOO_SOCKET_IFNAME`` set to each side's veth.

Usage::

    with TwoHosts() as hosts:              # root only; see unavailable()
        hosts.shape(rate="1gbit", delay="0.5ms")
        runs = hosts.torchrun("train.py", ["--steps", "5"], nproc_per_node=2)
        assert all(r.returncode == 0 for r in runs), runs[0].output

Everything is torn down on exit, also after errors and timeouts: processes
still running inside the namespaces are killed by pid, then the namespaces
(and with them the veth pair) are deleted. Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

SUBNET = os.environ.get("GRADRING_MH_SUBNET", "10.213.7")
#: Port of the c10d rendezvous store on host 0 (inside its namespace only).
RDZV_PORT = 29431
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _ip(*args: str, check: bool = True, timeout: float = 10) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check,
                          timeout=timeout)


def unavailable() -> str | None:
    """Why this machine cannot run the harness, or None if it can (it tries a namespace)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "needs root (ip netns, unshare --mount)"
    for tool in ("ip", "unshare", "tc"):
        if shutil.which(tool) is None:
            return f"needs the '{tool}' command"
    name = f"grprobe{os.getpid()}"
    try:
        r = _ip("netns", "add", name, check=False)
        if r.returncode != 0:
            return f"'ip netns add' failed: {r.stderr.strip()}"
        r = subprocess.run(["ip", "netns", "exec", name, "unshare", "--uts", "--mount",
                            "--propagation", "private", "true"], capture_output=True,
                           text=True, timeout=10)
        if r.returncode != 0:
            return f"'unshare --uts --mount' failed inside a namespace: {r.stderr.strip()}"
    except (OSError, subprocess.SubprocessError) as exc:
        return f"cannot create a network namespace: {exc}"
    finally:
        _ip("netns", "del", name, check=False)
    return None


@dataclass(frozen=True)
class Host:
    """One simulated host."""

    index: int
    ns: str  # network namespace name
    veth: str  # its end of the veth pair (GLOO_SOCKET_IFNAME)
    addr: str  # its address on the link
    hostname: str  # what gethostname() returns inside


@dataclass
class Run:
    """One host's torchrun: its exit status and combined output."""

    host: Host
    returncode: int | None  # None: killed after the timeout
    output: str
    seconds: float

    def lines(self, tag: str) -> list[str]:
        """What follows ``tag`` on each line of the output that has it. A record is one
        write(2) ending its line, but another process of the host (a rank's stderr,
        torchrun) may have left an unterminated line before it, so the tag need not
        start its line."""
        out = []
        for ln in self.output.splitlines():
            at = ln.find(tag + " ")
            if at >= 0:
                out.append(ln[at + len(tag):].strip())
        return out


class TwoHosts:
    """Context manager creating (and always removing) two namespace hosts."""

    def __init__(self, *, subnet: str = SUBNET, tag: str | None = None) -> None:
        tag = tag or f"{os.getpid() % 100000}"
        # Namespace names and veth names are unique per process (veth names <= 15 chars).
        self.hosts = [Host(i, f"grmh{tag}{c}", f"grv{tag}{c}", f"{subnet}.{i + 1}",
                           f"gradring-host{c}") for i, c in enumerate("ab")]
        # Namespaces created so far (so a failed setup still cleans up).
        self._made: list[str] = []
        # torchrun processes we started (each leads its own session).
        self._procs: list[subprocess.Popen] = []

    # -- lifecycle ------------------------------------------------------------
    def __enter__(self) -> TwoHosts:
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _setup(self) -> None:
        a, b = self.hosts
        for h in self.hosts:
            _ip("netns", "add", h.ns)
            self._made.append(h.ns)
        _ip("link", "add", a.veth, "type", "veth", "peer", "name", b.veth)
        for h in self.hosts:
            _ip("link", "set", h.veth, "netns", h.ns)
            _ip("-n", h.ns, "addr", "add", f"{h.addr}/24", "dev", h.veth)
            _ip("-n", h.ns, "link", "set", h.veth, "up")
            _ip("-n", h.ns, "link", "set", "lo", "up")

    def close(self) -> None:
        """Kill everything still running in the namespaces, then delete them."""
        for p in self._procs:
            _kill_session(p)
        self._procs.clear()
        for ns in self._made:
            for _ in range(3):  # bounded: processes may need a moment to die
                pids = _ip("netns", "pids", ns, check=False).stdout.split()
                if not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except (ProcessLookupError, ValueError):
                        pass
                time.sleep(0.2)
            _ip("netns", "del", ns, check=False)
        self._made.clear()

    # -- link shaping -----------------------------------------------------------
    def shape(self, rate: str | None = None, delay: str | None = None) -> str:
        """Limit both directions of the link (``rate="1gbit"``, ``delay="0.5ms"``).

        Uses netem when the kernel has it (rate and delay); otherwise a token
        bucket (tbf: rate only) and the delay is dropped. Returns what was set.
        """
        if not rate and not delay:
            self.unshape()
            return "unshaped"
        spec = (["delay", delay] if delay else []) + (["rate", rate] if rate else [])
        if self._qdisc(["netem", *spec, "limit", "100000"]):
            return " ".join(spec) + " (netem)"
        if not rate:
            raise RuntimeError("this kernel has no netem qdisc: a delay cannot be emulated")
        from gradring.tools.plan import parse_bandwidth

        bps = parse_bandwidth(rate)
        burst = max(16 * 1024, int(bps / 1000))  # 1 ms worth (>= rate/HZ at HZ=1000)
        if not self._qdisc(["tbf", "rate", rate, "burst", str(burst), "latency", "50ms"]):
            raise RuntimeError(f"cannot shape {self.hosts[0].veth} with tbf rate {rate}")
        return f"rate {rate} (tbf" + (f"; no netem in this kernel, delay {delay} not applied)"
                                       if delay else ")")

    def _qdisc(self, spec: list[str]) -> bool:
        for h in self.hosts:
            r = subprocess.run(["ip", "netns", "exec", h.ns, "tc", "qdisc", "replace", "dev",
                                h.veth, "root", *spec], capture_output=True, text=True,
                               timeout=10)
            if r.returncode != 0:
                return False
        return True

    def unshape(self) -> None:
        for h in self.hosts:
            subprocess.run(["ip", "netns", "exec", h.ns, "tc", "qdisc", "del", "dev", h.veth,
                            "root"], capture_output=True, timeout=10)

    def link(self, up: bool) -> None:
        """Set the link between the hosts up or down (both ends of the veth pair)."""
        for h in self.hosts:
            _ip("-n", h.ns, "link", "set", h.veth, "up" if up else "down")

    def tx_bytes(self, host: int) -> int:
        r = subprocess.run(["ip", "netns", "exec", self.hosts[host].ns, "cat",
                            f"/sys/class/net/{self.hosts[host].veth}/statistics/tx_bytes"],
                           capture_output=True, text=True, timeout=10, check=True)
        return int(r.stdout)

    # -- running ------------------------------------------------------------------
    def command(self, h: Host, argv: Sequence[str], shm_size: str = "2g") -> list[str]:
        """``argv`` run on host ``h``: its namespace, hostname and private /dev/shm
        (a tmpfs of ``shm_size``, in tmpfs ``size=`` syntax: ``2g``, ``4160k``)."""
        inner = ('hostname "$0" && mount -t tmpfs -o size="$1" gradring-shm /dev/shm && '
                 'shift && exec "$@"')
        return ["ip", "netns", "exec", h.ns, "unshare", "--uts", "--mount", "--propagation",
                "private", "sh", "-c", inner, h.hostname, shm_size, *argv]

    def torchrun_argv(self, h: Host, script: str, args: Sequence[str], nproc_per_node: int,
                      rdzv_id: str) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                f"--nproc-per-node={nproc_per_node}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={self.hosts[0].addr}:{RDZV_PORT}", f"--rdzv-id={rdzv_id}",
                f"--rdzv-conf=is_host={1 if h.index == 0 else 0}", f"--local-addr={h.addr}",
                "--max-restarts=0", "--monitor-interval=0.2", script, *args]

    def torchrun(self, script: str, args: Sequence[str] = (), *, nproc_per_node: int = 2,
                 env: dict[str, str] | None = None, timeout: float = 120.0,
                 shm_sizes: dict[int, str] | None = None,
                 tick: Callable[[list[str]], bool] | None = None) -> list[Run]:
        """Run ``script`` under torchrun on both hosts at once; wait at most ``timeout`` s.
        ``shm_sizes``: the /dev/shm size of some hosts by index (default 2g each).
        ``tick(outputs)``: called every 50 ms with each host's output so far (to act on
        events, e.g. set the link down); returning True ends the run there (every
        process still running is killed, ``returncode=None``).

        Returns one :class:`Run` per host; a host still running at the
        timeout is killed and gets ``returncode=None``.
        """
        rdzv_id = f"gradring-{os.getpid()}-{time.monotonic_ns()}"
        base = dict(os.environ)
        base.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                     "PYTHONPATH": os.pathsep.join(filter(None, [ROOT,
                                                                 base.get("PYTHONPATH")]))})
        base.update(env or {})
        started = time.monotonic()
        logs, procs = [], []
        try:
            for h in self.hosts:
                log = tempfile.TemporaryFile(mode="w+")
                penv = dict(base, GLOO_SOCKET_IFNAME=h.veth)
                argv = self.command(h, self.torchrun_argv(h, script, args, nproc_per_node,
                                                          rdzv_id),
                                    (shm_sizes or {}).get(h.index, "2g"))
                p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=penv,
                                     cwd=ROOT, start_new_session=True)
                self._procs.append(p)
                logs.append(log)
                procs.append(p)
            ends: list[float | None] = [None, None]
            while time.monotonic() - started < timeout and any(e is None for e in ends):
                for i, p in enumerate(procs):
                    if ends[i] is None and p.poll() is not None:
                        ends[i] = time.monotonic() - started
                if tick is not None and tick([_read_all(log) for log in logs]):
                    break
                time.sleep(0.05)
            runs = []
            for i, (h, p, log) in enumerate(zip(self.hosts, procs, logs)):
                if p.poll() is None:
                    _kill_session(p)
                log.seek(0)
                runs.append(Run(h, p.returncode if ends[i] is not None else None, log.read(),
                                ends[i] if ends[i] is not None else timeout))
            return runs
        finally:
            for p in procs:
                _kill_session(p)
                if p in self._procs:
                    self._procs.remove(p)
            for log in logs:
                log.close()


def _read_all(log: Any) -> str:
    """What a running host wrote so far (pread: the shared file offset stays put)."""
    out, off = [], 0
    while True:
        chunk = os.pread(log.fileno(), 1 << 20, off)
        if not chunk:
            return b"".join(out).decode("utf-8", "replace")
        out.append(chunk)
        off += len(chunk)


def _kill_session(p: subprocess.Popen) -> None:
    """SIGKILL the session ``p`` leads (torchrun and its workers), then reap ``p``."""
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def records(runs: list, tag: str) -> list[dict]:
    """The JSON records the ranks of ``runs`` printed after ``tag``."""
    return [json.loads(line) for r in runs for line in r.lines(tag)]


def describe(runs: list, tail: int = 6000) -> str:
    """Each host's exit status and the end of its output, for an assertion message."""
    return "\n".join(f"--- {r.host.hostname} rc={r.returncode} ({r.seconds:.1f}s)\n"
                     f"{r.output[-tail:]}" for r in runs)
