"""scripts/gpu_check.py's own parts: the comparisons it reports with, the rule
for a compiled graph split at the buckets, and how rank outcomes combine.

The script is shipped standalone (it imports nothing from tests/), so it is
loaded here from its path. Its runs are in tests/jobs/test_gpu_check.py.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gc():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("gpu_check", None)


def _tensors():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(3, 4, generator=g), None, torch.randn(5, generator=g)]


def test_equal_tensors_and_matching_nones_pass(gc):
    a = _tensors()
    b = [None if t is None else t.clone() for t in a]
    assert gc.compare_exact("grads", ["w", "unused", "b"], a, b) is None
    assert gc.compare_close("grads", ["w", "unused", "b"], a, b, 1e-6, 0.0) is None


def test_one_ulp_is_a_difference(gc):
    a = _tensors()
    b = gc.nudge_first(a)
    assert b[0] is not a[0] and not torch.equal(a[0], b[0])
    assert b[0].view(-1)[0] == torch.nextafter(a[0].view(-1)[0], torch.tensor(math.inf))
    msg = gc.compare_exact("step 3, gradients", ["w", "unused", "b"], b, a)
    assert msg == ("step 3, gradients: 1 of 3 tensors differ; first w: 1 of 12 elements "
                   f"differ, max abs diff {abs(b[0].view(-1)[0] - a[0].view(-1)[0]).item():.3g}")
    # a bound wider than one ulp accepts it, a zero bound does not
    assert gc.compare_close("g", ["w", "unused", "b"], b, a, 1e-6, 0.0) is None
    assert "first w: max abs diff" in gc.compare_close("g", ["w", "unused", "b"], b, a, 0.0, 0.0)


def test_none_against_a_tensor_shapes_dtypes_and_counts(gc):
    a = _tensors()
    b = list(a)
    b[1] = torch.zeros(2)
    assert gc.compare_exact("g", ["w", "u", "b"], a, b).endswith("first u is None against a tensor")
    c = list(a)
    c[2] = a[2].double()
    assert "first b is torch.float32 (5,) against torch.float64 (5,)" in \
        gc.compare_exact("g", ["w", "u", "b"], a, c)
    d = list(a)
    d[0] = a[0].reshape(4, 3)
    assert "first w is torch.float32 (3, 4) against torch.float32 (4, 3)" in \
        gc.compare_exact("g", ["w", "u", "b"], a, d)
    assert gc.compare_exact("g", ["w", "u"], a[:2], a) == "g: 2 tensors against 3 (2 names)"


def test_nan_never_passes(gc):
    a = [torch.tensor([1.0, float("nan")])]
    assert gc.compare_exact("g", ["w"], a, [a[0].clone()]) is not None
    assert gc.compare_close("g", ["w"], a, [a[0].clone()], 1.0, 1.0) is not None


def test_split_at_the_buckets(gc):
    # Pieces in forward order; the last piece's backward runs first.
    assert gc.split_problem([[3], [2], [1], [0]], 4) is None
    assert gc.split_problem([[1, 0]], 2) is None  # one piece completing both: no cut at all
    assert gc.split_problem([[2], [2, 1], [0]], 3) is None  # bucket 1 before 2, as launched
    assert gc.split_problem([[1], [1, 0]], 3) == "buckets [2] are in no piece: [[1], [1, 0]]"
    assert gc.split_problem([[1], [1], [0]], 2).startswith(
        "piece 1 (forward order) completes no bucket")
    # Bucket 8 completes before bucket 7, which it must wait for: a useless cut.
    msg = gc.split_problem([[7], [7, 8], [6], [5], [4], [3], [2], [1], [0]], 9)
    assert msg.startswith("bucket 8 completes in piece 1 (forward order), before bucket 7 "
                          "in piece 0"), msg


def test_rank_outcomes_combine(gc):
    ok = (gc.PASS, "equal", 1.0, 10.0)
    assert gc.combine("w2/plain", {0: ok, 1: ok}, 2).status == gc.PASS
    # the rank that failed first carries the cause; the other is named after it
    out = gc.combine("w2/plain", {0: (gc.FAIL, "connection closed", 2.0, 12.0),
                                  1: (gc.FAIL, "boom", 1.0, 11.0)}, 2)
    assert (out.status, out.detail) == (gc.FAIL, "rank 1: boom (rank 0 failed after it)")
    skip = (gc.SKIP, "needs CUDA", 0.0, 0.0)
    assert gc.combine("w1/cost", {0: skip}, 1).status == gc.SKIP
    assert gc.combine("w2/x", {0: skip, 1: ok}, 2).status == gc.PASS


def test_summary_and_exit_status(gc):
    o = [gc.Outcome("a", gc.PASS, ""), gc.Outcome("b", gc.SKIP, "needs CUDA")]
    assert gc.exit_code(o) == 0
    assert gc.summary_line(o, 12.3, "CPU").startswith("SUMMARY: 1 passed, 0 failed, 1 skipped")
    o.append(gc.Outcome("c", gc.FAIL, "differs"))
    assert gc.exit_code(o) == 1
    assert gc.summary_line(o, 1, "CPU").endswith("; failed: c")
    assert gc.format_outcome(gc.Outcome("w1/cost", gc.PASS, "head\n| t |", 2.0)) == \
        "PASS w1/cost: head [2.0 s]\n    | t |"


def test_every_check_is_named_by_its_job(gc):
    names = [c.name for c in gc.CHECKS]
    assert len(names) == len(set(names))
    assert {c.job for c in gc.CHECKS} == {"w1", "w2", "compile"}
    assert {c.name for c in gc.CHECKS if c.cuda_only} == {"w1/streams", "w1/cost", "w2/streams"}
