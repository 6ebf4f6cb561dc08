"""Models, data and oracles shared by the DDP tests (run inside pooled ranks).

Two oracles:
- one process on the concatenated global batch (exact data parallelism);
- torch's own DistributedDataParallel on the same seeds and batches.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import gradring


class MultiOut(nn.Module):
    """Returns a dict holding a tuple: outputs of any structure must pass through."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(8, 16)
        self.head_a = nn.Linear(16, 4)
        self.head_b = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        h = torch.relu(self.trunk(x))
        return {"pair": (self.head_a(h), self.head_b(h)), "aux": [h.mean()]}


class TinyTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 32)
        self.enc = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True), 2,
            enable_nested_tensor=False)
        self.out = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.enc(self.embed(x)).mean(dim=1))


def make_model(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                             nn.Linear(32, 4))
    if kind == "wide":  # buckets over the one-shot limit: the two-shot path
        return nn.Sequential(nn.Linear(8, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                             nn.Linear(256, 4))
    if kind == "cnn_bn":
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                             nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))
    if kind == "transformer":
        return TinyTransformer()
    if kind == "multi":
        return MultiOut()
    raise ValueError(kind)


def make_batch(kind: str, step: int, rank: int, world_size: int, per_rank: int = 4,
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the global batch of ``step`` (same on every rank's view)."""
    xs, ys = global_batch(kind, step, world_size, per_rank)
    sl = slice(rank * per_rank, (rank + 1) * per_rank)
    return xs[sl], ys[sl]


def global_batch(kind: str, step: int, world_size: int, per_rank: int = 4,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    n = per_rank * world_size
    if kind == "cnn_bn":
        return torch.randn(n, 3, 6, 6, generator=g), torch.randint(0, 5, (n,), generator=g)
    if kind == "transformer":
        return torch.randn(n, 5, 8, generator=g), torch.randint(0, 3, (n,), generator=g)
    return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def loss_of(kind: str, out: Any, y: torch.Tensor) -> torch.Tensor:
    if kind == "multi":
        a, b = out["pair"]
        return nn.functional.cross_entropy(a, y) + b.pow(2).mean() + out["aux"][0] * 0.1
    return nn.functional.cross_entropy(out, y)


def grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def max_diff(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> float:
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        if (x is None) != (y is None):
            return float("inf")
        if x is not None:
            worst = max(worst, (x - y).abs().max().item())
    return worst


def train_compare(rank: int, world_size: int, kind: str, ddp_kwargs: dict[str, Any],
                  *, steps: int = 4, accumulate: int = 1, against_torch: bool = True,
                  against_single: bool = True, dtype: torch.dtype = torch.float64,
                  ) -> dict[str, float]:
    """Train gradring DDP, torch DDP and a single global-batch process side by side.

    With ``accumulate`` > 1, every step runs ``accumulate - 1`` micro-batches under
    ``no_sync()`` and one synced micro-batch. Returns the worst gradient and
    parameter differences seen.
    """
    base = make_model(kind).to(dtype)
    ours = gradring.DistributedDataParallel(copy.deepcopy(base), **ddp_kwargs)
    theirs = None
    if against_torch:
        # torch has no bucket_cap_mb="auto": its default cap is the oracle there
        tkw = {k: v for k, v in ddp_kwargs.items()
               if k != "bucket_cap_mb" or isinstance(v, (int, float))}
        theirs = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), **tkw)
    single = copy.deepcopy(base)
    models = {"ours": ours, "torch": theirs, "single": single if against_single else None}
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
            for k, m in models.items() if m is not None}
    worst = {"grad_torch": 0.0, "grad_single": 0.0, "param_torch": 0.0, "param_single": 0.0}
    for step in range(steps):
        for opt in opts.values():
            opt.zero_grad(set_to_none=True)
        for micro in range(accumulate):
            key = step * accumulate + micro
            x, y = make_batch(kind, key, rank, world_size)
            x = x.to(dtype)
            last = micro == accumulate - 1
            for name in ("ours", "torch"):
                m = models[name]
                if m is None:
                    continue
                ctx = m.no_sync() if not last else _null()
                with ctx:
                    loss_of(kind, m(x), y).div(accumulate).backward()
            if models["single"] is not None:
                gx, gy = global_batch(kind, key, world_size)
                loss_of(kind, single(gx.to(dtype)), gy).div(accumulate).backward()
        g_ours = grads(ours.module)
        if theirs is not None:
            worst["grad_torch"] = max(worst["grad_torch"], max_diff(g_ours, grads(theirs.module)))
        if models["single"] is not None:
            worst["grad_single"] = max(worst["grad_single"], max_diff(g_ours, grads(single)))
        for opt in opts.values():
            opt.step()
        p_ours = [p.detach().clone() for p in ours.module.parameters()]
        if theirs is not None:
            worst["param_torch"] = max(worst["param_torch"], max_diff(
                p_ours, [p.detach() for p in theirs.module.parameters()]))
        if models["single"] is not None:
            worst["param_single"] = max(worst["param_single"], max_diff(
                p_ours, [p.detach() for p in single.parameters()]))
    dist.barrier()
    return worst


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None
