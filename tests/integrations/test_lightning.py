"""PyTorch Lightning: gradring's strategy against Lightning's own ``ddp``, bit for bit.

Every scenario trains the same LightningModule twice in the same two ranks,
once with Lightning's strategy (torch's DDP) and once with gradring's, and the
test compares the per-step losses and final parameters of every rank exactly.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

pytest.importorskip("lightning", reason="lightning is missing: pip install -e '.[integrations]'")

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

TIMEOUT = 240

# ---------------------------------------------------------------- rank side


def _module_class() -> type:
    import lightning.pytorch as pl

    class Net(pl.LightningModule):
        """A small MLP; optionally manual optimization, an unused layer, accumulation."""

        def __init__(self, manual: bool = False, unused: bool = False, accumulate: int = 1,
                     block_sync: bool = False) -> None:
            super().__init__()
            self.save_hyperparameters()
            torch.manual_seed(0)
            self.body = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                                      nn.Linear(32, 4))
            self.spare = nn.Linear(4, 4) if unused else None
            self.automatic_optimization = not manual
            self.losses: list[float] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(x)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            loss = F.mse_loss(self(x), y)
            self.losses.append(loss.item())
            if self.automatic_optimization:
                return loss
            opt = self.optimizers()
            k = self.hparams.accumulate
            stepping = (batch_idx + 1) % k == 0
            if self.hparams.block_sync and not stepping:
                with self.trainer.strategy.block_backward_sync():
                    self.manual_backward(loss / k)
            else:
                self.manual_backward(loss / k)
            if stepping:
                opt.step()
                opt.zero_grad()
            return None

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    return Net


def _loader() -> Any:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g)
    y = torch.randn(64, 4, generator=g)
    ds = torch.utils.data.TensorDataset(x, y)
    return torch.utils.data.DataLoader(ds, batch_size=4, shuffle=False)


def _torch_strategy_on_cpu_hooks(**kwargs: Any) -> Any:
    """Lightning's DDPStrategy, with its comm hook registered on CPU as well.

    Lightning registers hooks only on CUDA; to compare a hook, the torch-DDP
    side must run it too, so this oracle calls Lightning's own registration
    function without the device check.
    """
    from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook
    from lightning.pytorch.strategies import DDPStrategy

    class TorchHooksOnCPU(DDPStrategy):
        def _register_ddp_hooks(self) -> None:
            _register_ddp_comm_hook(model=self.model, ddp_comm_state=self._ddp_comm_state,
                                    ddp_comm_hook=self._ddp_comm_hook,
                                    ddp_comm_wrapper=self._ddp_comm_wrapper)

    return TorchHooksOnCPU(**kwargs)


def _strategy(impl: str, spec: Any) -> Any:
    """``spec`` is a registry name (without its "ddp"/"gradring" stem) or strategy kwargs."""
    if isinstance(spec, str):
        if impl == "torch":
            return "ddp" + spec
        import gradring.lightning  # noqa: F401 - registers the "gradring*" names

        return "gradring" + spec
    if impl == "torch":
        if "ddp_comm_hook" in spec:
            return _torch_strategy_on_cpu_hooks(**spec)
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(**spec)
    from gradring.lightning import DDPStrategy

    return DDPStrategy(**spec)


def _trainer(strategy: Any, root: str, **kwargs: Any) -> Any:
    import lightning.pytorch as pl

    return pl.Trainer(accelerator="cpu", devices=2, num_nodes=1, strategy=strategy,
                      max_epochs=kwargs.pop("max_epochs", 2), logger=False,
                      enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=root, **kwargs)


def _gradring_bf16_under_another_name(state, bucket):  # noqa: ANN001, ANN202
    """gradring's bf16 hook for torch's DDP, which refuses any hook *named*
    ``bf16_compress_hook`` unless the backend is NCCL (and any annotation of
    ``bucket`` other than the GradBucket class itself)."""
    import gradring.hooks

    return gradring.hooks.bf16_compress_hook(state, bucket)


def _hook_spec(impl: str, name: str) -> dict[str, Any]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    import gradring.hooks

    if name == "allreduce":
        return {"ddp_comm_hook": default_hooks.allreduce_hook}
    if name == "fp16":
        return {"ddp_comm_hook": default_hooks.fp16_compress_hook}
    if name == "bf16":  # torch's bf16 hook cannot all-reduce on gloo; gradring's can
        return {"ddp_comm_hook": gradring.hooks.bf16_compress_hook if impl == "gradring"
                else _gradring_bf16_under_another_name}
    if name in ("powersgd", "powersgd_fp16"):
        spec = {"ddp_comm_hook": powerSGD_hook.powerSGD_hook,
                "ddp_comm_state": powerSGD_hook.PowerSGDState(
                    process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=3,
                    min_compression_rate=1.0)}
        if name.endswith("fp16"):
            spec["ddp_comm_wrapper"] = default_hooks.fp16_compress_wrapper
        return spec
    raise ValueError(name)


def _fit(impl: str, spec: Any, root: str, model_kw: dict[str, Any],
         trainer_kw: dict[str, Any]) -> dict[str, Any]:
    Net = _module_class()
    lm = Net(**model_kw)
    trainer = _trainer(_strategy(impl, spec), root, **trainer_kw)
    trainer.fit(lm, train_dataloaders=_loader())
    strategy = trainer.strategy
    out = {"losses": list(lm.losses), "params": params_of(lm),
           "strategy": type(strategy).__module__, "unwrapped": strategy.model is lm}
    state = getattr(strategy, "_ddp_comm_state", None)
    if state is not None and hasattr(state, "iter"):
        out["hook_iter"] = state.iter
    return out


#: Scenarios whose known gradring error is raised by every rank at the same point.
_SYMMETRIC_ERRORS = {"hook_powersgd_fp16"}


def lightning_case(rank: int, world: int, case: str, root: str) -> dict[str, Any]:
    """Run one scenario with both strategies; both results come back."""
    launched_like_torchrun(rank, world)
    model_kw: dict[str, Any] = {}
    trainer_kw: dict[str, Any] = {}
    spec: Any = {}
    if case == "auto_accumulate":
        spec, trainer_kw = "", {"accumulate_grad_batches": 2}
    elif case == "manual":
        model_kw = {"manual": True}
    elif case == "manual_accumulate":
        model_kw = {"manual": True, "accumulate": 2}
    elif case == "manual_accumulate_no_sync":
        model_kw = {"manual": True, "accumulate": 2, "block_sync": True}
    elif case == "static_graph":
        spec = {"static_graph": True}
    elif case == "manual_static_graph":
        spec, model_kw = {"static_graph": True}, {"manual": True}
    elif case == "find_unused":
        spec, model_kw = "_find_unused_parameters_true", {"unused": True}
    elif case.startswith("hook_"):
        spec = None
    else:
        raise ValueError(case)
    results = {}
    for impl in ("torch", "gradring"):
        if case.startswith("hook_"):
            spec = _hook_spec(impl, case[len("hook_"):])
        try:
            results[impl] = _fit(impl, spec, os.path.join(root, impl), model_kw, trainer_kw)
        except RuntimeError as exc:
            # Only where the error is known to come alike on every rank, inside the
            # first bucket's hook, before any collective: the test fails on it and the
            # pool lives on. Anywhere else the pool reports the error itself.
            if impl == "torch" or case not in _SYMMETRIC_ERRORS:
                raise
            results[impl] = {"error": f"{type(exc).__name__}: {exc}"}
    if case in ("hook_fp16", "hook_bf16"):  # the hook must change something: compare to none
        results["no_hook"] = _fit("torch", {}, os.path.join(root, "plain"), model_kw, trainer_kw)
    results["segments_left"] = release()
    return results


def lightning_lifecycle(rank: int, world: int, root: str) -> dict[str, Any]:
    """save_checkpoint, load_from_checkpoint, a second fit of the same module, teardown."""
    launched_like_torchrun(rank, world)
    Net = _module_class()
    out: dict[str, Any] = {}
    for impl in ("torch", "gradring"):
        lm = Net()
        first = _trainer(_strategy(impl, {}), os.path.join(root, impl), max_epochs=1)
        first.fit(lm, train_dataloaders=_loader())
        path = os.path.join(root, f"{impl}.ckpt")
        first.save_checkpoint(path)
        after_first = params_of(lm)
        loaded = Net.load_from_checkpoint(path)
        second = _trainer(_strategy(impl, {}), os.path.join(root, impl), max_epochs=1)
        second.fit(lm, train_dataloaders=_loader())
        # After teardown the module is plain: a backward is local to this rank.
        torch.manual_seed(100 + rank)
        x, y = torch.randn(4, 8), torch.randn(4, 4)
        lm.zero_grad()
        F.mse_loss(lm(x), y).backward()
        local = Net()
        local.load_state_dict(lm.state_dict())
        F.mse_loss(local(x), y).backward()
        out[impl] = {
            "losses": list(lm.losses), "after_first": after_first, "params": params_of(lm),
            "loaded_matches": exactly_equal(params_of(loaded), after_first),
            "unwrapped": [first.strategy.model is lm, second.strategy.model is lm],
            "local_backward": all(torch.equal(a.grad, b.grad) for a, b in
                                  zip(lm.parameters(), local.parameters())),
            "hooks_left": sum(len(p._post_accumulate_grad_hooks or {}) for p in lm.parameters()),
        }
    out["segments_left"] = release()
    return out


def _fabric(impl: str, precision: str) -> Any:
    from lightning.fabric import Fabric

    import gradring.lightning  # noqa: F401 - registers strategy="gradring" for Fabric too

    fabric = Fabric(accelerator="cpu", devices=2, num_nodes=1, precision=precision,
                    strategy="ddp" if impl == "torch" else "gradring")
    fabric.launch()
    return fabric


def _fabric_model(fabric: Any) -> tuple[Any, Any]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    return fabric.setup(net, opt)


def _fabric_epochs(fabric: Any, model: Any, opt: Any, epochs: int, accumulate: int
                   ) -> list[float]:
    """Plain Fabric loop; the accumulating backwards run under ``no_backward_sync``."""
    loader = fabric.setup_dataloaders(_loader())
    losses = []
    for _ in range(epochs):
        for i, (x, y) in enumerate(loader):
            stepping = (i + 1) % accumulate == 0
            with fabric.no_backward_sync(model, enabled=not stepping):
                loss = F.mse_loss(model(x), y)
                fabric.backward(loss / accumulate)
            if stepping:
                opt.step()
                opt.zero_grad()
            losses.append(loss.item())
    return losses


def fabric_case(rank: int, world: int, case: str, root: str) -> dict[str, Any]:
    """Fabric with ``strategy="ddp"`` and with ``strategy="gradring"``; both results come back."""
    launched_like_torchrun(rank, world)
    results: dict[str, Any] = {}
    for impl in ("torch", "gradring"):
        fabric = _fabric(impl, "bf16-mixed" if case == "bf16" else "32-true")
        model, opt = _fabric_model(fabric)
        out: dict[str, Any] = {"wrapper": type(model._forward_module).__module__}
        out["losses"] = _fabric_epochs(fabric, model, opt, 2, 2 if case == "accumulate" else 1)
        if case == "save_load":
            path = os.path.join(root, f"{impl}.ckpt")
            fabric.save(path, {"model": model, "optimizer": opt, "tag": impl})
            fabric.barrier()
            saved = params_of(model.module)
            model2, opt2 = _fabric_model(fabric)
            state = {"model": model2, "optimizer": opt2}
            rest = fabric.load(path, state)
            out["loaded_matches"] = exactly_equal(params_of(model2.module), saved)
            out["rest"] = rest
            out["losses"] += _fabric_epochs(fabric, model2, opt2, 1, 1)
            model = model2
        out["params"] = params_of(model.module)
        results[impl] = out
    results["segments_left"] = release()
    return results


# ---------------------------------------------------------------- test side


def _assert_same(results: list[dict[str, Any]], keys: tuple[str, ...] = ("losses", "params")
                 ) -> None:
    for rank, res in enumerate(results):
        assert res["segments_left"] == [], res["segments_left"]
        assert "error" not in res["gradring"], f"rank {rank}: {res['gradring'].get('error')}"
        assert res["gradring"]["strategy"] == "gradring.lightning"
        for key in keys:
            a, b = res["torch"][key], res["gradring"][key]
            assert exactly_equal(a, b), f"rank {rank}, {key}: {first_difference(a, b)}"
        assert res["gradring"]["unwrapped"] and res["torch"]["unwrapped"]
    for key in ("params",):  # replicas stay identical
        assert exactly_equal(results[0]["gradring"][key], results[1]["gradring"][key])


CASES = ["auto_accumulate", "manual", "manual_accumulate", "manual_accumulate_no_sync",
         "static_graph", "manual_static_graph", "find_unused"]


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("case", CASES)
def test_lightning_matches_ddp(integ_pool, tmp_path, case: str) -> None:
    results = integ_pool.run(lightning_case, case, str(tmp_path))
    _assert_same(results)
    # Each rank saw its own data: the losses differ between ranks.
    assert results[0]["gradring"]["losses"] != results[1]["gradring"]["losses"]


#: torch's fp16 wrapper swaps the bucket's buffer for an fp16 copy, and PowerSGD
#: then reads ``bucket.gradients()``, which must be views of the *current* buffer.


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("hook", ["allreduce", "fp16", "bf16", "powersgd",
                                  "powersgd_fp16"])
def test_lightning_comm_hooks_on_cpu(integ_pool, tmp_path, hook: str) -> None:
    results = integ_pool.run(lightning_case, f"hook_{hook}", str(tmp_path))
    _assert_same(results)
    if hook in ("fp16", "bf16"):
        assert not exactly_equal(results[0]["gradring"]["params"], results[0]["no_hook"]["params"])
    if hook.startswith("powersgd"):
        steps = len(results[0]["gradring"]["losses"])
        assert results[0]["gradring"]["hook_iter"] == results[0]["torch"]["hook_iter"] == steps


@pytest.mark.timeout(TIMEOUT)
def test_lightning_checkpoint_second_fit_teardown(integ_pool, tmp_path) -> None:
    results = integ_pool.run(lightning_lifecycle, str(tmp_path))
    for rank, res in enumerate(results):
        assert res["segments_left"] == []
        for impl in ("torch", "gradring"):
            r = res[impl]
            assert r["loaded_matches"], (rank, impl)
            assert r["unwrapped"] == [True, True], (rank, impl)
            assert r["local_backward"], (rank, impl)
            assert r["hooks_left"] == 0, (rank, impl)
        for key in ("losses", "after_first", "params"):
            a, b = res["torch"][key], res["gradring"][key]
            assert exactly_equal(a, b), f"rank {rank}, {key}: {first_difference(a, b)}"


def test_registry_and_subclass() -> None:
    from lightning.pytorch.strategies import DDPStrategy as LightningDDP
    from lightning.pytorch.strategies import StrategyRegistry

    import gradring.lightning

    assert issubclass(gradring.lightning.DDPStrategy, LightningDDP)
    assert "gradring" in StrategyRegistry
    assert StrategyRegistry["gradring"]["strategy"] is gradring.lightning.DDPStrategy
    fup = StrategyRegistry["gradring_find_unused_parameters_true"]
    assert fup["init_params"] == {"find_unused_parameters": True}
    s = gradring.lightning.DDPStrategy(static_graph=True, bucket_cap_mb=5, timeout=None)
    assert s._ddp_kwargs == {"static_graph": True, "bucket_cap_mb": 5}


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("case", ["accumulate", "save_load", "bf16"])
def test_fabric_matches_ddp(integ_pool, tmp_path, case: str) -> None:
    results = integ_pool.run(fabric_case, case, str(tmp_path))
    for rank, res in enumerate(results):
        assert res["segments_left"] == [], res["segments_left"]
        assert res["torch"]["wrapper"] == "torch.nn.parallel.distributed"
        assert res["gradring"]["wrapper"] == "gradring.ddp"
        for key in ("losses", "params"):
            a, b = res["torch"][key], res["gradring"][key]
            assert exactly_equal(a, b), f"rank {rank}, {key}: {first_difference(a, b)}"
        if case == "save_load":
            assert res["gradring"]["loaded_matches"] and res["torch"]["loaded_matches"]
            assert res["gradring"]["rest"] == {"tag": "gradring"}
    assert results[0]["gradring"]["losses"] != results[1]["gradring"]["losses"]
    assert exactly_equal(results[0]["gradring"]["params"], results[1]["gradring"]["params"])


def test_fabric_registry_and_subclass() -> None:
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.fabric.strategies import DDPStrategy as FabricDDP

    import gradring.lightning

    assert issubclass(gradring.lightning.FabricDDPStrategy, FabricDDP)
    assert STRATEGY_REGISTRY["gradring"]["strategy"] is gradring.lightning.FabricDDPStrategy
    fup = STRATEGY_REGISTRY["gradring_find_unused_parameters_true"]
    assert fup["init_params"] == {"find_unused_parameters": True}
    # Fabric accepts both forms (it refused the Trainer's class and the name before).
    for strategy in ("gradring", gradring.lightning.FabricDDPStrategy(static_graph=True)):
        fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
        assert isinstance(fabric.strategy, gradring.lightning.FabricDDPStrategy)
