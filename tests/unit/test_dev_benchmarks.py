"""The developer benchmarks in benchmarks/ (a source checkout's, not the package's):
their tables on synthetic rounds, the interface they use in gradring.tools.bench,
and the one-way dependency (benchmarks/ imports gradring, never the reverse)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from benchmarks.ddp_against import report as against_report
from benchmarks.ddp_floor import FlatDDP, floor_table
from benchmarks.ddp_rung import rung_table
from gradring.tools.bench import ddp_step

ROOT = Path(__file__).resolve().parents[2]


def _rounds(pair: list[float], torch_: list[float], gradring: list[float]) -> dict:
    return {"m": {"pair": pair, "torch": torch_, "gradring": gradring,
                  "gradring_view": gradring, "_pair_rank0": pair}}


def test_against_report_flags_only_a_consistent_slowdown() -> None:
    def rounds(*gradring: float) -> list[dict]:
        return [{"m": {"pair": 10.0, "torch": 20.0, "gradring": g}} for g in gradring]

    steady = against_report(rounds(13.0, 13.1, 12.9), rounds(13.0, 13.05, 12.95), "HEAD~1")
    assert steady.splitlines()[-1].endswith("ok")
    slower = against_report(rounds(15.0, 15.2, 14.9), rounds(13.0, 13.1, 12.9), "HEAD~1")
    assert slower.splitlines()[-1].endswith("SLOWER")
    one_bad_round = against_report(rounds(13.0, 19.0, 12.8), rounds(13.0, 13.1, 12.9),
                                   "HEAD~1")
    assert one_bad_round.splitlines()[-1].endswith("ok")


def test_rung_table_is_overhead_in_units_of_one_allreduce() -> None:
    res = _rounds([10.0, 10.0, 10.0], [18.0, 18.0, 18.0], [13.0, 13.0, 13.0])
    res["m"].update(allreduce_ms=[2.0, 1.9, 2.5], _bytes=[float(4 << 20)])
    row = rung_table(res)[-1]
    assert row.split() == ["m", "4.00", "2.000", "3.00", "8.00", "1.50", "4.00"]
    # Without the probe's series there is no table, and the bench's own report has none.
    assert rung_table(_rounds([10.0], [14.0], [11.0])) == []
    assert "rung" not in ddp_step.report(res, 2)


def test_floor_table_gives_per_round_medians() -> None:
    rounds = {"pair": [10.0, 10.0, 10.0], "torch": [20.0, 22.0, 18.0],
              "gradring": [14.0, 15.0, 13.0], "gradring_view": [14.0, 15.0, 13.0],
              "floor": [12.0, 12.0, 12.0], "_pair_rank0": [10.0, 10.0, 10.0]}
    row = floor_table({"m": rounds})[-1]
    # overheads: floor 2, gradring 4 (median of 4, 5, 3), torch 10; gradring - floor 2
    assert row.split() == ["m", "2.00", "4.00", "0.20", "0.40", "2.00"]
    assert floor_table({"m": {k: v for k, v in rounds.items() if k != "floor"}}) == []


@pytest.mark.parametrize("extra", [{"pair": FlatDDP}, {"_floor": FlatDDP}])
def test_measure_refuses_an_extra_setup_that_takes_a_bench_name(extra: dict) -> None:
    # Checked before any rank starts: a clash would overwrite the bench's own figures.
    with pytest.raises(ValueError, match="clash with the bench's own names"):
        ddp_step.measure(2, ["mlp8"], extra_setups=extra)


def test_measure_refuses_an_unknown_model() -> None:
    with pytest.raises(ValueError, match=r"unknown models \['nope'\]"):
        ddp_step.measure(2, ["nope"])


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
    return out


def test_the_package_never_imports_the_checkouts_benchmarks() -> None:
    offenders = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "gradring").rglob("*.py")
                       if any(m == "benchmarks" or m.startswith("benchmarks.")
                              for m in _imported_modules(p)))
    assert offenders == []
    # The check sees such an import where there is one.
    assert "benchmarks.ddp_floor" in _imported_modules(
        ROOT / "tests" / "unit" / "test_dev_benchmarks.py")
