"""Ray Train: gradring's routes against Ray's own torch-DDP path, bit for bit.

A ``TorchTrainer`` with two CPU workers on this host runs the same training
function along each route; every worker writes its losses, final parameters
and the wrapper's class to a file, and the test compares them with
``torch.equal`` and float ``==``:

- ``ray_ddp``: ``ray.train.torch.prepare_model(model)`` -- torch's DDP, the oracle;
- ``gradring_prepare``: ``gradring.ray.prepare_model(model)``;
- ``install_inside``: ``gradring.install()`` in the training function, then
  Ray's ``prepare_model`` (Ray's module global is rebound, see [Note: captured
  names] in gradring/captures.py);
- ``setup_hook``: ``ray.init(runtime_env=gradring.ray.runtime_env(...))`` and
  Ray's ``prepare_model`` unchanged.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray.train.torch",
                    reason="ray[train] is missing: pip install -e '.[integrations]'")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from tests.integrations.common import exactly_equal, first_difference  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

_ROOT = str(Path(__file__).resolve().parents[2])


def train_fn(config: dict[str, Any]) -> None:
    """The training function every Ray worker runs."""
    import ray.train
    import ray.train.torch

    import gradring
    import gradring.ray
    from tests.integrations.common import release

    torch.set_num_threads(1)
    route = config["route"]
    if route == "install_inside":
        gradring.install()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                          nn.Linear(32, 4))
    if route == "gradring_prepare":
        model = gradring.ray.prepare_model(model)
    else:
        model = ray.train.torch.prepare_model(model)
    rank = ray.train.get_context().get_world_rank()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(10 + rank)
    losses = []
    for _ in range(6):
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    out = {"wrapper": type(model).__module__, "losses": losses,
           "params": {k: v.detach().clone() for k, v in model.module.state_dict().items()},
           "installed": _installed()}
    out["segments_left"] = release()
    torch.save(out, os.path.join(config["out"], f"{route}-{rank}.pt"))
    gradring.uninstall()


def _installed() -> bool:
    import sys

    return sys.modules["gradring.install"].installed()


def _ray_session(runtime_env: dict[str, Any]) -> None:
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=2, object_store_memory=80 * 1024 * 1024, include_dashboard=False,
             _node_ip_address="127.0.0.1", runtime_env=runtime_env, log_to_driver=False)


def _fit(route: str, out: Path) -> list[dict[str, Any]]:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(
        train_fn, train_loop_config={"route": route, "out": str(out)},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False,
                                     resources_per_worker={"CPU": 1}),
        run_config=RunConfig(storage_path=str(out / "ray_results"), name=route))
    trainer.fit()
    return [torch.load(out / f"{route}-{rank}.pt") for rank in range(2)]


def _env() -> dict[str, Any]:
    return {"env_vars": {"PYTHONPATH": _ROOT, "OMP_NUM_THREADS": "1"}}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    import ray

    import gradring.ray

    out = tmp_path_factory.mktemp("ray")
    got: dict[str, list[dict[str, Any]]] = {}
    _ray_session(_env())
    try:
        for route in ("ray_ddp", "gradring_prepare", "install_inside"):
            got[route] = _fit(route, out)
    finally:
        ray.shutdown()
    _ray_session(gradring.ray.runtime_env(_env()))
    try:
        got["setup_hook"] = _fit("setup_hook", out)
    finally:
        ray.shutdown()
    return got


def test_ray_ddp_is_torchs(results) -> None:
    for res in results["ray_ddp"]:
        assert res["wrapper"] == "torch.nn.parallel.distributed"
        assert not res["installed"]
    assert results["ray_ddp"][0]["losses"] != results["ray_ddp"][1]["losses"]


@pytest.mark.parametrize("route", ["gradring_prepare", "install_inside", "setup_hook"])
def test_ray_route_builds_gradring_and_matches_ray_ddp(results, route: str) -> None:
    for rank, (want, got) in enumerate(zip(results["ray_ddp"], results[route])):
        assert got["wrapper"] == "gradring.ddp", (route, rank)
        assert got["segments_left"] == []
        assert got["installed"] == (route != "gradring_prepare")
        for key in ("losses", "params"):
            assert exactly_equal(want[key], got[key]), \
                f"{route}, rank {rank}, {key}: {first_difference(want[key], got[key])}"


def test_runtime_env_keeps_what_it_is_given() -> None:
    import gradring.ray

    env = gradring.ray.runtime_env({"env_vars": {"A": "1"}})
    assert env == {"env_vars": {"A": "1"}, "worker_process_setup_hook": "gradring.ray.setup_hook"}
    with pytest.raises(ValueError, match="already has a worker_process_setup_hook"):
        gradring.ray.runtime_env({"worker_process_setup_hook": "mypkg.setup"})
