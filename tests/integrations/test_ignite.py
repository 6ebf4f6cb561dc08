"""PyTorch-Ignite: `idist.auto_model` with `gradring.install()` against torch's DDP, bit for bit.

Ignite looks ``torch.nn.parallel.DistributedDataParallel`` up when it wraps, so
``install()`` before ``auto_model`` is the whole switch. The training loop is
Ignite's own (``create_supervised_trainer``), on ``auto_dataloader`` and
``auto_optim``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest

pytest.importorskip("ignite", reason="pytorch-ignite is missing: pip install -e '.[integrations]'")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from tests.integrations.common import (  # noqa: E402
    exactly_equal,
    first_difference,
    launched_like_torchrun,
    params_of,
    release,
)


def _ignite_fit(impl: str) -> dict[str, Any]:
    import ignite.distributed as idist
    from ignite.engine import Events, create_supervised_trainer

    import gradring

    with gradring.install() if impl == "gradring" else contextlib.nullcontext():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
        model = idist.auto_model(net)  # the line the switch acts on
        opt = idist.auto_optim(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
        g = torch.Generator().manual_seed(1)
        ds = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g),
                                            torch.randn(64, 4, generator=g))
        loader = idist.auto_dataloader(ds, batch_size=8, shuffle=False)
        trainer = create_supervised_trainer(model, opt, F.mse_loss)
        losses: list[float] = []
        trainer.add_event_handler(Events.ITERATION_COMPLETED,
                                  lambda engine: losses.append(engine.state.output))
        trainer.run(loader, max_epochs=2)
    return {"wrapper": type(model).__module__, "losses": losses, "params": params_of(net)}


def ignite_in_ranks(rank: int, world: int) -> dict[str, Any]:
    launched_like_torchrun(rank, world)
    out = {impl: _ignite_fit(impl) for impl in ("torch", "gradring")}
    out["segments_left"] = release()
    return out


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ignite_auto_model_matches_torch_ddp(integ_pool) -> None:
    results = integ_pool.run(ignite_in_ranks)
    for rank, res in enumerate(results):
        assert res["segments_left"] == []
        assert res["torch"]["wrapper"] == "torch.nn.parallel.distributed"
        assert res["gradring"]["wrapper"] == "gradring.ddp"
        for key in ("losses", "params"):
            a, b = res["torch"][key], res["gradring"][key]
            assert exactly_equal(a, b), f"rank {rank}, {key}: {first_difference(a, b)}"
    assert results[0]["gradring"]["losses"] != results[1]["gradring"]["losses"]
