"""Benchmarks flag what noise ate: spreads across rounds, negative or noisy overheads
(gradring/tools/bench/noise.py and the ``gradring bench ddp`` report), on synthetic rounds."""

from __future__ import annotations

import math
import statistics

import pytest

from gradring.tools.bench import ddp_step, noise


def test_figure_is_median_and_range_over_rounds() -> None:
    f = noise.figure([10.0, 12.0, 11.0, 30.0, 9.0])
    assert (f.median, f.low, f.high, f.spread) == (11.0, 9.0, 30.0, 21.0)
    assert str(f) == "11.0 ±10.5"
    assert math.isnan(noise.figure([]).median)


def test_effect_is_taken_round_by_round() -> None:
    # The machine slows down over the run; per-round differences stay steady.
    base = [10.0, 20.0, 30.0, 40.0, 50.0]
    e = noise.effect(base, [b + 2.0 for b in base])
    assert e.median == 2.0 and e.spread == 0.0
    with pytest.raises(ValueError, match="rounds differ"):
        noise.effect([1.0], [1.0, 2.0])


def test_ratio_only_when_both_effects_stand_out_of_the_noise() -> None:
    steady = noise.figure([4.0, 4.2, 3.9])
    small = noise.figure([1.0, 1.1, 0.9])
    ok = noise.ratio(small, steady)
    assert ok.problem == "" and ok.ratio == pytest.approx(1.0 / 4.0)
    negative = noise.ratio(small, noise.figure([-0.5, -0.8, 0.4]), ("gradring", "torch"))
    assert negative.ratio is None and "torch overhead is -0.50 ms" in negative.problem
    wobbly = noise.ratio(noise.figure([0.2, 3.0, 1.0]), steady, ("gradring", "torch"))
    assert wobbly.ratio is None and "spread larger than the effect" in wobbly.problem
    assert wobbly.cell(8) == "   noisy" and ok.cell() == "0.25"


def _rounds(pair: list[float], torch_: list[float], gradring: list[float]) -> dict:
    return {"m": {"pair": pair, "torch": torch_, "gradring": gradring,
                  "gradring_view": gradring, "_pair_rank0": pair}}


def test_ddp_report_prints_a_ratio_for_clean_rounds() -> None:
    text = ddp_step.report(_rounds([10.0, 10.2, 9.9], [14.0, 14.1, 13.8], [11.0, 11.2, 10.9]), 2)
    row = next(line for line in text.splitlines() if line.startswith("m "))
    # 1.0 / 3.9: the overheads are taken round by round
    assert "0.26" in row and "noisy" not in row and "NOT TRUSTWORTHY" not in text
    assert "10.0 ±0.1" in row  # every figure carries its spread


def test_ddp_report_flags_a_negative_overhead_instead_of_a_ratio() -> None:
    # The rounds behind "ratio -1.31": torch's DDP faster than no DDP in most rounds.
    text = ddp_step.report(_rounds([12.0, 11.0, 15.0], [11.0, 10.5, 16.0],
                                   [13.0, 12.5, 16.0]), 2)
    row = next(line for line in text.splitlines() if line.startswith("m "))
    assert "noisy" in row and "-1.31" not in row
    assert "NOT TRUSTWORTHY" in text and "torch overhead is -0.50 ms" in text


def test_ddp_report_flags_spread_larger_than_the_effect() -> None:
    text = ddp_step.report(_rounds([10.0, 10.0, 10.0], [14.0, 14.0, 14.0],
                                   [10.5, 13.0, 10.2]), 2)
    assert "gradring overhead 0.50 ms varies by 2.80 ms" in text


def test_pair_baseline_is_each_steps_slower_rank() -> None:
    # Two ranks that take turns being slow: each rank's median is 13 ms, but
    # every step waits 16 ms for its slower rank, as a DDP step would.
    def rank(steps: list[float]) -> dict:
        med = statistics.median(steps)
        return {"m": {"pair": [med], "torch": [20.0], "gradring": [18.0],
                      "_pair_steps": steps}}
    merged = ddp_step._slowest([rank([10.0, 16.0, 10.0, 16.0]), rank([16.0, 10.0, 16.0, 10.0])])
    assert merged["m"]["pair"] == [16.0]
    assert merged["m"]["_pair_median"] == [13.0]
    assert merged["m"]["torch"] == [20.0]
    text = ddp_step.report({"m": {**merged["m"], "gradring_view": [18.0]}}, 2)
    row = next(line for line in text.splitlines() if line.startswith("m "))
    assert "0.50" in row and "0.71" in row  # 2/4 per step; 5/7 against the medians


def test_ddp_report_never_runs_two_figures_together() -> None:
    # Wide figures (hundreds of ms with a wide spread) once filled their columns
    # and printed as "576.9 ±69.6534.4 ±105.4".
    text = ddp_step.report(_rounds([500.0, 640.0, 510.0], [430.0, 640.0, 520.0],
                                   [576.9, 700.0, 450.0]), 2)
    row = next(line for line in text.splitlines() if line.startswith("m "))
    assert all(part.count("±") <= 1 for part in row.split()), row
    assert row.count("±") == 6, row


def test_competing_load_spins_while_the_block_runs_and_never_after() -> None:
    import os
    import time

    from gradring.tools.bench.load import competing_load

    with competing_load(2) as pids:
        assert len(pids) == 2
        deadline = time.monotonic() + 30
        while True:  # each spinner is running (state R) once Python has started
            states = []
            for pid in pids:
                with open(f"/proc/{pid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            if all(s == "R" for s in states) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert states == ["R", "R"]
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}")


def test_paired_steps_cancel_a_machine_that_drifts_within_a_round() -> None:
    # The machine slows by 10 ms a step; every DDP step sits beside its pair step.
    pair = [10.0, 20.0, 30.0, 40.0]

    def rank(extra: float) -> dict:
        return {"m": {"pair": [25.0], "torch": [29.0], "gradring": [26.0],
                      "gradring_view": [26.0], "_pair_steps": pair,
                      "_steps_pair": pair, "_steps_torch": [p + 4.0 for p in pair],
                      "_steps_gradring": [p + 1.0 + extra for p in pair],
                      "_steps_gradring_view": [p + 1.0 for p in pair]}}

    merged = ddp_step._slowest([rank(0.0), rank(0.5)])
    assert merged["m"]["_steps_gradring"] == [p + 1.5 for p in pair]  # the slower rank
    assert ddp_step.paired(merged["m"], "gradring") == [1.5] * 4
    text = ddp_step.report(merged, 2)
    row = next(line for line in text.splitlines()[text.splitlines().index(
        next(ln for ln in text.splitlines() if ln.startswith("paired per step"))):]
        if line.startswith("m "))
    assert row.split() == ["m", "4", "4.00", "1.50", "0.38", "0.38/0.38", "0.25"]
    # Without per-step times there is no paired table.
    assert "paired per step" not in ddp_step.report(_rounds([10.0], [14.0], [11.0]), 2)


def test_interleaved_rounds_shuffle_the_turn_order(monkeypatch: pytest.MonkeyPatch) -> None:
    # Over a run every set-up takes every place and follows every other one
    # (no set-up always first, or always right after torch's DDP), and every
    # rank steps the same order: it depends on the step's number alone.
    monkeypatch.setattr(ddp_step.dist, "barrier", lambda: None)
    names = ("pair", "torch", "gradring", "view")

    def run() -> tuple[list[str], dict]:
        seen: list[str] = []
        monkeypatch.setattr(ddp_step, "_one_step",
                            lambda m, opt, x: (seen.append(m) or 1.0, 1.0))
        setups = {k: k for k in names}
        out = {}
        for r in range(10):  # the order goes on across rounds, not from the start
            out = ddp_step.interleaved_round(setups, dict.fromkeys(setups),
                                             None, 4, r * 4)  # type: ignore[arg-type]
        return seen, out

    seen, out = run()
    assert run()[0] == seen
    cycles = [seen[i:i + 4] for i in range(0, len(seen), 4)]
    assert all(sorted(c) == sorted(names) for c in cycles) and len(cycles) == 40
    assert {c[0] for c in cycles} == set(names)
    after_torch = {c[c.index("torch") + 1] for c in cycles if c[-1] != "torch"}
    assert after_torch == {"pair", "gradring", "view"}
    assert len({tuple(c) for c in cycles[:4]}) > 1 and cycles[:4] != cycles[4:8]
    assert {k: len(v[2]) for k, v in out.items()} == dict.fromkeys(names, 4)
