"""The α-β cost model of gradring/tools/plan.py: closed forms, choices, overlap, inputs, CLI."""

from __future__ import annotations

import json
import math

import pytest

from gradring.buckets import MIB
from gradring.comm.select import TREE_MAX_BYTES
from gradring.step_model import Profile
from gradring.tools import plan

LINK = plan.Link(bandwidth=1.25e8, latency=5e-4)  # 1 Gbit/s, 0.5 ms
SHM = plan.Link(bandwidth=5e9, latency=2e-5)


@pytest.mark.parametrize("n", [2, 3, 4, 8, 1024])
@pytest.mark.parametrize("size", [0, 4096, 25 * MIB])
def test_ring_closed_form(n, size):
    want = 2 * (n - 1) / n * size / LINK.bandwidth + 2 * (n - 1) * LINK.latency
    assert plan.ring_time(n, size, LINK) == pytest.approx(want)
    assert plan.allreduce_time("ring", n, size, plan.Cluster(LINK)) == pytest.approx(want)


def test_ring_bandwidth_term_is_almost_independent_of_n():
    big = 1e9
    t = [plan.ring_time(n, big, plan.Link(1e9, 0.0)) for n in (2, 1024)]
    assert t[0] == pytest.approx(1.0) and t[1] == pytest.approx(2 * 1023 / 1024)


def test_tree_closed_form_and_crossover():
    assert plan.tree_time(8, 1000, LINK) == pytest.approx(2 * 3 * (LINK.latency + 1000 / 1.25e8))
    assert plan.tree_time(5, 0, LINK) == pytest.approx(2 * 2 * LINK.latency)
    assert plan.tree_time(2, 1e6, LINK) == pytest.approx(plan.ring_time(2, 1e6, LINK))
    assert plan.tree_time(1, 1e6, LINK) == 0.0 == plan.ring_time(1, 1e6, LINK)
    # Latency-bound: tree wins at many ranks; bandwidth-bound: ring wins.
    assert plan.tree_time(1024, 4, LINK) < plan.ring_time(1024, 4, LINK)
    assert plan.ring_time(8, 100 * MIB, LINK) < plan.tree_time(8, 100 * MIB, LINK)
    # "flat" follows select's size rule.
    assert plan.flat_time(16, TREE_MAX_BYTES, LINK) == plan.tree_time(16, TREE_MAX_BYTES, LINK)
    assert plan.flat_time(16, TREE_MAX_BYTES + 1, LINK) == \
        plan.ring_time(16, TREE_MAX_BYTES + 1, LINK)


def test_hierarchical_closed_form():
    h, l_, s = 4, 8, 64 * MIB
    intra = SHM.latency + (l_ - 1) / l_ * s / SHM.bandwidth
    inter = 2 * (h - 1) * LINK.latency + 2 * (h - 1) / h * s / LINK.bandwidth
    assert plan.hierarchical_time(h, l_, s, LINK, SHM) == pytest.approx(2 * intra + inter)
    # One rank per host: the flat algorithm over the hosts.
    assert plan.hierarchical_time(4, 1, s, LINK, SHM) == pytest.approx(plan.ring_time(4, s, LINK))
    # At W = 2x2 it moves 2(H-1)/H = 1.0 of the buffer over the link against 1.5 for the ring.
    c = plan.Cluster(plan.Link(1e8, 0.0), 2, plan.Link(1e15, 0.0))
    assert plan.allreduce_time("ring", 4, 1e8, c) / plan.allreduce_time("hierarchical", 4, 1e8, c) \
        == pytest.approx(1.5)


def test_auto_follows_gradrings_choice():
    c = plan.Cluster(LINK, ranks_per_host=4, intra=SHM)
    assert plan.allreduce_time("auto", 4, MIB, c) == plan.shm_time(4, MIB, SHM)  # one host
    assert plan.allreduce_time("auto", 16, MIB, c) == plan.hierarchical_time(4, 4, MIB, LINK, SHM)
    one = plan.Cluster(LINK, ranks_per_host=1)
    assert plan.allreduce_time("auto", 16, MIB, one) == plan.ring_time(16, MIB, LINK)
    assert plan.allreduce_time("auto", 16, 1024, one) == plan.tree_time(16, 1024, LINK)
    with pytest.raises(ValueError, match="unknown algorithm"):
        plan.allreduce_time("bogus", 4, 1, c)
    assert c.split(2) == (1, 2) and c.split(10) == (3, 4)


def test_fit_link_recovers_alpha_and_beta():
    sizes = [4096, MIB, 16 * MIB]
    times = [plan.ring_time(2, s, LINK) for s in sizes]
    fit = plan.fit_link(sizes, times, n=2)
    assert fit.bandwidth == pytest.approx(LINK.bandwidth, rel=1e-6)
    assert fit.latency == pytest.approx(LINK.latency, rel=1e-6)


def _profile(n_layers=4, layer_bytes=4 * MIB, backward_ms=40.0, step_ms=60.0) -> Profile:
    # Layers finish in reverse definition order, evenly over the backward.
    ready = [backward_ms * (n_layers - i) / n_layers for i in range(n_layers)]
    return Profile([f"l{i}" for i in range(n_layers)], [layer_bytes] * n_layers,
                   ["f32"] * n_layers, ready, backward_ms, step_ms)


def test_step_prediction_hides_communication_until_it_cannot():
    p = _profile()
    fast = plan.Cluster(plan.Link(1e12, 0.0))
    slow = plan.Cluster(plan.Link(1e7, 0.0))
    a = plan.predict_step(p, "ring", 8, fast)
    # Only the last bucket (layers 2, 1, 0 after the 1 MiB first bucket; ready at the
    # backward's end) is exposed: one tiny all-reduce.
    assert a.exposed_ms == pytest.approx(1e3 * plan.ring_time(8, 12 * MIB, fast.inter))
    assert a.efficiency == pytest.approx(1.0, abs=1e-3)
    b = plan.predict_step(p, "ring", 8, slow, cap_mb=4)
    # Buckets of 4 MiB each (cap 4 MiB, first bucket 1 MiB holds the first layer alone),
    # back to back from the first ready time: the last ends 4 all-reduces after it.
    per = plan.ring_time(8, 4 * MIB, slow.inter) * 1e3
    assert b.exposed_ms == pytest.approx(p.ready_ms[-1] + 4 * per - p.backward_ms, rel=1e-6)
    assert b.step_ms == pytest.approx(p.step_ms + b.exposed_ms)
    assert b.efficiency == pytest.approx(p.step_ms / b.step_ms)
    # Compression divides the bytes.
    c = plan.predict_step(p, "ring", 8, slow, cap_mb=4, compression=2)
    assert c.allreduce_ms == pytest.approx(plan.ring_time(8, 8 * MIB, slow.inter) * 1e3)


def test_plan_covers_2_to_1024_and_skips_pointless_hierarchical():
    p = _profile()
    plans = plan.plan(p, plan.Cluster(LINK, ranks_per_host=1))
    assert {x.world for x in plans} == set(plan.DEFAULT_RANKS)
    assert not any(x.algo == "hierarchical" for x in plans)
    plans = plan.plan(p, plan.Cluster(LINK, ranks_per_host=8), ranks=[8, 64, 1024])
    eff = {(x.algo, x.world): x.efficiency for x in plans}
    assert ("hierarchical", 8) not in eff and ("hierarchical", 64) in eff
    # Many ranks, latency-bound ring: hierarchical (2(H-1) inter steps) scales better.
    assert eff[("hierarchical", 1024)] > eff[("ring", 1024)]
    assert all(0 < e <= 1.0 + 1e-9 for e in eff.values())


def test_units():
    assert plan.parse_bandwidth("1gbit") == 1.25e8
    assert plan.parse_bandwidth("100mbit") == 1.25e7
    assert plan.parse_bandwidth("10GB/s") == 1e10
    assert plan.parse_bandwidth("1.25e8") == 1.25e8
    assert plan.parse_seconds("0.5ms") == pytest.approx(5e-4)
    assert plan.parse_seconds("20us") == pytest.approx(2e-5)
    assert plan.parse_seconds("1e-3") == pytest.approx(1e-3)
    with pytest.raises(ValueError):
        plan.parse_bandwidth("fast")


def test_profile_from_chrome_trace(tmp_path):
    """Two iterations of a synthetic export_chrome_trace file: bucket sizes, ready, step."""
    ev = []
    for it, t0 in ((1, 0.0), (2, 100_000.0)):  # µs; a step every 100 ms
        ev.append({"ph": "X", "name": "gradring::backward", "pid": 0, "tid": 0, "ts": t0,
                   "dur": 40_000.0, "args": {"iteration": it}})
        for k, (a, b) in enumerate(((0, 10_000), (10_000, 35_000))):
            ev.append({"ph": "X", "name": f"gradring::grads_for_bucket#{k}", "pid": 0, "tid": 0,
                       "ts": t0 + a, "dur": b - a, "args": {"iteration": it}})
            ev.append({"ph": "X", "name": f"gradring::bucket_all_reduce#{k}", "pid": 0,
                       "tid": 1, "ts": t0 + b, "dur": 5000.0,
                       "args": {"iteration": it, "bytes": (k + 1) * MIB}})
        ev.append({"ph": "X", "name": "gradring::finalize", "pid": 0, "tid": 0,
                   "ts": t0 + 40_000, "dur": 2000.0, "args": {"iteration": it}})
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    p = plan.profile_from_trace(str(path))
    assert p.sizes == [MIB, 2 * MIB] and p.ready_ms == [10.0, 35.0]
    assert p.backward_ms == 40.0 and p.step_ms == pytest.approx(98.0)
    step = plan.predict_step(p, "ring", 2, plan.Cluster(plan.Link(1e12, 0.0)), buckets_fixed=True)
    assert step.exposed_ms == pytest.approx(0.0, abs=1e-3)
    assert math.isclose(step.step_ms, 98.0, rel_tol=1e-6)


def test_cli_prints_a_table(capsys):
    assert plan.main(["tiny", "--bandwidth", "1gbit", "--latency", "0.5ms",
                     "--ranks-per-host", "2", "--ranks", "2,4,1024"]) == 0
    out = capsys.readouterr().out
    assert "hierarchical" in out and "1024" in out and "efficiency" in out


def test_workload_is_profiled_on_one_thread_like_tune(monkeypatch):
    import torch

    seen = []
    real = plan.profile_backward

    def spy(make, **kw):
        seen.append(torch.get_num_threads())
        return real(make, warmup=1, steps=1)

    monkeypatch.setattr(plan, "profile_backward", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        profile = plan.profile_workload("tiny")
        assert seen == [1], "plan must time the compute step as tune's ranks do: one thread"
        assert torch.get_num_threads() == 2  # the caller's setting comes back
        assert profile.step_ms > 0 and len(profile.sizes) == 8
    finally:
        torch.set_num_threads(before)
