"""Whether a bucket's all-reduce overlaps the backward, or waits for its end.

[Note: overlap needs a free core]
torch's DDP launches each bucket's all-reduce as soon as the bucket is ready,
so that communication runs while autograd computes the earlier layers. That
pays when the communication runs somewhere else: on a GPU's copy engines, or
on a CPU core the backward does not use. gradring's shared-memory all-reduce
is CPU work (summing and copying the bucket) done by the group's comm thread.
When every core of the host is already running a backward (as many ranks times
intra-op threads as there are cores), that thread can only take a core from a
backward: the bucket is not hidden, it is paid by whichever rank gets
descheduled, and each hand-off between the threads adds a wake-up.

On a 2-core VM with 2 ranks of 1 thread, reducing every bucket at the end
of the backward cost less overhead against torch's DDP than launching at
ready time, for every model measured side by side (the runs are in
docs/collectives.md, under "Where the ResNet's overhead goes").

So the reducer overlaps when a core is free for the comm thread, and
otherwise reduces every bucket on the training thread when the backward ends,
in bucket order (the path the last bucket always takes, see [Note: the last
bucket] in ``reducer.py``), joined into as few collectives as possible
(see [Note: one collective at the end] in ``buckets/assign.py``). The
results are the same bits either way. The
decision is made whenever buckets are assigned (construction and the
rebuild), from:

- ``GRADRING_OVERLAP=1`` or ``0``: always or never, whatever the host;
- the buckets' device: not CPU means the process group's own collectives,
  which run off the CPU; overlap;
- the group's transport: only shared memory, with every rank on this host,
  competes for the host's cores; across hosts a bucket also waits on the
  network, which overlap hides; overlap;
- the cores: this process's CPU affinity, capped by the tightest CPU quota
  on its cgroup path (v2 or v1), against the intra-op threads of the ranks
  on the host (the group's size, or ``LOCAL_WORLD_SIZE`` if larger). The
  ranks are taken to share those cores: ranks pinned to disjoint cores
  (each with cores to spare) should set ``GRADRING_OVERLAP=1``.

Every rank follows rank 0's choice (it travels with rank 0's bucket
assignment): ranks that launched buckets at different times could issue the
unused-parameter map of ``static_graph``'s first iteration, or Join's flag,
in a different order relative to the buckets. Shared memory being given up
later (a full ``/dev/shm``, which every rank does together) switches
overlap back on at the next backward.

The choice does not apply with a comm hook, a fused optimizer or
``find_unused_parameters``: those keep launching at ready time (they need the
futures, step buckets early, or send the usage map after the last bucket).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from gradring import config

#: ``GRADRING_OVERLAP``: "1"/"on" always overlaps, "0"/"off" never, else the host decides.
ENV = "GRADRING_OVERLAP"


class OverlapChoice(NamedTuple):
    """Whether buckets launch when ready (True) or at the end of the backward, and why."""

    overlap: bool
    why: str


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup CPU quota."""
    try:
        mine = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        mine = os.cpu_count() or 1
    quota = _cgroup_cores()
    if quota is not None:
        mine = min(mine, quota)
    return max(1, mine)


def _cgroup_cores() -> int | None:
    """Whole cores the tightest CPU quota on this process's cgroup path allows
    (cgroup v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us``), or None without one."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    found: list[int] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            roots, files = ["/sys/fs/cgroup"], ("cpu.max",)
        elif "cpu" in controllers.split(","):
            roots = [f"/sys/fs/cgroup/{controllers}", "/sys/fs/cgroup/cpu"]
            files = ("cpu.cfs_quota_us", "cpu.cfs_period_us")
        else:
            continue
        for root in roots:
            cores = _quota_along(root, path.strip("/"), files)
            if cores is not None:
                found.append(cores)
                break
    return min(found) if found else None


def _quota_along(root: str, path: str, files: tuple[str, ...]) -> int | None:
    """The tightest quota from ``root/path`` up to ``root``."""
    best: int | None = None
    parts = path.split("/") if path else []
    for depth in range(len(parts), -1, -1):
        here = os.path.join(root, *parts[:depth])
        try:
            if len(files) == 1:
                with open(os.path.join(here, files[0])) as f:
                    quota, period = f.read().split()[:2]
            else:
                with open(os.path.join(here, files[0])) as f:
                    quota = f.read().strip()
                with open(os.path.join(here, files[1])) as f:
                    period = f.read().strip()
        except (OSError, ValueError):
            continue
        if quota in ("max", "-1"):
            continue
        try:
            cores = max(1, int(int(quota) / int(period)))
        except (ValueError, ZeroDivisionError):
            continue
        best = cores if best is None else min(best, cores)
    return best


def choose(*, device_type: str, on_shared_memory: bool, world_size: int,
           threads: int | None = None, cores: int | None = None,
           env: str | None = None) -> OverlapChoice:
    """This rank's choice (see [Note: overlap needs a free core]); the keyword
    arguments after ``world_size`` default to this process's own settings. The
    reducer makes every rank follow rank 0's (``Reducer._rank0_groups``)."""
    forced = (config.current().overlap if env is None else env).strip().lower()
    if forced in ("1", "on", "true", "yes"):
        return OverlapChoice(True, f"{ENV}={forced}")
    if forced in ("0", "off", "false", "no"):
        return OverlapChoice(False, f"{ENV}={forced}")
    if world_size <= 1:
        return OverlapChoice(True, "one rank: nothing to communicate")
    if device_type != "cpu":
        return OverlapChoice(True, f"{device_type} buckets use the process group's collectives")
    if not on_shared_memory:
        return OverlapChoice(True, "the group's collectives do not run over shared memory "
                                   "on one host")
    threads = torch.get_num_threads() if threads is None else threads
    n = usable_cores() if cores is None else cores
    local = max(world_size, _local_world_size())
    busy, who = local * threads, f"{local} rank(s) x {threads} intra-op thread(s)"
    if n > busy:
        return OverlapChoice(True, f"{n} core(s) for {who}: one is free for the comm thread")
    return OverlapChoice(False, f"{n} core(s) for {who}: no core is free for the comm "
                                "thread, so buckets are reduced when the backward ends")


def forced_off() -> bool:
    """Whether ``GRADRING_OVERLAP`` says never to overlap."""
    return config.current().overlap.strip().lower() in ("0", "off", "false", "no")


def _local_world_size() -> int:
    try:
        return int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    except ValueError:
        return 0
