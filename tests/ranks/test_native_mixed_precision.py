"""DDP's ``mixed_precision`` argument (torch's ``_MixedPrecision``), world 2.

torch's own DDP cannot be the oracle here: on CPU its forward raises "cpu
backend doesn't support events", and with events stubbed out its gradients
come out as garbage (values near 1e30: its C++ reducer and its upcast hook
disagree about the bucket's dtype on CPU). So the oracle is one process that
does what torch's semantics say ([Note: mixed precision] in
gradring/ddp/mixed_precision.py): every rank's forward and backward with the
parameters and inputs cast to ``param_dtype``, the gradients cast to the
reduce dtype, summed, divided by 2 in that dtype, cast up to float32, and an
SGD step in float32. At world 2 the sum of two values is rounded once
whatever the order, so parameters and gradients must match bit for bit.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch import nn
from torch.nn.parallel.distributed import _MixedPrecision

import gradring

pytestmark = pytest.mark.timeout(180)

STEPS = 3
WORLD = 2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(6, 40)
        self.fc2 = nn.Linear(40, 3)
        self.register_buffer("shift", torch.randn(3))
        # Takes part in the forward without a gradient: back to float32 after backward.
        self.frozen = nn.Parameter(torch.randn(3), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x))) + self.shift + self.frozen


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(5, 6, generator=torch.Generator().manual_seed(100 * step + rank))


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def _oracle(cfg: _MixedPrecision, steps: int, accumulate: int) -> list[dict]:
    """Per step, the float32 parameters and gradients torch's semantics give."""
    model = Net()
    if cfg.buffer_dtype is not None:
        model.shift.data = model.shift.to(cfg.buffer_dtype)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    reduce = cfg.reduce_dtype or cfg.param_dtype
    out = []
    for s in range(steps):
        local = []
        for r in range(WORLD):
            low = copy.deepcopy(model)
            for p in low.parameters():
                p.data = p.data.to(cfg.param_dtype)
            for a in range(accumulate):  # no_sync backwards, then the synchronised one
                _loss(low(_batch(s * 10 + a, r).to(cfg.param_dtype))).backward()
            local.append({n: p.grad for n, p in low.named_parameters() if p.grad is not None})
        for n, p in model.named_parameters():
            if p.requires_grad:
                total = local[0][n].to(reduce) + local[1][n].to(reduce)
                p.grad = total.div_(WORLD).to(p.dtype)
        out.append(_state(model))
        opt.step()
        opt.zero_grad()
    return out


def _state(m: nn.Module) -> dict:
    st = {f"param:{n}": p.detach().clone() for n, p in m.named_parameters()}
    st.update({f"grad:{n}": p.grad.clone() for n, p in m.named_parameters()
               if p.grad is not None})
    return st


CONFIGS = {
    "bf16": dict(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                 buffer_dtype=torch.bfloat16),
    "fp16": dict(param_dtype=torch.float16, reduce_dtype=torch.float16,
                 buffer_dtype=torch.float16),
    "bf16_reduce_fp32": dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    "fp16_reduce_default": dict(param_dtype=torch.float16),
}


def _train(rank: int, world: int, name: str, view: bool, set_to_none: bool,
           accumulate: int, extra: dict) -> list:
    cfg = _MixedPrecision(**CONFIGS[name])
    model = Net()
    ddp = gradring.DistributedDataParallel(model, mixed_precision=cfg,
                                           gradient_as_bucket_view=view, **extra)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    got, dtypes = [], set()
    for s in range(STEPS):
        with ddp.no_sync():
            for a in range(accumulate - 1):
                _loss(ddp(_batch(s * 10 + a, rank))).backward()
        _loss(ddp(_batch(s * 10 + accumulate - 1, rank))).backward()
        dtypes |= {(n, str(p.dtype), str(None if p.grad is None else p.grad.dtype))
                   for n, p in model.named_parameters()}
        got.append(_state(model))
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    want = _oracle(cfg, STEPS, accumulate)
    diffs = [(s, k) for s, (g, w) in enumerate(zip(got, want)) for k in sorted(set(g) | set(w))
             if k not in g or k not in w or g[k].dtype != w[k].dtype or not torch.equal(g[k], w[k])]
    return [diffs, sorted(dtypes), str(model.shift.dtype)]


@pytest.mark.filterwarnings("ignore:.*find_unused_parameters")
@pytest.mark.parametrize("name,view,set_to_none,accumulate,extra", [
    ("bf16", False, True, 1, {}),
    ("fp16", True, False, 1, {}),
    ("bf16_reduce_fp32", False, False, 1, {}),
    ("fp16_reduce_default", True, True, 1, {}),
    ("bf16", False, True, 2, {}),
    ("bf16", False, True, 1, {"static_graph": True}),
    ("fp16", False, False, 1, {"find_unused_parameters": True}),
])
def test_matches_torch_semantics_bit_for_bit(pools, name, view, set_to_none, accumulate,
                                             extra):
    for diffs, dtypes, buffer_dtype in pools.run(WORLD, _train, name, view, set_to_none,
                                                 accumulate, extra):
        assert diffs == [], diffs
        # What the user sees after a synchronised backward: float32 parameters and grads.
        assert {d for _, d, _ in dtypes} == {"torch.float32"}, dtypes
        assert {g for n, _, g in dtypes if n != "frozen"} == {"torch.float32"}, dtypes
        want = CONFIGS[name].get("buffer_dtype") or torch.float32
        assert buffer_dtype == str(want)


def _inside_forward(rank: int, world: int) -> dict:
    """What the module sees during forward, what no_sync leaves, ignored params."""
    seen = {}
    cfg = _MixedPrecision(**CONFIGS["fp16"])

    class Probe(Net):
        def forward(self, x):
            seen["param"] = str(self.fc1.weight.dtype)
            seen["input"] = str(x.dtype)
            seen["buffer"] = str(self.shift.dtype)
            return super().forward(x)

    model = Probe()
    ddp = gradring.DistributedDataParallel(model, mixed_precision=cfg)
    out = {"attrs": sorted({(str(p._mp_param.dtype), str(p._fp_param.dtype),
                             p._mp_param.untyped_storage().size())
                            for p in model.parameters()})}
    with ddp.no_sync():
        _loss(ddp(_batch(0, rank))).backward()
    out["forward"] = dict(seen)
    out["after_no_sync"] = str(model.fc1.weight.dtype), str(model.fc1.weight.grad.dtype)
    _loss(ddp(_batch(1, rank))).backward()
    out["after_sync"] = str(model.fc1.weight.dtype), str(model.fc1.weight.grad.dtype)
    try:
        ddp.register_comm_hook(None, lambda s, b: None)
        out["second_hook"] = "no error"
    except RuntimeError as e:
        out["second_hook"] = str(e)

    ignored = Net()
    ignore = ["fc1.weight", "shift"]
    gradring.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(ignored, ignore)
    ddp2 = gradring.DistributedDataParallel(ignored, mixed_precision=cfg,
                                            gradient_as_bucket_view=True)
    marks = {}
    for n, p in itertools.chain(ddp2.named_parameters(), ddp2.named_buffers()):
        marks[n] = (hasattr(p, "_mp_param"), hasattr(p, "_fp_param"), str(p.dtype))
    out["ignored"] = marks
    return out


def test_forward_dtypes_no_sync_and_ignored(pools):
    for r in pools.run(WORLD, _inside_forward):
        assert r["attrs"] == [("torch.float16", "torch.float32", 0)], r
        assert r["forward"] == {"param": "torch.float16", "input": "torch.float16",
                                "buffer": "torch.float16"}, r
        # As in torch: nothing reduced, nothing cast back.
        assert r["after_no_sync"] == ("torch.float16", "torch.float16"), r
        assert r["after_sync"] == ("torch.float32", "torch.float32"), r
        assert "once" in r["second_hook"] or "already" in r["second_hook"] \
            or "hook" in r["second_hook"], r
        ign = r["ignored"]
        assert ign["module.fc1.weight"] == (False, False, "torch.float32"), ign
        assert ign["module.shift"] == (False, False, "torch.float32"), ign
        assert ign["module.fc1.bias"][:2] == (True, True), ign
        assert ign["module.fc2.weight"][:2] == (True, True), ign
