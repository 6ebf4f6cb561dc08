"""convert_sync_batchnorm on timm models: two ranks == one process over the global batch.

Each rank builds the model, keeps one copy as it is (the reference, run in
train mode on the whole global batch) and converts another, which runs on
the rank's half. Outputs, summed gradients and running statistics must agree.
mobilenetv3_small_050 is built from timm's ``BatchNormAct2d`` (batch norm with
a fused activation), resnet10t from plain ``BatchNorm2d``. Everything runs in
float64, so the comparisons are tight.

The ranks import timm through tests/integrations/torchvision_stand_in.py (see
[Note: timm without torchvision] there) and run in a pool of their own.
"""

from __future__ import annotations

import copy
import importlib.util
import warnings

import pytest

if importlib.util.find_spec("timm") is None:
    pytest.skip("timm is missing: pip install --no-deps timm", allow_module_level=True)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from gradring.nn import SyncBatchNorm, SyncBatchNormAct  # noqa: E402
from tests.integrations.torchvision_stand_in import import_timm  # noqa: E402
from tests.support.rankpool import RankPool  # noqa: E402

WORLD = 2
PER_RANK = 3
TOL = 1e-9

# ---------------------------------------------------------------- rank side


def _rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference, relative to the reference's largest magnitude (at least 1)."""
    return ((a - b).abs().max() / b.abs().max().clamp(min=1)).item()


def _converted_vs_global_batch(rank: int, world: int, name: str, size: int,
                               steps: int) -> dict:
    timm = import_timm()
    torch.manual_seed(0)
    ref = timm.create_model(name, num_classes=10).double().train()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(ref))
    kinds = sorted({type(m).__name__ for m in model.modules()
                    if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)})
    lo, hi = PER_RANK * rank, PER_RANK * (rank + 1)
    g = torch.Generator().manual_seed(1)
    diffs: dict[str, float] = {"out": 0.0, "grad": 0.0}
    for _ in range(steps):
        x = torch.randn(PER_RANK * world, 3, size, size, generator=g, dtype=torch.float64)
        up = torch.randn(PER_RANK * world, 10, generator=g, dtype=torch.float64)
        ref.zero_grad()
        model.zero_grad()
        ref_out = ref(x)
        (ref_out * up).sum().backward()
        out = model(x[lo:hi])
        (out * up[lo:hi]).sum().backward()
        diffs["out"] = max(diffs["out"], _rel_diff(out, ref_out[lo:hi].detach()))
        for p, q in zip(model.parameters(), ref.parameters()):
            summed = p.grad.clone()
            dist.all_reduce(summed)  # what DDP does to every gradient
            diffs["grad"] = max(diffs["grad"], _rel_diff(summed, q.grad))
    ref_state = ref.state_dict()
    diffs["running_stats"] = max(
        _rel_diff(v.double(), ref_state[k].double())
        for k, v in model.state_dict().items() if k.endswith(("running_mean", "running_var")))
    return {"diffs": diffs, "kinds": kinds, "warnings": [str(w.message) for w in caught]}


# ---------------------------------------------------------------- test side


@pytest.fixture(scope="module")
def timm_pool():
    pool = RankPool(WORLD)
    yield pool
    pool.close()


@pytest.mark.parametrize("name,kind", [
    ("mobilenetv3_small_050", SyncBatchNormAct.__name__),  # timm's BatchNormAct2d
    ("resnet10t", SyncBatchNorm.__name__),  # torch's BatchNorm2d
])
def test_converted_timm_model_matches_one_process(timm_pool, name, kind):
    results = timm_pool.run(_converted_vs_global_batch, name, 64, 2, timeout=240)
    for rank, res in enumerate(results):
        for what, d in res["diffs"].items():
            assert d <= TOL, f"{name} rank {rank}: {what} differs by {d:.3g} (relative)"
        assert res["kinds"] == [kind], res["kinds"]
        assert res["warnings"] == [], res["warnings"]
