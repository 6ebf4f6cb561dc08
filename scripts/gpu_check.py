#!/usr/bin/env python3
"""Check gradring's CUDA path end to end against torch's own DDP, on one GPU.

    PYTHONPATH=. python scripts/gpu_check.py                 # the GPU run (about 5 minutes)
    PYTHONPATH=. python scripts/gpu_check.py --cpu --quick   # what runs without a GPU
    PYTHONPATH=. python scripts/gpu_check.py --list          # the checks and what each does
    PYTHONPATH=. python scripts/gpu_check.py --only 'w2/*'   # a selection (shell patterns)

One line per check, ``PASS``, ``FAIL`` or ``SKIP`` with the reason, then a
``SUMMARY`` line last; the exit status is 0 only if nothing failed. Without a
GPU (or with ``--cpu``) the plain command runs every check that can run on
CPU tensors, at the ``small`` sizes with inductor, prints ``SKIP`` for the
CUDA-only ones and a ``GPU half skipped`` line before the summary, and exits
0 when those CPU checks pass: ``.ci/run`` runs it so. Every
comparison runs torch's DDP and gradring's on identically seeded copies of one
model with the same batches, interleaved step by step in the same processes,
and compares gradients and parameters with ``torch.equal`` (bit for bit)
unless the check says otherwise.

The checks run in three jobs of fresh processes (torch.multiprocessing, spawn;
rendezvous through a FileStore in a temporary folder):

- ``w1``: world 1 over NCCL (gloo on CPU tensors without a GPU): a GPT-2-small
  sized model (12 layers, width 768, vocab 50257, tied head) under bf16
  autocast, 10 steps: ``gradient_as_bucket_view`` False and True,
  ``find_unused_parameters`` with an unused head, ``static_graph``, ``no_sync``
  accumulation; a user's side stream (CUDA); the cost table (CUDA).
- ``w2``: world 2 over gloo, both ranks on the same GPU (NCCL refuses two ranks
  on one device; gloo reduces CUDA tensors), or on CPU tensors: the same, plus
  torch's fp16 and bf16 compression hooks, a SyncBatchNorm model and Join with
  uneven inputs.
- ``compile``: torch.compile (inductor) around gradring's DDP at world 1:
  gradients against torch's eager DDP, no recompiles after warm-up, one graph
  piece per gradring bucket.

Each job starts with a control: torch's DDP against a second torch DDP. If
that fails, the device is not reproducible (a nondeterministic kernel), and
the bit-for-bit failures after it say nothing about gradring.

The script imports only the standard library, torch and gradring (from the
working tree: run it with ``PYTHONPATH=.``, or from anywhere in the checkout).
``--inject-fault CHECK`` nudges one element of gradring's side in every
comparison of CHECK by one ulp; it exists to show that a difference is
reported as FAIL (tests/jobs/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import fnmatch
import gc
import math
import os
import queue
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


def _import_gradring() -> Any:
    """gradring, from PYTHONPATH or else from the checkout this script lives in."""
    try:
        import gradring
    except ImportError:
        sys.path.insert(0, _ROOT)
        import gradring
    return gradring


# ---------------------------------------------------------------- sizes and checks


@dataclasses.dataclass(frozen=True)
class Size:
    """The models and step counts of one run."""

    name: str
    layers: int  # GPT blocks of the w1 model
    w2_layers: int  # GPT blocks of the w2 model
    width: int
    heads: int
    vocab: int
    seq: int
    batch: int  # sequences per rank per micro-batch
    steps: int
    bucket_cap_mb: float | None  # None: DDP's default caps
    compile_layers: int
    compile_vocab: int
    compile_steps: int
    bn_channels: int
    bn_image: int
    cost_warmup: int
    cost_steps: int


SIZES = {
    # GPT-2 small: 12 x 768, 12 heads, vocab 50257 (tied head), 124M parameters.
    "gpt2": Size("gpt2", layers=12, w2_layers=12, width=768, heads=12, vocab=50257, seq=128,
                 batch=8, steps=10, bucket_cap_mb=None, compile_layers=2, compile_vocab=8192,
                 compile_steps=6, bn_channels=32, bn_image=16, cost_warmup=5, cost_steps=30),
    "small": Size("small", layers=2, w2_layers=2, width=128, heads=4, vocab=512, seq=32,
                  batch=4, steps=10, bucket_cap_mb=0.25, compile_layers=2, compile_vocab=512,
                  compile_steps=5, bn_channels=8, bn_image=8, cost_warmup=3, cost_steps=10),
    "tiny": Size("tiny", layers=2, w2_layers=2, width=32, heads=2, vocab=64, seq=8,
                 batch=2, steps=5, bucket_cap_mb=0.01, compile_layers=1, compile_vocab=64,
                 compile_steps=4, bn_channels=4, bn_image=6, cost_warmup=2, cost_steps=5),
}


@dataclasses.dataclass(frozen=True)
class Check:
    name: str  # "<job>/<kind>"
    what: str
    cuda_only: bool = False

    @property
    def job(self) -> str:
        return self.name.split("/", 1)[0]

    @property
    def kind(self) -> str:
        return self.name.split("/", 1)[1]


_PAIR_KINDS = [
    ("control", "torch's DDP against a second torch DDP: the device reproduces itself"),
    ("plain", "gradient_as_bucket_view=False"),
    ("bucket_view", "gradient_as_bucket_view=True"),
    ("find_unused", "find_unused_parameters=True with a head the forward never uses"),
    ("static_graph", "static_graph=True"),
    ("no_sync", "two micro-batches per step, the first under no_sync()"),
]
_STREAMS = ("streams", "forward, backward and optimizer step under a side stream "
            "(torch.cuda.stream), no user synchronisation")

CHECKS: list[Check] = (
    [Check(f"w1/{k}", w) for k, w in _PAIR_KINDS]
    + [Check("w1/streams", _STREAMS[1], cuda_only=True),
       Check("w1/cost", "step time (CUDA events) and peak max_memory_allocated: no DDP, "
             "torch's DDP, gradring's", cuda_only=True)]
    + [Check(f"w2/{k}", w) for k, w in _PAIR_KINDS]
    + [Check("w2/fp16_hook", "torch's default_hooks.fp16_compress_hook on both"),
       Check("w2/bf16_hook", "torch's default_hooks.bf16_compress_hook on both"),
       Check("w2/sync_batchnorm", "convert_sync_batchnorm: gradring.SyncBatchNorm against one "
             "process on the global batch (and torch's SyncBatchNorm on CUDA)"),
       Check("w2/join", "Join with uneven inputs (one rank runs 3 steps fewer)"),
       Check("w2/streams", _STREAMS[1], cuda_only=True)]
    + [Check("compile/graphs", "torch.compile(DDP(model)): gradients against torch's eager DDP, "
             "no recompiles after warm-up, one graph piece per gradring bucket")]
)


# ---------------------------------------------------------------- comparisons


def compare_exact(what: str, names: Sequence[str], ours: Sequence[torch.Tensor | None],
                  theirs: Sequence[torch.Tensor | None]) -> str | None:
    """None when every pair is bit-equal (``torch.equal``; both None counts as
    equal); otherwise what differs, naming the first tensor."""
    return _compare(what, names, ours, theirs, None)


def compare_close(what: str, names: Sequence[str], ours: Sequence[torch.Tensor | None],
                  theirs: Sequence[torch.Tensor | None], rtol: float, atol: float) -> str | None:
    """None when every pair has ``max|a - b| <= atol + rtol * max|b|`` (per
    tensor); otherwise what differs, naming the first tensor."""
    return _compare(what, names, ours, theirs, (rtol, atol))


def _compare(what: str, names: Sequence[str], ours: Sequence[torch.Tensor | None],
             theirs: Sequence[torch.Tensor | None],
             tol: tuple[float, float] | None) -> str | None:
    if not (len(names) == len(ours) == len(theirs)):
        return f"{what}: {len(ours)} tensors against {len(theirs)} ({len(names)} names)"
    bad = []
    for name, a, b in zip(names, ours, theirs):
        if a is None or b is None:
            if (a is None) != (b is None):
                bad.append(f"{name} is {_kind(a)} against {_kind(b)}")
            continue
        if a.shape != b.shape or a.dtype != b.dtype:
            bad.append(f"{name} is {a.dtype} {tuple(a.shape)} against {b.dtype} {tuple(b.shape)}")
            continue
        if tol is None:
            if torch.equal(a, b):
                continue
        elif a.numel() == 0:
            continue
        diff = (a.double() - b.double()).abs()
        worst = diff.max().item()
        if tol is not None:
            bound = tol[1] + tol[0] * b.double().abs().max().item()
            if worst <= bound:  # NaN fails here too
                continue
            bad.append(f"{name}: max abs diff {worst:.3g} over the bound {bound:.3g}")
        else:
            n = int((a != b).sum().item())
            bad.append(f"{name}: {n} of {a.numel()} elements differ, max abs diff {worst:.3g}")
    if not bad:
        return None
    return f"{what}: {len(bad)} of {len(ours)} tensors differ; first {bad[0]}"


def _kind(t: torch.Tensor | None) -> str:
    return "None" if t is None else "a tensor"


def split_problem(piece_buckets: Sequence[Sequence[int]], nbuckets: int) -> str | None:
    """None when compiled pieces are split at the buckets, else why not.

    ``piece_buckets`` lists, per piece in forward order, the buckets whose
    parameters it uses (``gradring.compile.Split.piece_buckets``). Backward
    runs the last piece first, so a bucket completes in the first piece
    that uses it. Split at the buckets means: every bucket is in a piece;
    every piece completes a bucket (a cut anywhere else adds a graph and
    launches nothing earlier); and in backward order the buckets complete in
    index order (buckets launch in index order, so one completed before a
    lower one waits for it, and the cut that completed it gains nothing).
    """
    first_use: dict[int, int] = {}
    for i, buckets in enumerate(piece_buckets):
        for b in buckets:
            first_use.setdefault(b, i)
    missing = sorted(set(range(nbuckets)) - set(first_use))
    if missing:
        return f"buckets {missing} are in no piece: {list(map(list, piece_buckets))}"
    completes = [sorted(b for b in set(buckets) if first_use[b] == i)
                 for i, buckets in enumerate(piece_buckets)]
    for i, done in enumerate(completes):
        if not done:
            return (f"piece {i} (forward order) completes no bucket, so its cut launches "
                    f"nothing earlier: pieces use buckets {list(map(list, piece_buckets))}")
    in_backward = [(b, i) for i in reversed(range(len(completes))) for b in completes[i]]
    for (b, i), (later, j) in zip(in_backward, in_backward[1:]):
        if later < b:
            return (f"bucket {b} completes in piece {i} (forward order), before bucket {later} "
                    f"in piece {j}: buckets launch in index order, so bucket {b} waits for "
                    f"bucket {later} and the cut between the pieces launches nothing earlier "
                    f"(pieces use buckets {list(map(list, piece_buckets))})")
    return None


def max_rel_diff(ours: Sequence[torch.Tensor | None],
                 theirs: Sequence[torch.Tensor | None]) -> float:
    """The largest ``max|a - b| / max|b|`` over the pairs (0 where both are None)."""
    worst = 0.0
    for a, b in zip(ours, theirs):
        if a is None or b is None or a.numel() == 0:
            continue
        scale = b.double().abs().max().item() or 1.0
        worst = max(worst, (a.double() - b.double()).abs().max().item() / scale)
    return worst


def nudge_first(tensors: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """A copy of ``tensors`` whose first floating element is one ulp higher
    (``--inject-fault``: a difference the comparisons must report)."""
    out = list(tensors)
    for i, t in enumerate(out):
        if t is not None and t.is_floating_point() and t.numel():
            t = t.detach().clone()
            flat = t.view(-1)
            flat[:1] = torch.nextafter(flat[:1], torch.full_like(flat[:1], math.inf))
            out[i] = t
            break
    return out


# ---------------------------------------------------------------- models and data


class Block(nn.Module):
    """A pre-norm GPT block; attention written out (deterministic kernels only)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).split(d, dim=2))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // self.heads))
        future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = att.masked_fill(future, float("-inf")).softmax(dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))


class Gpt(nn.Module):
    """GPT-2's shape: token and position embeddings, blocks, a final norm, a head."""

    def __init__(self, layers: int, width: int, heads: int, vocab: int, seq: int, *,
                 tied: bool = True, unused_head: bool = False) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.blocks = nn.ModuleList([Block(width, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        if tied:
            self.head.weight = self.tok.weight
        # Never called by forward: find_unused_parameters must mark it unused.
        self.unused = nn.Linear(width, 8) if unused_head else None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class BnNet(nn.Module):
    """Two convolutions with BatchNorm, pooled into a classifier."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(),
            nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@dataclasses.dataclass
class Ctx:
    """What a rank knows about its job."""

    rank: int
    world: int
    backend: str
    device: torch.device
    size: Size
    check: str = ""
    fault: str | None = None

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def layers(self) -> int:
        return self.size.w2_layers if self.world > 1 else self.size.layers

    def device_ids(self) -> list[int] | None:
        return [self.device.index or 0] if self.cuda else None

    def autocast(self) -> Any:
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def stream_ctx(self, stream: Any) -> Any:
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def diff(self, what: str, names: Sequence[str], ours: Sequence[torch.Tensor | None],
             theirs: Sequence[torch.Tensor | None],
             tol: tuple[float, float] | None = None) -> str | None:
        """compare_exact (or compare_close with ``tol``), with ``--inject-fault`` applied."""
        if self.fault == self.check:
            ours = nudge_first(ours)
        if tol is None:
            return compare_exact(what, names, ours, theirs)
        return compare_close(what, names, ours, theirs, *tol)


def make_gpt(ctx: Ctx, *, layers: int | None = None, vocab: int | None = None,
             tied: bool = True, unused_head: bool = False) -> nn.Module:
    s = ctx.size
    torch.manual_seed(0)
    with ctx.device:  # initialised where it lives (fast on a GPU)
        return Gpt(ctx.layers if layers is None else layers, s.width, s.heads,
                   s.vocab if vocab is None else vocab, s.seq, tied=tied,
                   unused_head=unused_head)


def lm_batch(ctx: Ctx, key: int, *, vocab: int | None = None,
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of global batch ``key`` (inputs, next-token targets)."""
    s = ctx.size
    g = torch.Generator().manual_seed(1000 + key)
    tokens = torch.randint(0, s.vocab if vocab is None else vocab,
                           (ctx.world * s.batch, s.seq + 1), generator=g)
    mine = tokens[ctx.rank * s.batch:(ctx.rank + 1) * s.batch].to(ctx.device)
    return mine[:, :-1], mine[:, 1:]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                       targets.reshape(-1))


def grads_of(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def params_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def names_of(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_parameters()]


def _ddp_classes(control: bool) -> tuple[type, type]:
    """(torch's DDP, the DDP under test): torch's twice for the control."""
    theirs = torch.nn.parallel.DistributedDataParallel
    if control:
        return theirs, theirs
    return theirs, _import_gradring().DistributedDataParallel


def _cap_kwargs(ctx: Ctx) -> dict[str, Any]:
    cap = ctx.size.bucket_cap_mb
    return {} if cap is None else {"bucket_cap_mb": cap}


def torch_side_hook(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` as torch's DDP will take it. torch's DDP refuses a hook named
    ``bf16_compress_hook`` unless torch was built with CUDA (or ROCm) and NCCL
    2.10+, a check of the build, not of the process group; on a CPU-only
    build the same function runs under another name."""
    if hook.__name__ != "bf16_compress_hook" or _cuda_build():
        return hook

    def bf16_compress_by_another_name(state, bucket):  # noqa: ANN001, ANN202
        # (no annotations: torch's DDP checks any it finds against its own)
        return hook(state, bucket)

    return bf16_compress_by_another_name


def _cuda_build() -> bool:
    return torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None


def _buckets_of(ddp: Any) -> str:
    reducer = getattr(ddp, "reducer", None)
    buckets = getattr(reducer, "buckets", None)
    return f", {len(buckets)} buckets" if isinstance(buckets, list) else ""


# ---------------------------------------------------------------- the checks (rank side)


def check_pair(ctx: Ctx, kind: str) -> tuple[str, str]:
    """Train torch's DDP and gradring's side by side; compare every step."""
    kw: dict[str, Any] = _cap_kwargs(ctx)
    accumulate, hook, unused, stream = 1, None, False, None
    if kind == "bucket_view":
        kw["gradient_as_bucket_view"] = True
    elif kind == "find_unused":
        kw["find_unused_parameters"], unused = True, True
    elif kind == "static_graph":
        kw["static_graph"] = True
    elif kind == "no_sync":
        accumulate = 2
    elif kind in ("fp16_hook", "bf16_hook"):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hook = default_hooks.fp16_compress_hook if kind == "fp16_hook" \
            else default_hooks.bf16_compress_hook
    elif kind == "streams":
        stream = torch.cuda.Stream(ctx.device)
    elif kind not in ("control", "plain"):
        raise ValueError(f"unknown comparison {kind!r}")
    torch_cls, our_cls = _ddp_classes(kind == "control")
    base = make_gpt(ctx, unused_head=unused)
    names = names_of(base)
    models = [torch_cls(copy.deepcopy(base), device_ids=ctx.device_ids(), **kw),
              our_cls(copy.deepcopy(base), device_ids=ctx.device_ids(), **kw)]
    del base
    if hook is not None:
        models[0].register_comm_hook(None, torch_side_hook(hook))
        models[1].register_comm_hook(None, hook)
    opts = [torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for m in models]
    steps = ctx.size.steps
    for step in range(steps):
        seen = []
        for model, opt in zip(models, opts):
            with ctx.stream_ctx(stream):
                opt.zero_grad(set_to_none=True)
                for micro in range(accumulate):
                    x, y = lm_batch(ctx, step * accumulate + micro)
                    last = micro == accumulate - 1
                    with contextlib.nullcontext() if last else model.no_sync():
                        with ctx.autocast():
                            loss = lm_loss(model(x), y) / accumulate
                        loss.backward()
                # Stream-ordered like the step: what the optimizer is about to read.
                g = grads_of(model.module)
                opt.step()
                seen.append((g, params_of(model.module)))
        if stream is not None:  # the checker's own wait, after the step has run
            torch.cuda.current_stream(ctx.device).wait_stream(stream)
        (g_t, p_t), (g_o, p_o) = seen
        problem = ctx.diff(f"step {step}, gradients", names, g_o, g_t) \
            or ctx.diff(f"step {step}, parameters after the optimizer step", names, p_o, p_t)
        if problem:
            return FAIL, problem
    extra = " (torch against torch)" if kind == "control" else ""
    unused_note = ""
    if unused:
        unused_note = "; the unused head's .grad is None on both" \
            if models[1].module.unused.weight.grad is None else \
            "; the unused head has a .grad on both"
    if hook is not None and torch_side_hook(hook) is not hook:
        unused_note += "; torch's DDP ran the hook under another name (CPU-only torch build)"
    return PASS, (f"gradients and parameters bit-equal{extra} over {steps} steps"
                  f"{' x 2 micro-batches' if accumulate > 1 else ''}{_buckets_of(models[1])}"
                  f"{unused_note}")


def check_sync_batchnorm(ctx: Ctx) -> tuple[str, str]:
    """gradring.SyncBatchNorm in gradring's DDP against one process on the
    global batch, in float64; on CUDA also against torch's SyncBatchNorm."""
    gradring = _import_gradring()
    s = ctx.size
    torch.manual_seed(0)
    base = BnNet(s.bn_channels).double().to(ctx.device)
    names = names_of(base)
    ours_module = gradring.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(base))
    converted = sum(isinstance(m, gradring.SyncBatchNorm) for m in ours_module.modules())
    if converted != 2:
        return FAIL, f"convert_sync_batchnorm made {converted} SyncBatchNorm layers, not 2"
    ours = gradring.DistributedDataParallel(ours_module, device_ids=ctx.device_ids())
    single = copy.deepcopy(base)
    theirs = None
    if ctx.cuda:
        theirs = torch.nn.parallel.DistributedDataParallel(
            nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(base)),
            device_ids=ctx.device_ids())
    models = {"gradring": ours.module, "single": single}
    if theirs is not None:
        models["torch"] = theirs.module
    runners = {"gradring": ours, "single": single, "torch": theirs}
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for k, m in models.items()}
    n = ctx.world * s.batch
    lo, hi = ctx.rank * s.batch, (ctx.rank + 1) * s.batch
    tol = (1e-9, 1e-12)
    for step in range(s.steps):
        g = torch.Generator().manual_seed(2000 + step)
        xs = (torch.randn(n, 3, s.bn_image, s.bn_image, generator=g, dtype=torch.float64) * 2
              + 1).to(ctx.device)
        ys = torch.randint(0, 5, (n,), generator=g).to(ctx.device)
        got = {}
        for key, model in models.items():
            opts[key].zero_grad(set_to_none=True)
            x, y = (xs, ys) if key == "single" else (xs[lo:hi], ys[lo:hi])
            nn.functional.cross_entropy(runners[key](x), y).backward()
            grads = grads_of(model)
            opts[key].step()
            got[key] = (grads, params_of(model), [b.clone() for b in model.buffers()])
        bnames = [n for n, _ in base.named_buffers()]
        for ref in [k for k in ("single", "torch") if k in got]:
            problem = ctx.diff(f"step {step}, gradients against {ref}", names,
                               got["gradring"][0], got[ref][0], tol) \
                or ctx.diff(f"step {step}, parameters against {ref}", names,
                            got["gradring"][1], got[ref][1], tol) \
                or ctx.diff(f"step {step}, running statistics against {ref}", bnames,
                            got["gradring"][2], got[ref][2], tol)
            if problem:
                return FAIL, problem
    against = "one process on the global batch" + (
        " and torch's SyncBatchNorm" if ctx.cuda else
        " (torch's SyncBatchNorm needs CUDA: not compared)")
    return PASS, (f"float64, within rtol {tol[0]:g} of {against} over {s.steps} steps: "
                  "gradients, parameters, running statistics")


def check_join(ctx: Ctx) -> tuple[str, str]:
    """Uneven inputs under Join: gradring's DDP against torch's, rank by rank."""
    from torch.distributed.algorithms.join import Join as TorchJoin

    gradring = _import_gradring()
    s = ctx.size
    counts = [s.steps - 3 * (r % 2) for r in range(ctx.world)]
    mine = max(1, counts[ctx.rank])
    base = make_gpt(ctx)
    names = names_of(base)

    def train(cls: type, join_cls: type) -> tuple[list[Any], list[torch.Tensor]]:
        ddp = cls(copy.deepcopy(base), device_ids=ctx.device_ids(), **_cap_kwargs(ctx))
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
        history = []
        with join_cls([ddp]):
            for step in range(mine):
                opt.zero_grad(set_to_none=True)
                x, y = lm_batch(ctx, step)
                with ctx.autocast():
                    loss = lm_loss(ddp(x), y)
                loss.backward()
                history.append(grads_of(ddp.module))
                opt.step()
        return history, params_of(ddp.module)

    h_t, p_t = train(torch.nn.parallel.DistributedDataParallel, TorchJoin)
    h_o, p_o = train(gradring.DistributedDataParallel, gradring.Join)
    for step, (g_o, g_t) in enumerate(zip(h_o, h_t)):
        problem = ctx.diff(f"step {step}, gradients", names, g_o, g_t)
        if problem:
            return FAIL, problem
    problem = ctx.diff("parameters after Join", names, p_o, p_t)
    if problem:
        return FAIL, problem
    return PASS, (f"ranks ran {'/'.join(str(max(1, c)) for c in counts)} steps; gradients of "
                  "every step and the final parameters bit-equal to torch's DDP under Join")


class _CountingBackend:
    """A torch.compile backend that counts the graphs handed to ``inner``."""

    def __init__(self, inner: str) -> None:
        from torch._dynamo.backends.registry import lookup_backend

        self.inner = lookup_backend(inner)
        self.graphs = 0

    def __call__(self, gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
        self.graphs += 1
        return self.inner(gm, example_inputs, **kwargs)


def check_compile(ctx: Ctx, backend: str) -> tuple[str, str]:
    """compile(gradring DDP): gradients against torch's eager DDP, a steady
    state without recompiles, and one graph piece per bucket."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    gradring = _import_gradring()
    from gradring import compile as gcompile

    s = ctx.size
    torch._dynamo.reset()
    base = make_gpt(ctx, layers=s.compile_layers, vocab=s.compile_vocab, tied=False)
    names = names_of(base)
    batches = [lm_batch(ctx, k, vocab=s.compile_vocab) for k in range(s.compile_steps)]
    kw = _cap_kwargs(ctx)
    ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base),
                                                    device_ids=ctx.device_ids(), **kw)
    want = []
    for x, y in batches:
        ref.zero_grad(set_to_none=True)
        lm_loss(ref(x), y).backward()
        want.append(grads_of(ref.module))
    del ref
    counting = _CountingBackend(backend)
    ddp = gradring.DistributedDataParallel(copy.deepcopy(base), device_ids=ctx.device_ids(), **kw)
    model = torch.compile(ddp, backend=counting)
    tol = (1e-3, 1e-6) if backend == "inductor" else (1e-5, 1e-7)
    seen, worst = [], 0.0
    for step, (x, y) in enumerate(batches):
        ddp.zero_grad(set_to_none=True)
        lm_loss(model(x), y).backward()
        got = grads_of(ddp.module)
        problem = ctx.diff(f"step {step}, gradients against torch's eager DDP", names, got,
                           want[step], tol)
        if problem:
            return FAIL, problem
        worst = max(worst, max_rel_diff(got, want[step]))
        seen.append((counting.graphs, sum(counters["frames"].values()),
                     sum(counters["graph_break"].values()),
                     sum(counters["recompiles"].values())))
    warm = 2  # the first compile, and the one recompile at the bucket rebuild
    if len(set(seen[warm:])) != 1:
        return FAIL, ("compiled again after warm-up: (graphs, frames, graph breaks, recompiles) "
                      f"per step {seen}")
    splits = gcompile.splits(ddp)
    if not splits:
        return FAIL, "no graph split was made for gradring's DDP (Dynamo compiled no frame of it)"
    final, nb = splits[-1], len(ddp.reducer.buckets)
    if final.predicted:
        return FAIL, f"the last split is still the provisional one: {final.piece_buckets}"
    problem = split_problem(final.piece_buckets, nb)
    if problem:
        return FAIL, problem
    after = seen[-1][0] - seen[warm - 1][0] if len(seen) >= warm else 0
    return PASS, (f"{backend}: {len(final.piece_buckets)} pieces for {nb} buckets; "
                  f"graphs per step {[g for g, *_ in seen]} ({after} after warm-up); gradients "
                  f"within rtol {tol[0]:g} of eager (max rel diff {worst:.2g}) "
                  f"over {len(batches)} steps")


def check_cost(ctx: Ctx) -> tuple[str, str]:
    """Median step time (CUDA events) and peak memory: no DDP, torch's DDP, gradring's."""
    gradring = _import_gradring()
    s = ctx.size
    batches = [lm_batch(ctx, k) for k in range(4)]
    rows = []
    setups: list[tuple[str, Callable[[nn.Module], nn.Module]]] = [
        ("no DDP", lambda m: m),
        ("torch DDP", lambda m: torch.nn.parallel.DistributedDataParallel(
            m, device_ids=ctx.device_ids())),
        ("gradring DDP", lambda m: gradring.DistributedDataParallel(
            m, device_ids=ctx.device_ids())),
    ]
    for label, wrap in setups:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(ctx.device)
        before = torch.cuda.memory_allocated(ctx.device)
        model = wrap(make_gpt(ctx))
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        events = []
        for i in range(s.cost_warmup + s.cost_steps):
            x, y = batches[i % len(batches)]
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            opt.zero_grad(set_to_none=True)
            with ctx.autocast():
                loss = lm_loss(model(x), y)
            loss.backward()
            opt.step()
            end.record()
            if i >= s.cost_warmup:
                events.append((start, end))
        torch.cuda.synchronize(ctx.device)
        ms = [a.elapsed_time(b) for a, b in events]
        rows.append((label, statistics.median(ms), min(ms), max(ms),
                     (torch.cuda.max_memory_allocated(ctx.device) - before) / 2**20))
        del model, opt
    base_ms = rows[0][1]
    # peak: torch.cuda.max_memory_allocated over the set-up's life (model,
    # optimizer, DDP, steps), less what was allocated before it was built
    table = ["| set-up | median ms/step | min-max ms | vs no DDP | peak MiB |",
             "|---|---|---|---|---|"]
    for label, med, lo, hi, mib in rows:
        table.append(f"| {label} | {med:.2f} | {lo:.2f}-{hi:.2f} | {med / base_ms:.3f}x | "
                     f"{mib:.0f} |")
    head = (f"world 1 {ctx.backend}, {torch.cuda.get_device_name(ctx.device)}, bf16 autocast, "
            f"{s.cost_steps} steps after {s.cost_warmup} of warm-up")
    return PASS, head + "\n" + "\n".join(table)


def run_check(ctx: Ctx, check: Check, opts: dict[str, Any]) -> tuple[str, str]:
    """One check on this rank: (status, detail)."""
    if check.cuda_only and not ctx.cuda:
        return SKIP, "needs CUDA"
    # Bit-for-bit comparisons need kernels that repeat themselves (the control
    # checks that they do); the cost and the compiled run are measured as they come.
    exact = check.kind != "cost" and check.job != "compile"
    torch.use_deterministic_algorithms(exact, warn_only=True)
    kind = check.kind
    if check.job == "compile":
        return check_compile(ctx, opts["compile_backend"])
    if kind == "cost":
        return check_cost(ctx)
    if kind == "sync_batchnorm":
        return check_sync_batchnorm(ctx)
    if kind == "join":
        return check_join(ctx)
    return check_pair(ctx, kind)


# ---------------------------------------------------------------- rank processes


def _worker(rank: int, world: int, backend: str, names: list[str], opts: dict[str, Any],
            store: str, out: Any) -> None:
    """One rank of a job: run ``names`` in order, reporting each on ``out``."""
    try:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        os.environ.setdefault("GRADRING_QUIET", "1")
        torch.set_num_threads(1)
        if opts["device"] == "cuda":
            device = torch.device("cuda", 0)
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        dist.init_process_group(backend, init_method="file://" + store, rank=rank,
                                world_size=world, timeout=timedelta(seconds=opts["pg_timeout"]))
        # Its own timeout: every rank's wait in the barrier below ends by then.
        control = dist.new_group(backend="gloo", timeout=timedelta(
            seconds=opts["barrier_timeout"])) if world > 1 else None
        ctx = Ctx(rank, world, backend, device, SIZES[opts["size"]], fault=opts["fault"])
        by_name = {c.name: c for c in CHECKS}
    except BaseException:  # noqa: BLE001 - reported to the parent, which decides
        out.put(("fatal", rank, "", _short_trace()))
        return
    for name in names:
        out.put(("start", rank, name))
        t0 = time.perf_counter()
        ctx.check = name
        try:
            status, detail = run_check(ctx, by_name[name], opts)
        except Exception:  # noqa: BLE001 - a check that raises is a FAIL
            status, detail = FAIL, _short_trace()
        out.put(("result", rank, name, status, detail, time.perf_counter() - t0, time.time()))
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if control is not None:
            # Ranks that left a check at different points (one raised inside a
            # collective) cannot go on together: stop instead of hanging.
            try:
                dist.monitored_barrier(group=control, wait_all_ranks=True,
                                       timeout=timedelta(seconds=opts["barrier_timeout"]))
            except Exception:  # noqa: BLE001
                out.put(("fatal", rank, name, "ranks out of step after this check: "
                         + _short_trace()))
                out.close()
                out.join_thread()  # the message is in the pipe before the exit
                os._exit(3)
    out.put(("done", rank))
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def _short_trace() -> str:
    """The exception being handled: its message, and where it was raised."""
    kind, exc, tb = sys.exc_info()
    frames = traceback.extract_tb(tb)
    where = ""
    if frames:
        f = frames[-1]
        where = f" (at {os.path.relpath(f.filename, _ROOT)}:{f.lineno} in {f.name})"
    name = kind.__name__ if kind else "error"
    first = (str(exc).strip().splitlines() or [""])[0]
    if len(first) > 240:
        first = first[:240] + "..."
    return f"{name}: {first}{where}"


@dataclasses.dataclass
class Outcome:
    name: str
    status: str
    detail: str
    seconds: float = 0.0


def combine(name: str, per_rank: dict[int, tuple[str, str, float, float]],
            world: int) -> Outcome:
    """One outcome from the ranks' (status, detail, seconds, finished at):
    FAIL if any rank failed (the detail of the rank that failed first, where
    the cause usually is, named at world > 1), SKIP if all skipped, else PASS
    (the lowest rank's detail)."""
    ranks = sorted(per_rank)
    secs = max(per_rank[r][2] for r in ranks)
    failed = sorted((per_rank[r][3], r) for r in ranks if per_rank[r][0] == FAIL)
    if failed:
        first = failed[0][1]
        where = f"rank {first}: " if world > 1 else ""
        others = [str(r) for _, r in failed[1:]]
        also = f" (rank {', '.join(others)} failed after it)" if others else ""
        return Outcome(name, FAIL, where + per_rank[first][1] + also, secs)
    if all(per_rank[r][0] == SKIP for r in ranks):
        return Outcome(name, SKIP, per_rank[ranks[0]][1], secs)
    return Outcome(name, PASS, per_rank[ranks[0]][1], secs)


def run_job(job: str, checks: list[Check], opts: dict[str, Any],
            deadline: float) -> Iterator[Outcome]:
    """Start the job's ranks and yield each check's outcome as it completes."""
    world = 2 if job == "w2" else 1
    backend = "nccl" if opts["device"] == "cuda" and world == 1 else "gloo"
    names = [c.name for c in checks]
    mpctx = mp.get_context("spawn")
    out = mpctx.Queue()
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        store = os.path.join(tmp, "store")
        procs = [mpctx.Process(target=_worker, daemon=True,
                               args=(r, world, backend, names, opts, store, out))
                 for r in range(world)]
        for p in procs:
            p.start()
        results: dict[str, dict[int, tuple[str, str, float, float]]] = {n: {} for n in names}
        started: dict[int, str] = {}
        fatal: dict[int, tuple[str, str]] = {}
        done: set[int] = set()
        reported: set[str] = set()
        gone_since: float | None = None
        why_stopped = ""
        all_in: float | None = None
        while len(done) < world:
            try:
                msg = out.get(timeout=0.5)
            except queue.Empty:
                msg = None
            if msg is not None:
                kind, rank = msg[0], msg[1]
                if kind == "start":
                    started[rank] = msg[2]
                elif kind == "result":
                    results[msg[2]][rank] = (msg[3], msg[4], msg[5], msg[6])
                    if len(results[msg[2]]) == world:
                        reported.add(msg[2])
                        yield combine(msg[2], results[msg[2]], world)
                elif kind == "fatal":
                    fatal[rank] = (msg[2], msg[3])
                elif kind == "done":
                    done.add(rank)
                continue
            now = time.monotonic()
            if len(reported) == len(names):
                all_in = all_in or now
                if now - all_in > 30:  # every result is in; a rank that does not end is killed
                    break
            if now > deadline:
                why_stopped = "not finished within the time limit (--timeout)"
                break
            dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in done]
            if dead:
                gone_since = gone_since or time.monotonic()
                # The others may still report; give them the barrier's time to see it.
                if all(not p.is_alive() for p in procs) or \
                        time.monotonic() - gone_since > opts["barrier_timeout"] + 15:
                    why_stopped = _why_stopped(dead, procs, started, fatal)
                    break
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        out.close()
        out.join_thread()
        for name in names:
            if name in reported:
                continue
            missing = ", ".join(str(r) for r in range(world) if r not in results[name])
            why = why_stopped or "no result"
            if results[name]:  # what the ranks that did finish it said
                partial = combine(name, results[name], world)
                yield Outcome(name, FAIL, f"{partial.detail} (rank {missing} did not finish it: "
                              f"{why})", partial.seconds)
            else:
                yield Outcome(name, FAIL, "not run: " + why)


def _why_stopped(dead: list[int], procs: list[Any], started: dict[int, str],
                 fatal: dict[int, tuple[str, str]]) -> str:
    """Why a job ended before its last check: which ranks exited, where."""
    parts = []
    for r in dead:
        text = f"rank {r} exited with code {procs[r].exitcode}"
        check, message = fatal.get(r, ("", ""))
        if r in started:
            text += f" in {started[r]}"
        if message and not check:  # it never started a check: the cause is here
            text += f" ({message})"
        elif message:
            text += " (the ranks were out of step)"
        parts.append(text)
    return "; ".join(parts)


# ---------------------------------------------------------------- the parent


def _select(patterns: list[str] | None) -> list[Check]:
    if not patterns:
        return list(CHECKS)
    chosen = [c for c in CHECKS if any(fnmatch.fnmatchcase(c.name, p) for p in patterns)]
    return chosen


def format_outcome(o: Outcome) -> str:
    lines = o.detail.splitlines() or [""]
    secs = f" [{o.seconds:.1f} s]" if o.status != SKIP else ""
    head = f"{o.status} {o.name}: {lines[0]}{secs}"
    return "\n".join([head] + ["    " + line for line in lines[1:]])


def summary_line(outcomes: Sequence[Outcome], seconds: float, device: str) -> str:
    n = {s: sum(o.status == s for o in outcomes) for s in (PASS, FAIL, SKIP)}
    failed = [o.name for o in outcomes if o.status == FAIL]
    tail = f"; failed: {', '.join(failed)}" if failed else ""
    return (f"SUMMARY: {n[PASS]} passed, {n[FAIL]} failed, {n[SKIP]} skipped in {seconds:.0f} s "
            f"(torch {torch.__version__}, {device}){tail}")


def gpu_half_line(checks: Sequence[Check], has_cuda: bool) -> str:
    """A run on CPU tensors: the GPU half that was skipped, and what the exit
    status covers."""
    skipped = [c.name for c in checks if c.cuda_only]
    why = "--cpu given" if has_cuda else "no GPU here"
    names = f" ({', '.join(skipped)})" if skipped else ""
    return (f"GPU half skipped ({why}): {len(skipped)} CUDA-only checks not run{names}; the "
            "other checks ran on CPU tensors, and the exit status (0 only if none failed) "
            "covers them")


def exit_code(outcomes: Sequence[Outcome]) -> int:
    return 1 if any(o.status == FAIL for o in outcomes) else 0


def _job_header(job: str, opts: dict[str, Any]) -> str:
    s = SIZES[opts["size"]]
    cuda = opts["device"] == "cuda"
    if job == "w2":
        where = "world 2 over gloo, both ranks on " + ("cuda:0" if cuda else "CPU tensors")
        layers = s.w2_layers
    else:
        where = "world 1 over " + ("NCCL on cuda:0" if cuda else "gloo on CPU tensors "
                                   "(NCCL needs CUDA)")
        layers = s.layers
    if job == "compile":
        return (f"== compile: {where}; backend {opts['compile_backend']}; GPT "
                f"{s.compile_layers} x {s.width}, vocab {s.compile_vocab}, float32, untied head, "
                f"{s.compile_steps} steps")
    cap = "default bucket caps" if s.bucket_cap_mb is None else f"bucket_cap_mb={s.bucket_cap_mb}"
    return (f"== {job}: {where}; GPT {layers} x {s.width}, {s.heads} heads, vocab {s.vocab}, "
            f"seq {s.seq}, batch {s.batch} per rank, bf16 autocast, {s.steps} steps, {cap}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Check gradring's CUDA path against torch's DDP (docs/design.md, "
                    "'The CUDA path').")
    ap.add_argument("--cpu", action="store_true",
                    help="run on CPU tensors even when CUDA is available")
    ap.add_argument("--quick", action="store_true",
                    help="the tiny models (--size tiny): about a minute on two CPU cores")
    ap.add_argument("--size", choices=sorted(SIZES),
                    help="model sizes (default: gpt2 on CUDA, small on CPU; --quick: tiny)")
    ap.add_argument("--only", action="append", metavar="PATTERN",
                    help="run only the checks matching this shell pattern (repeatable)")
    ap.add_argument("--list", action="store_true", help="list the checks and exit")
    ap.add_argument("--compile-backend", default=None,
                    help="torch.compile backend (default: inductor; aot_eager on CPU with "
                         "--quick)")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds for the whole run; what has not finished then FAILs "
                         "(default: 300 on CUDA, 900 on CPU)")
    ap.add_argument("--inject-fault", metavar="CHECK", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.list:
        for c in CHECKS:
            print(f"{c.name:20} {c.what}{' (CUDA only)' if c.cuda_only else ''}")
        return 0
    checks = _select(args.only)
    if not checks:
        print(f"no check matches {args.only}; --list shows them", file=sys.stderr)
        return 2
    if args.inject_fault is not None and args.inject_fault not in {c.name for c in checks}:
        print(f"--inject-fault {args.inject_fault}: not one of the selected checks",
              file=sys.stderr)
        return 2
    gradring = _import_gradring()
    has_cuda = torch.cuda.is_available()
    device = "cuda" if has_cuda and not args.cpu else "cpu"
    size = args.size or ("tiny" if args.quick else "gpt2" if device == "cuda" else "small")
    backend = args.compile_backend or ("aot_eager" if device == "cpu" and size == "tiny"
                                       else "inductor")
    limit = args.timeout if args.timeout is not None else (300.0 if device == "cuda" else 900.0)
    opts = {"device": device, "size": size, "compile_backend": backend,
            "fault": args.inject_fault, "pg_timeout": 120.0,
            "barrier_timeout": 60.0}
    where = (f"CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}" if device == "cuda"
             else "CPU (" + ("--cpu given" if has_cuda else "torch.cuda.is_available() is False")
             + ")")
    print(f"gpu_check: torch {torch.__version__}, gradring from "
          f"{os.path.dirname(os.path.abspath(gradring.__file__))}; {where}; size {size}; "
          f"time limit {limit:.0f} s", flush=True)
    t0 = time.monotonic()
    deadline = t0 + limit
    outcomes: list[Outcome] = []

    def emit(o: Outcome) -> None:
        outcomes.append(o)
        print(format_outcome(o), flush=True)

    for job in ("w1", "w2", "compile"):
        mine = [c for c in checks if c.job == job]
        runnable = [c for c in mine if device == "cuda" or not c.cuda_only]
        if not mine:
            continue
        print(_job_header(job, opts), flush=True)
        skipped = {c.name for c in mine} - {c.name for c in runnable}
        why = "needs CUDA: " + ("--cpu given" if has_cuda else "torch.cuda.is_available() is "
                                "False (no GPU here)")
        if runnable and time.monotonic() >= deadline:
            for c in runnable:
                emit(Outcome(c.name, FAIL, "not run: the time limit (--timeout) was reached"))
        elif runnable:
            for o in run_job(job, runnable, opts, deadline):
                emit(o)
        for c in mine:
            if c.name in skipped:
                emit(Outcome(c.name, SKIP, why))
    if device == "cpu":
        print(gpu_half_line(checks, has_cuda), flush=True)
    print(summary_line(outcomes, time.monotonic() - t0, where), flush=True)
    return exit_code(outcomes)


if __name__ == "__main__":
    sys.exit(main())
