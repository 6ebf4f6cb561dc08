"""``gradring plan``: predict DDP step time and scaling from 2 to 1024 ranks (an α-β model).

    gradring plan mlp --bandwidth 1gbit --latency 0.5ms --ranks-per-host 2
    gradring plan --trace rank0.json --bandwidth 100gbit --latency 5us --ranks-per-host 8
    gradring plan tiny --bandwidth 100mbit --latency 1ms --compression 2   # e.g. bf16 hook

[Note: the cost model]
A message of S bytes over a link costs ``α + S/B`` (α: latency plus software
cost per message, B: bandwidth per direction). With W ranks, H hosts and L
ranks per host (W = H·L, ranks of a host contiguous):

- ring over W ranks: ``2(W-1)·α + 2(W-1)/W · S/B``. Every step moves S/W over
  every ring edge at once; a host link carries one edge per direction, so
  the host links are the bottleneck when they are slower than the others.
- gradring's double binary tree (not pipelined): ``2·⌊log2 W⌋·(α + S/B)``: each
  of ⌊log2 W⌋ levels up and down moves two half-buffers over one link (at
  W = 2 one half each way: ``2α + S/B``, the ring's time).
- hierarchical (``comm/algos/hierarchical.py``): intra-host reduce-scatter and
  all-gather over shared memory, ``α_i + (L-1)/L · S/B_i`` each, around an
  inter-host all-reduce of S/L among H ranks; the L such all-reduces of a host
  share its link, so each sees B/L: ring ``2(H-1)·α + 2(H-1)/H · S/B``.
- one host (W ≤ L): shared memory only, two-shot ``2α_i + 2(W-1)/W · S/B_i``.
- "auto" is what gradring picks (``comm/select.py``): shared memory on one
  host, hierarchical on several hosts with L > 1, otherwise tree up to
  ``select.TREE_MAX_BYTES`` and ring above.

The step is then simulated with the tuner's bucket model
(``step_model.simulate``, [Note: the step model]): buckets launch when their
gradients are ready and run one after another, each taking the model's
all-reduce time; the exposed part adds to the compute step. Scaling
efficiency is weak scaling: compute step / predicted step (per-rank batch
fixed, so W ranks do W times the work of one).

Backward timing comes from one of: a built-in or ``module:function`` workload
profiled here on one process with one intra-op thread, as tune's ranks run
(``tune.profile_backward``: per-parameter
gradient-ready times), a ``tune --json`` result, or a Chrome trace written by
``gradring.observe.overlap.export_chrome_trace`` (per-bucket ready times and sizes).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from gradring.buckets import DEFAULT_BUCKET_CAP_MB, MIB
from gradring.comm.select import TREE_MAX_BYTES
from gradring.step_model import Profile, simulate
from gradring.tools.tune import profile_backward
from gradring.tools.workloads import load_workload

ALGOS = ("auto", "ring", "tree", "hierarchical")
DEFAULT_RANKS = tuple(2 ** k for k in range(1, 11))  # 2 .. 1024


# ------------------------------------------------------------------ the α-β model
@dataclass(frozen=True)
class Link:
    """α-β parameters of one kind of link."""

    bandwidth: float  # bytes per second, per direction
    latency: float  # seconds per message (wire latency + software cost)

    def __post_init__(self) -> None:
        if self.bandwidth <= 0 or self.latency < 0:
            raise ValueError(f"Link needs bandwidth > 0 and latency >= 0, got {self}")


#: Shared memory inside a host: about what gradring's shm transport reaches here.
SHM = Link(bandwidth=5e9, latency=20e-6)


@dataclass(frozen=True)
class Cluster:
    """W ranks in hosts of ``ranks_per_host``; ``inter`` between hosts, ``intra`` inside."""

    inter: Link
    ranks_per_host: int = 1
    intra: Link = SHM

    def __post_init__(self) -> None:
        if self.ranks_per_host < 1:
            raise ValueError(f"ranks_per_host must be >= 1, got {self.ranks_per_host}")

    def split(self, world: int) -> tuple[int, int]:
        """(hosts, ranks per host) for ``world`` ranks; ``world`` need not fill the last host."""
        local = min(self.ranks_per_host, world)
        return math.ceil(world / local), local


def ring_time(n: int, nbytes: float, link: Link) -> float:
    """Ring all-reduce over ``n`` ranks: ``2(n-1)α + 2(n-1)/n · S/B`` seconds."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * link.latency + 2 * (n - 1) / n * nbytes / link.bandwidth


def tree_time(n: int, nbytes: float, link: Link) -> float:
    """gradring's double binary tree: ``2⌊log2 n⌋ (α + c·S/2B)`` seconds, c = min(2, n-1)
    children per inner node (each level moves their half-buffers over one link)."""
    if n <= 1:
        return 0.0
    depth = int(math.floor(math.log2(n)))
    children = min(2, n - 1)
    return 2 * depth * (link.latency + children * nbytes / (2 * link.bandwidth))


def shm_time(n: int, nbytes: float, link: Link = SHM) -> float:
    """Two-shot all-reduce over shared memory: ``2α + 2(n-1)/n · S/B``."""
    if n <= 1:
        return 0.0
    return 2 * link.latency + 2 * (n - 1) / n * nbytes / link.bandwidth


def flat_time(n: int, nbytes: float, link: Link) -> float:
    """What gradring runs over the process group's point-to-point: tree or ring by size."""
    return (tree_time if nbytes <= TREE_MAX_BYTES else ring_time)(n, nbytes, link)


def hierarchical_time(hosts: int, local: int, nbytes: float, inter: Link,
                      intra: Link = SHM) -> float:
    """Intra reduce-scatter + inter all-reduce of S/L (L of them share a link) + all-gather."""
    intra_phase = 0.0 if local <= 1 else intra.latency + (local - 1) / local * nbytes / \
        intra.bandwidth
    shard = nbytes / local
    shared = Link(inter.bandwidth / local, inter.latency)  # L shards share the host link
    return 2 * intra_phase + flat_time(hosts, shard, shared)


def allreduce_time(algo: str, world: int, nbytes: float, cluster: Cluster) -> float:
    """Seconds for one all-reduce of ``nbytes`` over ``world`` ranks with ``algo`` (ALGOS)."""
    hosts, local = cluster.split(world)
    if algo == "auto":
        if hosts == 1:
            return shm_time(world, nbytes, cluster.intra)
        algo = "hierarchical" if local > 1 else "flat"
    if algo == "hierarchical":
        return hierarchical_time(hosts, local, nbytes, cluster.inter, cluster.intra)
    if algo == "flat":
        return flat_time(world, nbytes, cluster.inter)
    if algo == "ring":
        return ring_time(world, nbytes, cluster.inter)
    if algo == "tree":
        return tree_time(world, nbytes, cluster.inter)
    raise ValueError(f"unknown algorithm {algo!r}; use one of {ALGOS}")


class ModelCurve(NamedTuple):
    """The α-β model as the curve ``step_model.simulate`` expects (``time_ms(nbytes)``)."""

    algo: str
    world: int
    cluster: Cluster
    compression: float = 1.0  # bytes sent = bucket bytes / compression

    def time_ms(self, nbytes: int) -> float:
        return 1e3 * allreduce_time(self.algo, self.world, nbytes / self.compression,
                                    self.cluster)


def fit_link(sizes: Sequence[float], seconds: Sequence[float], n: int = 2) -> Link:
    """Least-squares α, B from measured ring all-reduce times over ``n`` ranks (2+ sizes)."""
    xs = [2 * (n - 1) / n * s for s in sizes]
    k = 2 * (n - 1)
    mx, my = statistics.fmean(xs), statistics.fmean(seconds)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, seconds)) / var
    return Link(bandwidth=1 / max(slope, 1e-15), latency=max(0.0, (my - slope * mx) / k))


# ------------------------------------------------------------------ the step
class StepPlan(NamedTuple):
    """Predicted step for one algorithm at one world size."""

    algo: str
    world: int
    allreduce_ms: float  # all gradients in one all-reduce
    exposed_ms: float  # communication the backward does not hide
    step_ms: float
    efficiency: float  # compute step / step


def predict_step(profile: Profile, algo: str, world: int, cluster: Cluster, *,
                 cap_mb: float = DEFAULT_BUCKET_CAP_MB, per_bucket_ms: float = 0.0,
                 compression: float = 1.0, buckets_fixed: bool = False) -> StepPlan:
    """Simulate one DDP step of ``profile`` at ``world`` ranks (see [Note: the cost model])."""
    curve = ModelCurve(algo, world, cluster, compression)
    if buckets_fixed:  # each profile entry is one bucket already: caps of one byte
        pred = simulate(profile, curve, 1 / MIB, per_bucket_ms=per_bucket_ms,  # type: ignore[arg-type]
                        first_cap_bytes=1)
    else:
        pred = simulate(profile, curve, cap_mb, per_bucket_ms=per_bucket_ms)  # type: ignore[arg-type]
    if world == 1:
        pred = pred._replace(exposed_ms=0.0, step_ms=profile.step_ms)
    return StepPlan(algo, world, curve.time_ms(sum(profile.sizes)), pred.exposed_ms,
                    pred.step_ms, profile.step_ms / pred.step_ms if pred.step_ms > 0 else 1.0)


def plan(profile: Profile, cluster: Cluster, ranks: Sequence[int] = DEFAULT_RANKS,
         algos: Sequence[str] = ALGOS, **kw: Any) -> list[StepPlan]:
    """``predict_step`` for every algorithm and world size (hierarchical needs H, L > 1)."""
    out = []
    for w in ranks:
        for a in algos:
            if a == "hierarchical" and 1 in cluster.split(w):
                continue
            out.append(predict_step(profile, a, w, cluster, **kw))
    return out


# ------------------------------------------------------------------ inputs
def profile_from_trace(path: str) -> Profile:
    """Bucket-level profile from a Chrome trace of ``overlap.export_chrome_trace``.

    Per iteration: bucket k's ready time is the end of ``grads_for_bucket#k``,
    its size the ``bytes`` of ``bucket_all_reduce#k``; medians over iterations.
    The compute step is the median period between backward starts minus the
    median ``finalize`` (waiting for and writing back the last buckets).
    """
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    rank = min(e["pid"] for e in events if e.get("ph") == "X")
    spans = [e for e in events if e.get("ph") == "X" and e["pid"] == rank]
    starts = {e["args"]["iteration"]: e for e in spans if e["name"] == "gradring::backward"}
    if not starts:
        raise ValueError(f"{path}: no gradring::backward spans (not a gradring trace?)")
    ready: dict[int, list[float]] = {}
    sizes: dict[int, int] = {}
    finalize = []
    for e in spans:
        it = e["args"].get("iteration")
        if it not in starts:
            continue
        t0 = starts[it]["ts"]
        if e["name"].startswith("gradring::grads_for_bucket#"):
            k = int(e["name"].rsplit("#", 1)[1])
            ready.setdefault(k, []).append((e["ts"] + e["dur"] - t0) / 1e3)
        elif e["name"].startswith("gradring::bucket_all_reduce#"):
            sizes[int(e["name"].rsplit("#", 1)[1])] = int(e["args"].get("bytes", 0))
        elif e["name"] == "gradring::finalize":
            finalize.append(e["dur"] / 1e3)
    ks = sorted(k for k in ready if sizes.get(k, 0) > 0)
    backward = statistics.median(e["dur"] / 1e3 for e in starts.values())
    its = sorted(starts)
    periods = [(starts[b]["ts"] - starts[a]["ts"]) / 1e3
               for a, b in zip(its, its[1:]) if b == a + 1]
    fin = statistics.median(finalize) if finalize else 0.0
    step = (statistics.median(periods) - fin) if periods else backward * 1.5
    return Profile(names=[f"bucket{k}" for k in ks], sizes=[sizes[k] for k in ks],
                   keys=["trace"] * len(ks),
                   ready_ms=[statistics.median(ready[k]) for k in ks],
                   backward_ms=backward, step_ms=max(step, backward))


def profile_workload(workload: str, threads: int = 1) -> Profile:
    """``tune.profile_backward`` of a workload with ``threads`` intra-op threads, as each
    of ``gradring tune``'s ranks runs (one thread: ranks share the host's cores). Without
    pinning, a 2-core VM measured a 558 ms compute step here where tune measured 36 ms."""
    import functools

    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return profile_backward(functools.partial(load_workload, workload))
    finally:
        torch.set_num_threads(before)


def profile_from_tune_json(path: str) -> Profile:
    with open(path) as f:
        return Profile(**json.load(f)["profile"])


_UNITS = {"": 1.0, "b": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_bandwidth(text: str) -> float:
    """Bytes/s from ``1gbit``, ``100mbit``, ``10GB/s``, ``1.25e8`` (bytes/s)."""
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([kmgt]?)(bit|bps|b/s|b|bytes/s)?(/s)?\s*",
                     text, re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot parse bandwidth {text!r} (e.g. 1gbit, 10GB/s)")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    unit = m.group(3) or ""
    is_bits = unit.lower() in ("bit", "bps") or unit in ("b", "b/s")  # lower-case b: bits
    return value / 8 if is_bits else value


def parse_seconds(text: str) -> float:
    """Seconds from ``0.5ms``, ``20us``, ``1e-3`` (s)."""
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*(s|ms|us|µs|ns)?\s*", text)
    if not m:
        raise ValueError(f"cannot parse time {text!r} (e.g. 0.5ms, 20us)")
    scale = {None: 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}[m.group(2)]
    return float(m.group(1)) * scale


# ------------------------------------------------------------------ report + CLI
def format_plan(plans: Sequence[StepPlan], profile: Profile, cluster: Cluster) -> str:
    total = sum(profile.sizes)
    lines = [f"gradients {total / MIB:.2f} MiB in {len(profile.sizes)} tensors/buckets; "
             f"compute step {profile.step_ms:.1f} ms (backward {profile.backward_ms:.1f} ms)",
             f"link between hosts: {cluster.inter.bandwidth * 8 / 1e9:g} Gbit/s, "
             f"α {cluster.inter.latency * 1e6:g} µs; {cluster.ranks_per_host} rank(s)/host, "
             f"shm {cluster.intra.bandwidth / 1e9:g} GB/s, α {cluster.intra.latency * 1e6:g} µs",
             f"{'ranks':>6} {'algo':>13} {'allreduce ms':>13} {'exposed ms':>11} "
             f"{'step ms':>9} {'efficiency':>10}"]
    for p in plans:
        lines.append(f"{p.world:>6} {p.algo:>13} {p.allreduce_ms:>13.2f} {p.exposed_ms:>11.2f} "
                     f"{p.step_ms:>9.1f} {p.efficiency:>10.1%}")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    """``gradring plan``'s command line."""
    from gradring.tools.helpfmt import command_parser

    ap = command_parser(
        "gradring plan",
        "Predict a DDP step's time and how well it scales from 2 to 1024 ranks, before "
        "you have the machines: the model's backward is profiled here (or read from a "
        "trace or a `gradring tune --json` result), and each all-reduce is costed from "
        "the link's bandwidth and latency. Prints, for each world size and all-reduce "
        "algorithm, the all-reduce time, the communication the backward cannot hide, the "
        "step time and the scaling efficiency.",
        [("gradring plan mlp --bandwidth 1gbit --latency 0.5ms --ranks-per-host 2",
          "a built-in model on hosts of 2 ranks joined by 1 Gbit/s Ethernet"),
         ("gradring plan --trace rank0.json --bandwidth 100gbit --latency 5us "
          "--ranks-per-host 8", "your own run's timings, on a fast cluster"),
         ("gradring plan tiny --bandwidth 100mbit --latency 1ms --compression 2",
          "as if a bf16 compression hook halved the bytes")],
        "Give exactly one of WORKLOAD, --trace or --tune-json. Sizes take units such as "
        "1gbit, 10GB/s; times 0.5ms, 20us. The cost model is described in "
        "gradring/tools/plan.py.")
    ap.add_argument("workload", nargs="?", default=None,
                    help="a built-in model (as in gradring tune) or module:function "
                         "returning (model, input, loss_fn), profiled here")
    ap.add_argument("--trace", default=None, metavar="FILE",
                    help="take the timings from a trace written by "
                         "gradring.observe.overlap.export_chrome_trace (default: none, "
                         "profile WORKLOAD)")
    ap.add_argument("--tune-json", default=None, metavar="FILE",
                    help="take the timings from a `gradring tune --json` result (default: "
                         "none, profile WORKLOAD)")
    ap.add_argument("--bandwidth", default="10gbit", metavar="RATE", help="bandwidth between hosts")
    ap.add_argument("--latency", default="50us", metavar="TIME",
                    help="cost of one message between hosts (wire and software)")
    ap.add_argument("--ranks-per-host", type=int, default=1, metavar="N", help="ranks on each host")
    ap.add_argument("--intra-bandwidth", default="5GB/s", metavar="RATE",
                    help="bandwidth between ranks of one host (shared memory)")
    ap.add_argument("--intra-latency", default="20us", metavar="TIME",
                    help="cost of one message between ranks of one host")
    ap.add_argument("--ranks", metavar="LIST", default=",".join(map(str, DEFAULT_RANKS)),
                    help="world sizes to predict, comma-separated")
    ap.add_argument("--algos", metavar="LIST", default=",".join(ALGOS),
                    help="all-reduce algorithms to compare, comma-separated (auto: what "
                         "gradring would pick)")
    ap.add_argument("--cap-mb", type=float, metavar="MB", default=float(DEFAULT_BUCKET_CAP_MB),
                    help="bucket_cap_mb of the DDP to predict")
    ap.add_argument("--per-bucket-ms", type=float, default=0.0, metavar="MS",
                    help="fixed cost of each bucket's all-reduce that the backward cannot "
                         "hide, in ms")
    ap.add_argument("--compression", type=float, default=1.0, metavar="FACTOR",
                    help="bytes on the wire = gradient bytes / this (a bf16 hook: 2)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    if sum(x is not None for x in (a.workload, a.trace, a.tune_json)) != 1:
        ap.error("give exactly one of WORKLOAD, --trace, --tune-json")
    if a.trace:
        profile, fixed = profile_from_trace(a.trace), True
    elif a.tune_json:
        profile, fixed = profile_from_tune_json(a.tune_json), False
    else:
        profile, fixed = profile_workload(a.workload), False
    cluster = Cluster(Link(parse_bandwidth(a.bandwidth), parse_seconds(a.latency)),
                      a.ranks_per_host,
                      Link(parse_bandwidth(a.intra_bandwidth), parse_seconds(a.intra_latency)))
    plans = plan(profile, cluster, [int(r) for r in a.ranks.split(",")], a.algos.split(","),
                 cap_mb=a.cap_mb, per_bucket_ms=a.per_bucket_ms, compression=a.compression,
                 buckets_fixed=fixed)
    if a.json:
        print(json.dumps([p._asdict() for p in plans], indent=1))
    else:
        print(format_plan(plans, profile, cluster))
    return 0


if __name__ == "__main__":
    sys.exit(main())
