"""Accelerate with ``gradring.install()``, against Accelerate on torch's DDP, bit for bit.

Accelerate constructs ``torch.nn.parallel.DistributedDataParallel`` itself;
with gradring installed that name builds gradring's wrapper. Every scenario
runs the same script twice in the same two ranks (torch's DDP, then gradring
installed) and compares losses, gradient norms and parameters exactly.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import pytest

pytest.importorskip("accelerate", reason="accelerate is missing: pip install -e '.[integrations]'")

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


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 4))


def _loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(2)
    ds = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g),
                                        torch.randn(64, 4, generator=g) * 3)
    return torch.utils.data.DataLoader(ds, batch_size=4, shuffle=False)


def _fresh_state() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _handlers(case: str) -> list[Any]:
    from accelerate.utils import DDPCommunicationHookType as Hook
    from accelerate.utils import DistributedDataParallelKwargs

    if case == "plain":
        return []
    if case == "bucket_view":
        return [DistributedDataParallelKwargs(gradient_as_bucket_view=True, bucket_cap_mb=1)]
    if case == "fp16":
        return [DistributedDataParallelKwargs(comm_hook=Hook.FP16)]
    if case == "bf16":
        return [DistributedDataParallelKwargs(comm_hook=Hook.BF16)]
    if case in ("powersgd", "powersgd_fp16"):
        return [DistributedDataParallelKwargs(
            comm_hook=Hook.POWER_SGD, comm_wrapper=Hook.FP16 if case.endswith("16") else Hook.NO,
            comm_state_option={"matrix_approximation_rank": 1, "start_powerSGD_iter": 3,
                               "min_compression_rate": 1.0})]
    raise ValueError(case)


def _torch_bf16_under_another_name(state, bucket):  # noqa: ANN001, ANN202
    """torch's own bf16 hook. torch's DDP refuses it by name unless the backend is
    NCCL, so the torch side registers it under this name (without annotations,
    which torch also checks); gradring's DDP takes it as Accelerate passes it."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(state, bucket)


def _epoch(acc: Any, model: Any, opt: Any, loader: Any, out: dict[str, list[Any]]) -> None:
    for x, y in loader:
        with acc.accumulate(model):
            loss = F.mse_loss(model(x), y)
            acc.backward(loss)
            if acc.sync_gradients:
                out["norms"].append(acc.clip_grad_norm_(model.parameters(), 1.0).item())
            opt.step()
            opt.zero_grad()
        out["losses"].append(loss.item())


def _script(impl: str, case: str, ckpt: str) -> dict[str, Any]:
    """What a user's Accelerate script does; ``impl`` only decides install()."""
    from accelerate import Accelerator

    from gradring.install import install

    _fresh_state()
    switch = install() if impl == "gradring" else contextlib.nullcontext()
    with switch:
        by_hand = case == "bf16" and impl == "torch"
        acc = Accelerator(cpu=True, gradient_accumulation_steps=2,
                          kwargs_handlers=_handlers("plain" if by_hand else case))
        model = _model()
        model, opt, loader = acc.prepare(
            model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), _loader())
        if by_hand:
            model.register_comm_hook(None, _torch_bf16_under_another_name)
        rec: dict[str, Any] = {"losses": [], "norms": [], "wrapper": type(model).__module__,
                               "is_torch_ddp": isinstance(
                                   model, torch.nn.parallel.distributed.DistributedDataParallel)}
        _epoch(acc, model, opt, loader, rec)
        acc.save_state(ckpt)
        rec["saved"] = params_of(acc.unwrap_model(model))
        _epoch(acc, model, opt, loader, rec)
        rec["before_load"] = params_of(acc.unwrap_model(model))
        acc.load_state(ckpt)
        rec["loaded"] = params_of(acc.unwrap_model(model))
        _epoch(acc, model, opt, loader, rec)  # the same epoch again, from the checkpoint
        plain = acc.unwrap_model(model)
        rec["unwrapped_type"] = type(plain).__name__
        rec["params"] = params_of(plain)
        acc.wait_for_everyone()
    _fresh_state()
    return rec


#: Scenarios whose known gradring error is raised by every rank at the same point.
_SYMMETRIC_ERRORS = {"powersgd_fp16"}


def accelerate_case(rank: int, world: int, case: str, root: str) -> dict[str, Any]:
    launched_like_torchrun(rank, world)
    import gradring

    out: dict[str, Any] = {"torch": _script("torch", case, os.path.join(root, "torch"))}
    try:
        out["gradring"] = _script("gradring", case, os.path.join(root, "gradring"))
    except RuntimeError as exc:
        # Only where the error is known to come alike on every rank, inside the first
        # bucket's hook, before any collective: the test fails on it and the pool
        # lives on. Anywhere else the pool reports the error itself.
        if case not in _SYMMETRIC_ERRORS:
            raise
        _fresh_state()
        out["gradring"] = {"error": f"{type(exc).__name__}: {exc}"}
    if case in ("fp16", "bf16"):  # the hook must change something: compare to none
        out["no_hook"] = _script("torch", "plain", os.path.join(root, "plain"))
    out["uninstalled"] = all(
        home.DistributedDataParallel is not gradring.DistributedDataParallel
        for home in (torch.nn.parallel, torch.nn.parallel.distributed))
    out["segments_left"] = release()
    return out


#: torch's fp16 wrapper swaps the bucket's buffer for an fp16 copy, and PowerSGD
#: then reads ``bucket.gradients()``, which must be views of the *current* buffer.


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("case", ["plain", "bucket_view", "fp16", "bf16", "powersgd",
                                  "powersgd_fp16"])
def test_accelerate_matches_torch_ddp(integ_pool, tmp_path, case: str) -> None:
    results = integ_pool.run(accelerate_case, case, str(tmp_path))
    for rank, res in enumerate(results):
        assert res["segments_left"] == [] and res["uninstalled"]
        assert "error" not in res["gradring"], f"rank {rank}: {res['gradring'].get('error')}"
        assert res["torch"]["wrapper"] == "torch.nn.parallel.distributed"
        assert res["gradring"]["wrapper"] == "gradring.ddp"
        for impl in ("torch", "gradring"):
            r = res[impl]
            assert r["unwrapped_type"] == "Sequential"
            assert exactly_equal(r["loaded"], r["saved"]), (rank, impl)
            assert not exactly_equal(r["before_load"], r["saved"]), (rank, impl)
            # Epoch 3 repeats epoch 2 from the same state: the same losses (PowerSGD's
            # error feedback and random state are not in the checkpoint).
            n = len(r["losses"]) // 3
            if not case.startswith("powersgd"):
                assert r["losses"][n:2 * n] == r["losses"][2 * n:], (rank, impl)
        for key in ("losses", "norms", "saved", "params"):
            a, b = res["torch"][key], res["gradring"][key]
            assert exactly_equal(a, b), f"rank {rank}, {key}: {first_difference(a, b)}"
    assert exactly_equal(results[0]["gradring"]["params"], results[1]["gradring"]["params"])
    if "no_hook" in results[0]:
        assert not exactly_equal(results[0]["gradring"]["params"], results[0]["no_hook"]["params"])
    assert results[0]["gradring"]["losses"] != results[1]["gradring"]["losses"]
