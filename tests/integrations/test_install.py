"""gradring.install() / uninstall(): torch's DDP name builds gradring's wrapper, and back."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradring
from gradring.install import install, installed, uninstall
from tests.integrations.common import exactly_equal, release

HOMES = (torch.nn.parallel, torch.nn.parallel.distributed)
TORCH_DDP = torch.nn.parallel.distributed.DistributedDataParallel


def _names() -> list[Any]:
    return [home.DistributedDataParallel for home in HOMES]


def test_install_swaps_both_names_and_uninstall_restores_them() -> None:
    assert not installed() and _names() == [TORCH_DDP, TORCH_DDP]
    try:
        handle = install()
        assert installed()
        assert _names() == [gradring.DistributedDataParallel] * 2
        install()  # again: still installed, and uninstall still finds torch's class
        from torch.nn.parallel import DistributedDataParallel as late_import

        assert late_import is gradring.DistributedDataParallel
        with install():  # already installed: leaving the block keeps it installed
            pass
        assert installed()
        assert handle is not None
    finally:
        uninstall()
    assert not installed() and _names() == [TORCH_DDP, TORCH_DDP]
    uninstall()  # not installed: nothing happens
    assert _names() == [TORCH_DDP, TORCH_DDP]
    with install():
        assert installed()
    assert not installed() and _names() == [TORCH_DDP, TORCH_DDP]


def test_uninstall_refuses_to_clobber_a_later_replacement() -> None:
    class Other(nn.Module):
        pass

    install()
    try:
        torch.nn.parallel.DistributedDataParallel = Other
        with pytest.raises(RuntimeError, match="replaced by .*Other.* after gradring.install"):
            uninstall()
    finally:
        torch.nn.parallel.DistributedDataParallel = gradring.DistributedDataParallel
        uninstall()
    assert _names() == [TORCH_DDP, TORCH_DDP]


def _train(make_ddp: Any, rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    ddp = make_ddp(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(10 + rank)
    losses = []
    for _ in range(4):
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
        opt.zero_grad()
        loss = F.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"cls": type(ddp), "losses": losses,
            "params": {k: v.detach().clone() for k, v in ddp.module.state_dict().items()}}


def install_in_ranks(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    grabbed_before = torch.nn.parallel.DistributedDataParallel  # as `from ... import` would
    by_name = lambda m: torch.nn.parallel.DistributedDataParallel(m)  # noqa: E731
    out: dict[str, Any] = {"torch": _train(by_name, rank)}
    with install():
        out["gradring"] = _train(by_name, rank)
        out["grabbed_before"] = _train(grabbed_before, rank)
        torch.manual_seed(0)
        ddp = torch.nn.parallel.distributed.DistributedDataParallel(nn.Linear(3, 3))
        out["isinstance_old_name"] = isinstance(ddp, grabbed_before)

        # A subclass defined while installed derives from gradring's class; its
        # super() calls end in gradring's code, not back in the installed name.
        class Logged(torch.nn.parallel.DistributedDataParallel):
            calls = 0

            def forward(self, *a: Any, **k: Any) -> Any:
                Logged.calls += 1
                return super().forward(*a, **k)

        out["subclass"] = _train(Logged, rank)
        out["subclass_calls"] = Logged.calls
    out["after"] = _train(by_name, rank)
    out["segments_left"] = release()
    for key in ("torch", "gradring", "grabbed_before", "subclass", "after"):
        out[key]["cls"] = out[key]["cls"].__module__
    return out


@pytest.mark.timeout(180)
def test_installed_name_trains_like_torch_ddp(integ_pool) -> None:
    for rank, res in enumerate(integ_pool.run(install_in_ranks)):
        assert res["segments_left"] == []
        assert res["torch"]["cls"] == "torch.nn.parallel.distributed"
        assert res["gradring"]["cls"] == "gradring.ddp"
        # Code that took torch's class before install() keeps building torch's DDP.
        assert res["grabbed_before"]["cls"] == "torch.nn.parallel.distributed"
        assert res["after"]["cls"] == "torch.nn.parallel.distributed"
        assert res["subclass_calls"] == 4
        # ...and its isinstance checks accept gradring's wrapper.
        assert res["isinstance_old_name"]
        for key in ("gradring", "grabbed_before", "subclass", "after"):
            for what in ("losses", "params"):
                assert exactly_equal(res["torch"][what], res[key][what]), (rank, key, what)
