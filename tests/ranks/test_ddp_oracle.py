"""gradring DDP against its oracles: one process on the global batch, and torch's DDP."""

import pytest

from tests.support import oracle

TOL = 1e-9  # float64 models: summation order is the only difference


def _compare(rank, world_size, kind, kwargs, steps, accumulate, against_single):
    return oracle.train_compare(rank, world_size, kind, kwargs, steps=steps,
                                accumulate=accumulate, against_single=against_single)


CASES = [
    ("mlp", {}, 1),
    ("mlp", {"bucket_cap_mb": 0.0005}, 1),
    ("mlp", {"gradient_as_bucket_view": True}, 1),
    ("mlp", {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.0005}, 3),
    ("mlp", {}, 3),
    ("transformer", {"bucket_cap_mb": 0.01}, 1),
    ("multi", {}, 2),
]


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("kind,kwargs,accumulate", CASES)
def test_matches_single_process_and_torch(pools, world_size, kind, kwargs, accumulate):
    results = pools.run(world_size, _compare, kind, kwargs, 4, accumulate, True)
    for r in results:
        assert r["grad_single"] < TOL and r["param_single"] < TOL, r
        assert r["grad_torch"] < TOL and r["param_torch"] < TOL, r


@pytest.mark.parametrize("kwargs", [{}, {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.001},
                                    {"broadcast_buffers": False}])
def test_batchnorm_cnn_matches_torch_ddp(pools, kwargs):
    # Per-rank BatchNorm statistics: torch's DDP is the oracle, not one process.
    results = pools.run(2, _compare, "cnn_bn", kwargs, 4, 1, False)
    for r in results:
        assert r["grad_torch"] < TOL and r["param_torch"] < TOL, r
