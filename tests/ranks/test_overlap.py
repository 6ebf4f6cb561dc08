"""Overlap statistics: exact values on synthetic events, orderings on real runs."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

from gradring.observe.overlap import (
    BucketInfo,
    chrome_events,
    ddp_overlap_stats,
    export_chrome_trace,
    format_table,
    iteration_times,
    merge_traces,
    recent,
    summarize,
)
from gradring.observe.trace import Event
from tests.support.overlap_probe import (
    HeldEarly,
    event_order,
    held_backward,
    launched_and_done_during_backward,
)


def events(iteration: int, marks: list[tuple[str, int, float]]) -> list[Event]:
    """Events of one iteration from (kind, bucket, ms) triples; t in seconds."""
    return [Event(iteration, kind, bucket, ms / 1e3) for kind, bucket, ms in marks]


def two_buckets(iteration: int = 1, base: float = 0.0, tail: float = 0.0) -> list[Event]:
    """bucket 0: ready 2, done 6 (hidden); bucket 1: ready 5, queued until 6, done 12+tail."""
    return events(iteration, [
        ("backward_start", -1, base + 0), ("ready", 0, base + 2), ("launch", 0, base + 2),
        ("ready", 1, base + 5), ("launch", 1, base + 5), ("comm_done", 0, base + 6),
        ("backward_end", -1, base + 8), ("written", 0, base + 9),
        ("comm_done", 1, base + 12 + tail), ("written", 1, base + 13 + tail),
    ])


def test_one_iteration_exact() -> None:
    [it] = iteration_times(two_buckets())
    assert it.iteration == 1
    assert it.backward_ms == pytest.approx(8)
    assert it.comm_ms == pytest.approx(10)      # union of [2, 6] and [5, 12]
    assert it.exposed_ms == pytest.approx(4)    # 12 - 8
    assert it.tail_ms == pytest.approx(5)       # last written 13 - 8
    assert it.overlap_ratio == pytest.approx(0.6)
    b0, b1 = it.buckets
    assert (b0.wait_ms, b0.queue_ms, b0.run_ms) == pytest.approx((0, 0, 4))
    assert (b1.wait_ms, b1.queue_ms, b1.run_ms, b1.flight_ms) == pytest.approx((0, 1, 6, 7))


def test_buckets_reduced_after_the_backward_are_exposed_run_by_run() -> None:
    # No core free for the comm thread: both buckets launch after backward_end, with
    # bucket 0's write-back (12 -> 12.5) between them; only the runs are exposed.
    evs = events(0, [("backward_start", -1, 0), ("ready", 0, 3), ("ready", 1, 9),
                     ("backward_end", -1, 10), ("launch", 0, 11), ("comm_done", 0, 12),
                     ("written", 0, 12.5), ("launch", 1, 12.5), ("comm_done", 1, 14),
                     ("written", 1, 14.5)])
    [it] = iteration_times(evs)
    assert it.comm_ms == pytest.approx(2.5)
    assert it.exposed_ms == pytest.approx(2.5)
    assert it.overlap_ratio == pytest.approx(0.0)
    assert it.tail_ms == pytest.approx(4.5)


def test_done_is_the_earlier_of_comm_done_and_written() -> None:
    # The comm_done callback waited for the GIL: written came first.
    evs = events(0, [("backward_start", -1, 0), ("ready", 0, 1), ("launch", 0, 3),
                     ("backward_end", -1, 4), ("written", 0, 6), ("comm_done", 0, 7)])
    [it] = iteration_times(evs)
    assert it.buckets[0].done == pytest.approx(6)
    assert it.buckets[0].wait_ms == pytest.approx(2)
    assert it.exposed_ms == pytest.approx(2)
    assert it.comm_ms == pytest.approx(3)


def test_comm_with_a_gap_and_nothing_exposed() -> None:
    evs = events(0, [("backward_start", -1, 0), ("launch", 0, 2), ("comm_done", 0, 3),
                     ("launch", 1, 5), ("comm_done", 1, 7), ("backward_end", -1, 10),
                     ("written", 0, 10.5), ("written", 1, 11)])
    [it] = iteration_times(evs)
    assert it.comm_ms == pytest.approx(3)
    assert it.exposed_ms == 0.0
    assert it.overlap_ratio == 1.0
    assert it.tail_ms == pytest.approx(1)


def test_incomplete_iterations_are_skipped() -> None:
    no_end = events(2, [("backward_start", -1, 0), ("launch", 0, 1), ("comm_done", 0, 2)])
    in_flight = events(3, [("backward_start", -1, 0), ("launch", 0, 1),
                           ("backward_end", -1, 2)])
    shadow = events(4, [("launch", 0, 1), ("comm_done", 0, 2)])  # a joined rank's shadow
    its = iteration_times(two_buckets(1) + no_end + in_flight + shadow)
    assert [it.iteration for it in its] == [1]


def test_recent_keeps_the_newest_layout_and_drops_iteration_zero() -> None:
    one_bucket = events(0, [("backward_start", -1, 0), ("launch", 0, 1),
                            ("backward_end", -1, 2), ("comm_done", 0, 3)])
    its = iteration_times(one_bucket + two_buckets(1) + two_buckets(2, 20) + two_buckets(3, 40))
    assert [it.iteration for it in recent(its, 10)] == [1, 2, 3]
    assert [it.iteration for it in recent(its, 2)] == [2, 3]
    only_zero = iteration_times(one_bucket)
    assert [it.iteration for it in recent(only_zero)] == [0]
    same_layout = iteration_times(two_buckets(0) + two_buckets(1, 20))
    assert [it.iteration for it in recent(same_layout)] == [1]


def test_summarize_takes_means_and_builds_the_table() -> None:
    evs = two_buckets(1) + two_buckets(2, 30, tail=2) + two_buckets(3, 60, tail=100)
    infos = [BucketInfo(4096, ("fc2.bias", "fc2.weight")), BucketInfo(1024, ("fc1.weight",))]
    s = summarize(iteration_times(evs), infos)
    assert s["iterations"] == 3
    assert s["exposed_per_iteration_ms"] == pytest.approx([4, 6, 104])
    # means, so that parts add up to totals ([Note: which steps the reports summarise])
    assert s["exposed_ms"] == pytest.approx(38)
    assert s["comm_ms"] == pytest.approx(44)           # runs: 4+6, 4+8, 4+106
    assert s["backward_ms"] == pytest.approx(8)
    assert s["tail_ms"] == pytest.approx(39)
    assert s["overlap_ratio"] == pytest.approx(6 / 44)  # of the mean communication
    assert sum(b["exposed_ms"] for b in s["buckets"]) == pytest.approx(s["exposed_ms"])
    b0, b1 = s["buckets"]
    assert (b0["bucket"], b0["nbytes"], b0["params"]) == (0, 4096, ["fc2.bias", "fc2.weight"])
    assert b0["finished_before_backward_end"] and b0["hidden_fraction"] == 1.0
    assert not b1["finished_before_backward_end"] and b1["hidden_fraction"] == 0.0
    assert b1["queued_ms"] == pytest.approx(1)
    assert b1["run_ms"] == pytest.approx(40)
    assert b0["ready_to_launch_ms"] == pytest.approx(0)
    text = format_table(s)
    assert "fc2.bias, fc2.weight" in text and "100%" in text


def test_summarize_without_iterations() -> None:
    s = summarize([])
    assert s["iterations"] == 0 and s["exposed_ms"] == 0.0 and s["buckets"] == []


def test_chrome_events_lanes_and_names() -> None:
    its = iteration_times(two_buckets(1, base=1000))
    evs = chrome_events(its, [BucketInfo(8, ("a",)), BucketInfo(4, ("b",))], rank=3)
    spans = {e["name"]: e for e in evs if e["ph"] == "X"}
    assert {e["pid"] for e in evs} == {3}
    ar1 = spans["gradring::bucket_all_reduce#1"]
    assert ar1["tid"] == 1
    assert (ar1["ts"], ar1["dur"]) == pytest.approx((6000, 6000))
    assert ar1["args"]["bytes"] == 4 and ar1["args"]["params"] == ["b"]
    assert spans["gradring::backward"]["dur"] == pytest.approx(8000)
    assert spans["gradring::grads_for_bucket#0"]["dur"] == pytest.approx(2000)
    assert spans["gradring::grads_for_bucket#1"]["ts"] == pytest.approx(2000)
    assert spans["gradring::backward_rest"]["dur"] == pytest.approx(3000)
    fin = spans["gradring::finalize"]
    assert fin["tid"] == 0 and (fin["ts"], fin["dur"]) == pytest.approx((8000, 5000))
    names = {e["args"]["name"] for e in evs if e["name"] == "thread_name"}
    assert names == {"compute", "comm"}


def _fake_ddp(evs: list[Event], rank: int) -> SimpleNamespace:
    trace = SimpleNamespace(events=evs)
    buckets = [SimpleNamespace(nbytes=16, param_indices=[1]), SimpleNamespace(nbytes=8,
                                                                              param_indices=[0])]
    comm = SimpleNamespace(rank=rank, world_size=2)
    return SimpleNamespace(reducer=SimpleNamespace(trace=trace, buckets=buckets,
                                                   names=["w0", "w1"], comm=comm))


def test_export_and_merge_align_ranks_by_wall_clock(tmp_path) -> None:
    paths = []
    for rank in (0, 1):
        p = export_chrome_trace(_fake_ddp(two_buckets(1), rank), str(tmp_path / f"r{rank}.json"))
        paths.append(p)
    docs = [json.loads(open(p).read()) for p in paths]
    # Pretend rank 1's first event came 1.5 ms (wall clock) after rank 0's.
    docs[1]["otherData"]["origin_unix_us"] = docs[0]["otherData"]["origin_unix_us"] + 1500
    with open(paths[1], "w") as f:
        json.dump(docs[1], f)
    out = merge_traces(paths, str(tmp_path / "merged.json"))
    merged = json.loads(open(out).read())
    bw = {e["pid"]: e["ts"] for e in merged["traceEvents"] if e["name"] == "gradring::backward"}
    assert bw == {0: pytest.approx(0), 1: pytest.approx(1500)}
    ar = [e for e in merged["traceEvents"] if e["name"].startswith("gradring::bucket_all_reduce")]
    assert len(ar) == 4 and {e["args"]["params"][0] for e in ar} == {"w0", "w1"}
    assert merged["otherData"]["ranks"] == [0, 1]


def test_ddp_overlap_stats_reads_the_reducer() -> None:
    s = ddp_overlap_stats(_fake_ddp(two_buckets(1), 0))
    assert s["exposed_ms"] == pytest.approx(4)
    assert [b["params"] for b in s["buckets"]] == [["w1"], ["w0"]]
    assert [b["nbytes"] for b in s["buckets"]] == [16, 8]


# --------------------------------------------------------------- real runs (2 gloo ranks)
def run_held(rank: int, world: int) -> dict:
    """Two rebuilding steps, then one whose early layer is held until bucket 0's
    all-reduce is done. See [Note: overlap by events, not durations]."""
    import gradring

    ddp = gradring.DistributedDataParallel(HeldEarly())
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(rank))

    def step() -> None:
        ddp(x).sum().backward()

    for _ in range(2):  # iteration 1 uses one bucket; the 2nd forward rebuilds
        step()
    late = ddp.reducer.bucket_of(2)  # late.weight
    it = ddp.reducer.trace.iteration
    held_backward(ddp, step, late)
    with torch.no_grad():
        ddp(x)  # the next forward ends the step: overlap_stats summarises whole steps
    stats = ddp_overlap_stats(ddp, last_n=1)
    return {"late_bucket": late, "n_buckets": len(ddp.reducer.buckets),
            "order": event_order(ddp, it), "stats": stats}


def test_overlap_is_real(pools) -> None:
    # With the early layer's backward held until the late layer's bucket is
    # reduced, that bucket was launched and reduced while the backward still
    # ran: before the early layer's bucket was ready, before backward_end. The
    # statistics say so too. Fails when buckets wait for the end of the
    # backward (the hold gives up, the order is the other way round).
    for r in pools.run(2, run_held):
        assert r["n_buckets"] == 2 and r["late_bucket"] == 0, r
        assert launched_and_done_during_backward(r["order"], 0, 1), r["order"]
        s = r["stats"]
        assert s["iterations"] == 1, s
        assert s["buckets"][0]["finished_before_backward_end"], s
        assert s["buckets"][0]["hidden_fraction"] == 1.0 and s["overlap_ratio"] > 0, s


def test_export_makes_its_folder_and_merge_waits_for_late_ranks(tmp_path) -> None:
    import threading

    run = tmp_path / "run" / "deeper"
    p0 = export_chrome_trace(_fake_ddp(two_buckets(1), 0), str(run / "rank0.json"))
    late = str(run / "rank1.json")
    # Rank 1 writes its trace a little after rank 0 starts merging.
    writer = threading.Timer(0.3, export_chrome_trace, (_fake_ddp(two_buckets(1), 1), late))
    writer.start()
    try:
        out = merge_traces([p0, late], str(tmp_path / "merged" / "trace.json"))
    finally:
        writer.join()
    merged = json.loads(open(out).read())
    assert merged["otherData"]["ranks"] == [0, 1]
    assert not [n for n in os.listdir(run) if n.endswith(".tmp")]
    with pytest.raises(FileNotFoundError, match="rank7.json"):
        merge_traces([p0, str(run / "rank7.json")], str(tmp_path / "m2.json"), wait_s=0.2)
