"""Reading and analysing a GPU profiler trace: gradring against Holistic Trace Analysis.

    python benchmarks/explain_vs_hta.py                 # the public trace and 1M events
    python benchmarks/explain_vs_hta.py --rounds 5 --big-rounds 3
    python benchmarks/explain_vs_hta.py --trace tests/data/hta/trace_filter --no-generated

Times the same work on the same files both ways, each measurement in a fresh child
process (so one's memory never counts against the other), several rounds, and
prints the median and the spread (min-max) side by side with the ratio:

- gradring: ``read_json`` + ``read_kernels`` + ``overlap_pct`` + a
  ``device_breakdown`` per ProfilerStep (gradring.tools.gpu_trace), for every rank
  file; and, when this checkout has it, the whole ``gradring explain PATH --json``;
- HTA: ``TraceAnalysis(trace_dir=...)`` (its parser) + ``get_comm_comp_overlap`` +
  ``get_temporal_breakdown``.

"work" is the parse and analysis after the imports; "total" is the child's whole
wall time, interpreter start and imports included (gradring's import brings
torch). Peak memory is the child's ``ru_maxrss``, the larger of its own and its
children's (HTA parses several ranks in a pool of processes; the figure is then
the largest one process, not their sum).

The inputs are (a) a public A100 torch-DDP trace from HTA's test data
(tests/data/hta, see its README.md) and (b) a generated trace of about a million
events shaped like a torch-DDP step on a GPU (``make_ddp_trace``): ProfilerStep
spans, the DDP forward, autograd's backward, bucketed ``nccl:all_reduce`` on a
stream of their own overlapping the backward, copies into ``.grad``, the
optimizer, runtime launches tied to kernels by correlation ids and their flow
events. The 1M-event run checks gradring's limits from issue 53: at most 30 s
(total, imports included) and 2 GB.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PUBLIC = os.path.join(ROOT, "tests", "data", "hta", "nccl_parser_config")
LIMIT_S = 30.0
LIMIT_MB = 2048.0


# ---- the generated trace -----------------------------------------------------------

class _Writer:
    """Writes Chrome-trace events one at a time, counting them."""

    def __init__(self, f) -> None:  # noqa: ANN001 - a text file
        self.f = f
        self.count = 0

    def event(self, e: dict) -> None:
        self.f.write(",\n" if self.count else "\n")
        self.f.write(json.dumps(e))  # Kineto's spacing, near its bytes per event
        self.count += 1


def make_ddp_trace(path: str, events: int = 1_000_000, rank: int = 0, world: int = 2,
                   layers: int = 400, seed: int = 0) -> int:
    """Write a torch.profiler-shaped trace of one torch-DDP rank on a GPU with NCCL.

    Steps are added until the trace holds at least ``events`` events; returns the
    count. ``.gz`` in the name writes it gzip-compressed. With 400 layers a step
    has about 15,000 events and 67 buckets, so a million events are some 70
    steps: the size of a profile of a few steps of a large model.
    """
    rng = random.Random(seed)
    pid, tid, bwd_tid = 4242, 4242, 4250
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "wt") as f:
        f.write('{"schemaVersion":1,"deviceProperties":[{"id":0,"name":'
                '"NVIDIA A100-SXM4-80GB","totalGlobalMem":85097971712}],'
                f'"distributedInfo":{{"backend":"nccl","rank":{rank},"world_size":{world}}},'
                '"traceEvents":[')
        w = _Writer(f)
        for name, args in (("process_name", {"name": "python"}),
                           ("thread_name", {"name": "thread 4242 (python)"})):
            w.event({"ph": "M", "name": name, "pid": pid, "tid": tid, "args": args})
        w.event({"ph": "M", "name": "process_name", "pid": 0, "tid": 0,
                 "args": {"name": "GPU 0"}})
        # Correlation ids start high, as they do after a few profiled warm-up steps
        # (HTA 0.5.0 with pandas 3 fails on a trace of more than 32,767 events whose
        # ids all fit in an int16).
        # Times on the scale of a real trace's clock (microseconds, ns fractions).
        base = 4.458e12
        state = {"corr": 5_000_000, "ext": 1, "cpu": base, "gpu": base, "nccl": base}

        def cpu_op(name: str, ts: float, dur: float, thread: int = tid,
                   cat: str = "cpu_op", extra: dict | None = None) -> None:
            state["ext"] += 1
            args = {"External id": state["ext"], "Record function id": state["ext"] - 140,
                    "Ev Idx": state["ext"] - 1, **(extra or {})}
            if thread == bwd_tid and cat == "cpu_op":
                args.update({"Sequence number": state["ext"] // 7, "Fwd thread id": 1})
            w.event({"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": thread,
                     "ts": round(ts, 3), "dur": round(dur, 3), "args": args})

        def launch(ts: float, kernel: str, dur: float, stream: int, thread: int = tid,
                   cat: str = "kernel", api: str = "cudaLaunchKernel",
                   after: float = 0.0) -> float:
            """A runtime call at ``ts`` and the device event it starts; returns its end."""
            state["corr"] += 1
            corr = state["corr"]
            w.event({"ph": "X", "cat": "cuda_runtime", "name": api, "pid": pid, "tid": thread,
                     "ts": round(ts, 3), "dur": 4.0,
                     "args": {"External id": state["ext"], "cbid": 211, "correlation": corr}})
            clock = "nccl" if stream == 20 else "gpu"
            start = max(state[clock], ts + 6.0, after)
            w.event({"ph": "X", "cat": cat, "name": kernel, "pid": 0, "tid": stream,
                     "ts": round(start, 3), "dur": round(dur, 3),
                     "args": {"External id": state["ext"], "queued": 0, "device": 0,
                              "context": 1, "stream": stream, "correlation": corr,
                              "registers per thread": 128, "shared memory": 0,
                              "grid": [128, 1, 1], "block": [256, 1, 1]}})
            w.event({"ph": "s", "id": corr, "pid": pid, "tid": thread, "ts": round(ts, 3),
                     "cat": "ac2g", "name": "ac2g"})
            w.event({"ph": "f", "id": corr, "pid": 0, "tid": stream, "ts": round(start, 3),
                     "cat": "ac2g", "name": "ac2g", "bp": "e"})
            state[clock] = start + dur
            return start + dur

        gemm = "ampere_sgemm_128x64_tn"
        elementwise = ("void at::native::vectorized_elementwise_kernel<4, "
                       "at::native::CUDAFunctor_add<float>, at::detail::Array<char*, 3> >"
                       "(int, at::native::CUDAFunctor_add<float>, at::detail::Array<char*, 3>)")
        nccl = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)"
        step = 0
        while w.count < events:
            t0 = state["cpu"]
            t = t0 + 5.0
            forward_from = t
            for _layer in range(layers):
                cpu_op("aten::linear", t, 40.0)
                cpu_op("aten::t", t + 2, 3.0)
                cpu_op("aten::addmm", t + 8, 25.0)
                launch(t + 12, gemm, rng.uniform(10, 45), 7)
                cpu_op("aten::relu", t + 36, 8.0)
                launch(t + 38, elementwise, rng.uniform(5, 20), 7)
                t += 50.0
            cpu_op("DistributedDataParallel.forward", forward_from, t - forward_from,
                   cat="user_annotation")
            # backward, with a bucket every few layers
            bucket_every = 6
            for layer in range(layers):
                cpu_op("autograd::engine::evaluate_function: AddmmBackward0", t, 60.0, bwd_tid)
                cpu_op("AddmmBackward0", t + 1, 55.0, bwd_tid)
                w.event({"ph": "f", "id": state["ext"], "pid": pid, "tid": bwd_tid,
                         "ts": round(t + 1, 3), "cat": "fwdbwd", "name": "fwdbwd", "bp": "e"})
                cpu_op("aten::mm", t + 3, 20.0, bwd_tid)
                launch(t + 6, gemm, rng.uniform(10, 45), 7, bwd_tid)
                cpu_op("aten::mm", t + 26, 20.0, bwd_tid)
                end = launch(t + 28, gemm, rng.uniform(10, 45), 7, bwd_tid)
                cpu_op("torch::distributed::reducer::mul_out", t + 50, 6.0, bwd_tid)
                t += 64.0
                if layer % bucket_every == bucket_every - 1 or layer == layers - 1:
                    nelems = rng.randint(1, 7) * 1_048_576
                    cpu_op("c10d::allreduce_", t, 30.0, bwd_tid)
                    cpu_op("record_param_comms", t + 2, 26.0, bwd_tid, extra={
                        "Process Group Name": "0", "Process Group Description": "default_pg",
                        "Process Group Ranks": str(list(range(world))), "Group size": world,
                        "In msg nelems": nelems, "Out msg nelems": nelems, "dtype": "Float",
                        "Collective name": "allreduce", "In split size": "[]",
                        "Out split size": "[]"})
                    cpu_op("nccl:all_reduce", t + 4, 22.0, bwd_tid, cat="user_annotation")
                    launch(t + 10, nccl, nelems / 12_000.0, 20, bwd_tid, after=end)
                    t += 32.0
            # copy into .grad (a device copy per parameter), optimizer, zero_grad
            for _layer in range(layers):
                cpu_op("torch.distributed.ddp.reducer::copy_bucket_to_grad", t, 12.0)
                launch(t + 3, "Memcpy DtoD (Device -> Device)", rng.uniform(2, 8), 7,
                       cat="gpu_memcpy", api="cudaMemcpyAsync",
                       after=state["nccl"])
                t += 14.0
            cpu_op("Optimizer.step#SGD.step", t, 20.0 * layers)
            for _layer in range(layers):
                cpu_op("aten::add_", t + 2, 15.0)
                launch(t + 5, elementwise, rng.uniform(4, 12), 7)
                t += 20.0
            cpu_op("Optimizer.zero_grad#SGD.zero_grad", t, 10.0)
            launch(t + 2, "Memset (Device)", 3.0, 7, cat="gpu_memset", api="cudaMemsetAsync")
            t += 20.0
            # spans are written after what they hold: readers must not rely on order
            cpu_op(f"ProfilerStep#{step}", t0, t - t0, cat="user_annotation")
            state["cpu"] = max(t, state["gpu"] - 200.0) + 10.0
            step += 1
        f.write("\n]}\n")
    return w.count


# ---- the measured work (each in a child process) ------------------------------------

def _rank_files(path: str) -> list[str]:
    if os.path.isdir(path):
        return sorted(p for p in glob.glob(os.path.join(path, "*.json*")))
    return [path]


def _one_file(path: str) -> str:
    """A folder of one rank's file as that file (what `gradring explain` is given)."""
    files = _rank_files(path)
    return files[0] if len(files) == 1 else path


def _work_gradring(path: str) -> dict:
    from gradring.tools.gpu_trace import (
        by_device,
        device_breakdowns,
        kernels_before,
        overlap_pct,
        read_kernels,
        step_windows,
    )
    from gradring.tools.trace_file import read_json

    out: dict = {"read_s": 0.0}
    for file in _rank_files(path):
        t0 = time.perf_counter()
        doc = read_json(file)
        out["read_s"] += time.perf_counter() - t0
        events = doc["traceEvents"]
        kernels = read_kernels(events)
        steps = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
                       if isinstance(e, dict) and e.get("ph") == "X"
                       and str(e.get("name", "")).startswith("ProfilerStep#"))
        kept = kernels_before(kernels, steps[-1][0])
        for device, dk in by_device(kept).items():
            parts = [p for p in device_breakdowns(dk, step_windows(dk, steps)) if p]
            out[f"{os.path.basename(file)}:{device}"] = {
                "overlap_pct": round(overlap_pct(dk), 2),
                "compute_ms": round(sum(p["compute_ms"] for p in parts), 3),
                "idle_ms": round(sum(p["idle_ms"] for p in parts), 3),
                "steps": len(parts)}
    return out


def _work_hta(path: str) -> dict:
    import logging

    logging.disable(logging.WARNING)
    from hta.trace_analysis import TraceAnalysis

    folder = path if os.path.isdir(path) else os.path.dirname(path)
    analysis = TraceAnalysis(trace_dir=folder)
    overlap = analysis.get_comm_comp_overlap(visualize=False)
    breakdown = analysis.get_temporal_breakdown(visualize=False)
    return {str(r): {"overlap_pct": float(o), "compute_ms": float(c) / 1e3,
                     "idle_ms": float(i) / 1e3}
            for r, o, c, i in zip(overlap["rank"], overlap["comp_comm_overlap_pctg"],
                                  breakdown["compute_time(us)"], breakdown["idle_time(us)"])}


def _child(which: str, path: str) -> None:
    started = time.perf_counter()
    if which == "gradring":
        import gradring.tools.gpu_trace  # noqa: F401 - imports are timed apart from the work
        import gradring.tools.trace_file  # noqa: F401
        work = _work_gradring
    else:
        import hta.trace_analysis  # noqa: F401
        work = _work_hta
    imported = time.perf_counter()
    result = work(path)
    done = time.perf_counter()
    rss_kb = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                 resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    print(json.dumps({"import_s": imported - started, "work_s": done - imported,
                      "rss_mb": rss_kb / 1024, "result": result}))


def _measure(cmd: list[str], timeout: float) -> dict:
    """Run ``cmd``; its wall time, and its peak RSS from the kernel's accounting."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=ROOT)
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() - t0 > timeout:
                proc.kill()
                os.wait4(proc.pid, 0)
                proc.returncode = -9
                return {"error": f"did not finish in {timeout:.0f} s"}
            time.sleep(0.05)
        total = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode != 0:
        tail = (stderr or stdout).strip().splitlines()[-1:] or ["?"]
        return {"error": f"exit {proc.returncode}: {tail[0][:160]}"}
    rss_mb = usage.ru_maxrss / 1024
    try:
        result = json.loads(stdout.strip().splitlines()[-1])
        result["rss_mb"] = max(result["rss_mb"], rss_mb)
    except (ValueError, IndexError, KeyError, TypeError):
        # `gradring explain --json` prints its own document: all of it is work
        result = {"import_s": float("nan"), "work_s": total, "rss_mb": rss_mb, "result": None}
    result["total_s"] = total
    return result


def _explain_cmd(path: str) -> list[str]:
    script = os.path.join(os.path.dirname(sys.executable), "gradring")
    cli = [script] if os.path.exists(script) else [sys.executable, "-m", "gradring.tools.cli"]
    return cli + ["explain", path, "--json"]


def _explain_available(path: str) -> bool:
    """Whether this checkout's ``gradring explain`` reads torch.profiler traces (issue 53)."""
    try:
        proc = subprocess.run(_explain_cmd(path),
                              capture_output=True, text=True, timeout=300, cwd=ROOT)
        return proc.returncode == 0 and '"torch.profiler"' in proc.stdout
    except (OSError, subprocess.TimeoutExpired):
        return False


def _spread(values: list[float]) -> str:
    return (f"{statistics.median(values):8.2f} s "
            f"[{min(values):.2f}-{max(values):.2f}]")


def _report(label: str, runs: dict[str, list[dict]]) -> dict[str, float]:
    print(f"\n== {label}")
    print(f"{'path':<22}{'work: median [min-max]':>30}{'total: median':>16}{'peak RSS':>12}")
    medians = {}
    for name, results in runs.items():
        ok = [r for r in results if "error" not in r]
        if not ok:
            print(f"{name:<22}  {results[0]['error']}")
            continue
        work = [r["work_s"] for r in ok]
        total = [r["total_s"] for r in ok]
        rss = max(r["rss_mb"] for r in ok)
        medians[name] = statistics.median(work)
        medians[name + ":total"] = statistics.median(total)
        medians[name + ":rss"] = rss
        print(f"{name:<22}{_spread(work):>30}{statistics.median(total):14.2f} s"
              f"{rss:9.0f} MB")
    if "gradring" in medians and "hta" in medians:
        print(f"HTA / gradring, work: {medians['hta'] / medians['gradring']:.1f}x; "
              f"total: {medians['hta:total'] / medians['gradring:total']:.1f}x")
    for name, results in runs.items():
        ok = [r for r in results if "error" not in r and r.get("result")]
        if ok:
            print(f"  {name} figures: {json.dumps(ok[0]['result'])[:300]}")
        split = [r["result"]["read_s"] for r in ok if "read_s" in (r.get("result") or {})]
        if split:
            print(f"  {name}: of the work, read_json took {statistics.median(split):.2f} s "
                  "(median)")
    return medians


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", nargs=2, metavar=("WHICH", "PATH"), help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=3,
                    help="measurements per path on the public traces")
    ap.add_argument("--big-rounds", type=int, default=1,
                    help="measurements per path on the generated trace (HTA takes minutes)")
    ap.add_argument("--events", type=int, default=1_000_000,
                    help="events in the generated trace (default 1,000,000)")
    ap.add_argument("--trace", action="append", default=None,
                    help=f"a public trace file or rank folder (default {PUBLIC}); repeatable")
    ap.add_argument("--no-generated", action="store_true", help="skip the generated trace")
    ap.add_argument("--no-hta", action="store_true", help="time gradring alone")
    ap.add_argument("--hta-timeout", type=float, default=600.0,
                    help="give up on one HTA measurement after this many seconds")
    args = ap.parse_args(argv)
    if args.child:
        _child(*args.child)
        return 0
    me = [sys.executable, os.path.abspath(__file__), "--child"]
    inputs = [(os.path.relpath(p, ROOT), p) for p in (args.trace or [PUBLIC])]
    tmp = None
    if not args.no_generated:
        tmp = tempfile.mkdtemp(prefix="gradring-hta-bench-")
        path = os.path.join(tmp, "rank0.json")
        t0 = time.perf_counter()
        count = make_ddp_trace(path, args.events)
        print(f"generated {count:,} events ({os.path.getsize(path) / 2**20:.0f} MB of JSON) "
              f"in {time.perf_counter() - t0:.1f} s: {path}")
        inputs.append((f"generated, {count:,} events", tmp))
    explain = _explain_available(_one_file(inputs[0][1]))
    if not explain:
        print("(gradring explain does not read torch.profiler traces in this checkout yet: "
              "timing gradring.tools.gpu_trace alone)")
    verdict = 0
    try:
        for label, path in inputs:
            runs: dict[str, list[dict]] = {"gradring": []}
            if not args.no_hta:
                runs["hta"] = []
            if explain:
                runs["gradring explain --json"] = []
            rounds = args.big_rounds if label.startswith("generated") else args.rounds
            for _ in range(rounds):
                # interleaved, so that load on the machine falls on both alike
                runs["gradring"].append(_measure(me + ["gradring", path], 600))
                if not args.no_hta:
                    runs["hta"].append(_measure(me + ["hta", path], args.hta_timeout))
                if explain:
                    runs["gradring explain --json"].append(
                        _measure(_explain_cmd(_one_file(path)), 600))
            medians = _report(label, runs)
            if label.startswith("generated") and "gradring" in medians:
                total, rss = medians["gradring:total"], medians["gradring:rss"]
                ok = total <= LIMIT_S and rss <= LIMIT_MB
                print(f"limits for gradring on {label}: {total:.1f} s of {LIMIT_S:.0f} s, "
                      f"{rss:.0f} MB of {LIMIT_MB:.0f} MB: {'within' if ok else 'EXCEEDED'}")
                verdict |= 0 if ok else 1
    finally:
        if tmp is not None:
            for p in glob.glob(os.path.join(tmp, "*")):
                os.unlink(p)
            os.rmdir(tmp)
    return verdict


if __name__ == "__main__":
    sys.exit(main())
