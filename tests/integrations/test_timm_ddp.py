"""timm: a timm model and optimizer under ``gradring.install()`` against torch's DDP, bit for bit.

The loop is the one timm's ``train.py`` runs (``create_model``,
``create_optimizer_v2``, the model wrapped in
``torch.nn.parallel.DistributedDataParallel``), on ``resnet10t`` (plain
``BatchNorm2d``, whose running statistics DDP broadcasts from rank 0 every
forward) with small random images. The ranks import timm through
tests/integrations/torchvision_stand_in.py (see [Note: timm without
torchvision] there) and so run in a pool of their own.
"""

from __future__ import annotations

import contextlib
import importlib.util
from typing import Any

import pytest

if importlib.util.find_spec("timm") is None:
    pytest.skip("timm is missing: pip install --no-deps timm", allow_module_level=True)
pytest.importorskip("tests.integrations.torchvision_stand_in")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tests.integrations.common import (  # noqa: E402
    exactly_equal,
    first_difference,
    params_of,
    release,
)
from tests.support.rankpool import RankPool  # noqa: E402


def _timm_fit(impl: str, rank: int) -> dict[str, Any]:
    import gradring
    from tests.integrations.torchvision_stand_in import import_timm

    timm = import_timm()
    from timm.optim import create_optimizer_v2

    with gradring.install() if impl == "gradring" else contextlib.nullcontext():
        torch.manual_seed(0)
        net = timm.create_model("resnet10t", num_classes=5)
        model = torch.nn.parallel.DistributedDataParallel(net)  # as timm's train.py wraps
        opt = create_optimizer_v2(model, "sgd", lr=0.05, momentum=0.9, weight_decay=1e-4)
        g = torch.Generator().manual_seed(10 + rank)
        losses = []
        model.train()
        for _ in range(3):
            x = torch.randn(4, 3, 32, 32, generator=g)
            y = torch.randint(0, 5, (4,), generator=g)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return {"wrapper": type(model).__module__, "losses": losses, "params": params_of(net)}


def timm_in_ranks(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out = {impl: _timm_fit(impl, rank) for impl in ("torch", "gradring")}
    out["segments_left"] = release()
    return out


@pytest.fixture(scope="module")
def timm_pool():  # noqa: ANN201
    pool = RankPool(2)
    yield pool
    pool.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_timm_resnet_matches_torch_ddp(timm_pool) -> None:
    results = timm_pool.run(timm_in_ranks, timeout=240)
    for rank, res in enumerate(results):
        assert res["segments_left"] == []
        assert res["torch"]["wrapper"] == "torch.nn.parallel.distributed"
        assert res["gradring"]["wrapper"] == "gradring.ddp"
        for key in ("losses", "params"):  # params: BN running statistics included
            a, b = res["torch"][key], res["gradring"][key]
            assert exactly_equal(a, b), f"rank {rank}, {key}: {first_difference(a, b)}"
    assert results[0]["gradring"]["losses"] != results[1]["gradring"]["losses"]
