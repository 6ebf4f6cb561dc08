"""gradring.tools.gpu_trace on small made-up kernel sets, against hand-computed figures
and a naive microsecond-by-microsecond oracle (the comparison with HTA on real traces
is in test_gpu_trace_hta.py)."""

from __future__ import annotations

import random

import pytest

from gradring.tools.gpu_trace import (
    Kernel,
    assign_steps,
    by_device,
    device_breakdown,
    device_breakdowns,
    device_window,
    kernel_kind,
    kernels_before,
    overlap_pct,
    phase_ms,
    read_kernels,
    step_windows,
)

GEMM = "ampere_sgemm_128x64_nn"
NCCL = "ncclKernel_AllReduce_RING_LL_Sum_float(ncclWorkElem)"
COPY = "Memcpy DtoD (Device -> Device)"


def k(start: float, end: float, name: str = GEMM, stream: int = 7, device: int = 0,
      launch: float | None = None) -> Kernel:
    return Kernel(float(start), float(end - start), name, stream, device,
                  kernel_kind(name) == "comm", launch, None)


def test_kinds_follow_hta_names():
    assert kernel_kind(NCCL) == "comm"
    assert kernel_kind("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*)") == "comm"
    assert kernel_kind(COPY) == "memory"
    assert kernel_kind("Memset (Device)") == "memory"
    assert kernel_kind("void copy_Memcpy_helper<float>()") == "other"
    assert kernel_kind("void foo::StreamSync_kernel()") == "other"
    assert kernel_kind("void at::native::vectorized_elementwise_kernel<4>()") == "compute"
    # "nccl" without "Kernel" after it is not one of NCCL's collective kernels
    assert kernel_kind("nccl_unrelated_helper") == "compute"


def test_two_streams_comm_gaps_and_a_copy():
    # compute on streams 7 and 20 overlapping, comm on 30 half-hidden, a copy, a gap
    ks = [k(0, 10), k(5, 15, stream=20), k(12, 30, NCCL, stream=30),
          k(40, 45, COPY, stream=40), k(50, 60)]
    b = device_breakdown(ks, 0, 60)
    # compute [0,15) + [50,60); comm [12,30); comm alone [15,30);
    # busy [0,30) + [40,45) + [50,60) = 45 of 60
    assert b == pytest.approx({"compute_ms": 25e-3, "comm_ms": 18e-3,
                               "exposed_comm_ms": 15e-3, "idle_ms": 15e-3})
    # comm [12,30) has compute under it for [12,15): 3 of 18 us
    assert overlap_pct(ks) == pytest.approx(100 * 3 / 18)


def test_window_clips_kernels_that_reach_outside_it():
    ks = [k(0, 10), k(5, 15, stream=20), k(12, 30, NCCL, stream=30),
          k(40, 45, COPY, stream=40), k(50, 60)]
    b = device_breakdown(ks, 10, 55)
    # compute [10,15) + [50,55); comm [12,30) of which [15,30) alone;
    # busy [10,30) + [40,45) + [50,55) = 30 of 45
    assert b == pytest.approx({"compute_ms": 10e-3, "comm_ms": 18e-3,
                               "exposed_comm_ms": 15e-3, "idle_ms": 15e-3})


def test_comm_on_two_streams_counts_once():
    ks = [k(0, 10, NCCL, stream=1), k(5, 20, NCCL, stream=2), k(8, 12)]
    assert device_breakdown(ks, 0, 20)["comm_ms"] == pytest.approx(20e-3)
    assert overlap_pct(ks) == pytest.approx(100 * 4 / 20)


def test_touching_and_empty_kernels():
    ks = [k(0, 5), k(5, 10), k(10, 10), k(3, 3, NCCL)]
    b = device_breakdown(ks, 0, 12)
    assert b == pytest.approx({"compute_ms": 10e-3, "comm_ms": 0.0,
                               "exposed_comm_ms": 0.0, "idle_ms": 2e-3})
    assert overlap_pct(ks) == 0.0


def test_bad_window_is_refused():
    with pytest.raises(ValueError, match="ends"):
        device_breakdown([k(0, 1)], 5, 2)


def _naive(ks, lo, hi):
    """Microsecond by microsecond: which kinds run during [t, t+1)."""
    out = {"compute": 0, "comm": 0, "exposed": 0, "idle": 0, "both": 0}
    for t in range(lo, hi):
        kinds = {kernel_kind(x.name) for x in ks if x.start_us <= t < x.start_us + x.dur_us}
        out["compute"] += "compute" in kinds
        out["comm"] += "comm" in kinds
        out["exposed"] += "comm" in kinds and "compute" not in kinds
        out["idle"] += not kinds
        out["both"] += "comm" in kinds and "compute" in kinds
    return out


@pytest.mark.parametrize("seed", range(6))
def test_random_kernels_against_a_naive_count(seed):
    rng = random.Random(seed)
    names = [GEMM, GEMM, NCCL, COPY, "void x_Sync_kernel()"]
    ks = []
    for _ in range(rng.randint(1, 40)):
        start = rng.randint(0, 300)
        ks.append(k(start, start + rng.randint(0, 40), rng.choice(names),
                    stream=rng.choice([7, 20, 31])))
    lo, hi = rng.randint(0, 100), rng.randint(150, 350)
    want = _naive(ks, lo, hi)
    b = device_breakdown(ks, lo, hi)
    assert b["compute_ms"] * 1e3 == pytest.approx(want["compute"])
    assert b["comm_ms"] * 1e3 == pytest.approx(want["comm"])
    assert b["exposed_comm_ms"] * 1e3 == pytest.approx(want["exposed"])
    assert b["idle_ms"] * 1e3 == pytest.approx(want["idle"])
    # many windows over one timeline, sorted once: long kernels reach into later windows
    windows = [(a, a + rng.randint(0, 60)) for a in range(0, 340, 37)] + [None]
    for w, got in zip(windows, device_breakdowns(ks, windows)):
        if w is None:
            assert got is None
            continue
        want = _naive(ks, *w)
        assert [got[key] * 1e3 for key in ("compute_ms", "comm_ms", "exposed_comm_ms",
                                           "idle_ms")] == pytest.approx(
            [want["compute"], want["comm"], want["exposed"], want["idle"]])
    whole = _naive(ks, 0, 400)
    expect = 100 * whole["both"] / whole["comm"] if whole["comm"] else 0.0
    assert overlap_pct(ks) == pytest.approx(expect)


def test_read_kernels_ties_kernels_to_their_launch():
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 95, "dur": 30, "pid": 1,
         "tid": 1, "args": {"External id": 3}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 100, "dur": 4,
         "pid": 1, "tid": 1, "args": {"correlation": 5}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": 130.5, "dur": 2,
         "pid": 1, "tid": 1, "args": {"correlation": 6}},
        {"ph": "s", "cat": "ac2g", "name": "ac2g", "id": 5, "ts": 100, "pid": 1, "tid": 1},
        {"ph": "X", "cat": "gpu_memcpy", "name": COPY, "ts": 140, "dur": 3, "pid": 0,
         "tid": 9, "args": {"device": 0, "stream": 9, "correlation": 6}},
        {"ph": "X", "cat": "kernel", "name": GEMM, "ts": 120, "dur": 10, "pid": 0, "tid": 7,
         "args": {"device": 0, "stream": 7, "correlation": 5}},
        {"ph": "X", "cat": "kernel", "name": NCCL, "ts": 150, "dur": 50, "pid": 2, "tid": 21,
         "args": {"device": 2, "stream": 21, "correlation": 99}},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "ProfilerStep#3", "ts": 110,
         "dur": 100, "pid": 0, "tid": 7, "args": {"device": 0, "stream": 7}},
        "not an event",
    ]
    ks = read_kernels(events)
    assert ks == [
        Kernel(120.0, 10.0, GEMM, 7, 0, False, 100.0, 5),
        Kernel(140.0, 3.0, COPY, 9, 0, False, 130.5, 6),
        Kernel(150.0, 50.0, NCCL, 21, 2, True, None, 99),
    ]
    assert {d: len(v) for d, v in by_device(ks).items()} == {0: 2, 2: 1}
    assert device_window(ks) == (120.0, 200.0)
    assert kernels_before(ks, 130.5) == ks[:1]


def test_read_kernels_names_a_kernel_without_a_duration():
    events = [{"ph": "X", "cat": "kernel", "name": GEMM, "ts": 1, "pid": 0, "tid": 7,
               "args": {"stream": 7}}]
    with pytest.raises(ValueError, match=r"GPU event #0 .* no numeric dur"):
        read_kernels(events)


def test_phase_ms_by_the_launching_op():
    ks = [k(10, 12, launch=1), k(20, 25, launch=2), k(30, 40, NCCL, launch=7),
          k(50, 51, launch=None)]
    got = phase_ms(ks, lambda t: "forward" if t < 5 else "backward")
    assert got == pytest.approx({"forward": 7e-3, "backward": 10e-3, "unknown": 1e-3})


def test_steps_tile_the_device_timeline():
    steps = [(0.0, 100.0), (100.0, 200.0), (200.0, 300.0)]
    ks = [k(20, 30, launch=10), k(40, 90, NCCL, launch=50), k(120, 130, launch=150),
          k(300, 310, launch=350), k(5, 6, launch=None)]
    assert assign_steps(ks, steps) == [0, 0, 1, None, None]
    # step 2 launched nothing; step 1 runs to its last kernel's end
    assert step_windows(ks, steps) == [(20.0, 120.0), (120.0, 130.0), None]
    inside = [x for x, i in zip(ks, assign_steps(ks, steps)) if i is not None]
    parts = [device_breakdown(inside, lo, hi) for lo, hi in
             (w for w in step_windows(ks, steps) if w)]
    whole = device_breakdown(inside, 20, 130)
    for key in whole:
        assert sum(p[key] for p in parts) == pytest.approx(whole[key])


def test_a_list_changed_between_calls_is_read_afresh():
    # device_breakdown keeps the timeline of the last list it was given
    ks = [k(0, 10), k(20, 30, NCCL)]
    assert device_breakdown(ks, 0, 30)["compute_ms"] == pytest.approx(10e-3)
    ks[0] = k(0, 4)
    assert device_breakdown(ks, 0, 30)["compute_ms"] == pytest.approx(4e-3)
    ks.append(k(25, 30))
    assert device_breakdown(ks, 0, 30) == pytest.approx(
        {"compute_ms": 9e-3, "comm_ms": 10e-3, "exposed_comm_ms": 5e-3, "idle_ms": 16e-3})
    assert device_breakdown(tuple(ks), 0, 30)["exposed_comm_ms"] == pytest.approx(5e-3)
