"""Seeded random DDP scenarios, run under each reducer configuration in one rank.

[Note: the differential fuzzer]
A seed makes a *scenario*: a model of random parameters (1 element to
several MiB, float32 and float64, some made from transposed tensors, one
sometimes shared by two terms of the loss, some left out of the loss on some
ranks), DDP's arguments (``find_unused_parameters``, ``static_graph``,
``gradient_as_bucket_view``, a bucket cap, torch's allreduce or fp16
compression comm hook) and a training pattern (``zero_grad`` with
``set_to_none`` True or False or none at all, ``no_sync`` steps, a second
backward after one forward, Join with uneven inputs). Every rank builds the
same scenario from the seed.

Drawn apart from those (from a second generator, so that the draws above
stay what they were for every seed): an embedding table whose gradient is
sparse, looked up at indices that repeat (``sparse``); backwards with
``create_graph=True`` (``create_graph``); bfloat16 and float16 parameters
beside float32 ones (``mixed``). These are the fallback branches of the fast
paths' puts. The world size is the caller's: the default suite runs world 2,
the slow one also 3 and 4.

At world 3 and more, gradring's all-reduce adds the ranks' contributions in
another order than gloo (tests/ranks/test_summation_order.py), and so does
torch's sparse all-reduce for repeated indices: torch's DDP is then held to
the summation-order bound instead of the bits (``_close``). Every gradring
configuration must still give the core's bits.

The scenario then runs once per reducer configuration
(``GRADRING_FAST_PATHS`` ``none``, the core; ``all``, the default; each
fast path alone), and, where torch's DDP can run it on this
backend, once under torch's DDP. Each run records, per step, every
parameter's ``.grad`` and, after the optimizer step, the parameters, or the
error that stopped it (its type and first line). Every configuration must
give the core's bits and errors; torch's DDP must give the core's too. A
mismatch is reported with the seed and the command that replays it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import gradring
from tests.support.env import environ

#: The reducer configurations every scenario runs under, the core first:
#: GRADRING_FAST_PATHS's value.
CONFIGS = ("none", "all", "homed", "packed")


@dataclass
class Scenario:
    """One random DDP scenario (see [Note: the differential fuzzer])."""

    seed: int
    shapes: list[tuple[int, ...]]
    dtypes: list[torch.dtype]
    transposed: list[bool]
    shared: int | None  # a parameter used by two terms of the loss
    unused: dict[int, list[int]]  # rank -> parameters its loss leaves out
    find_unused: bool
    static_graph: bool
    view: bool
    cap_mb: float
    hook: str | None  # None, "allreduce" or "fp16"
    steps: list[str]  # per step: "none" | "zero" | "keep" | "no_sync" | "twice"
    join_extra: int  # Join: rank 1 trains this many steps more (0: no Join)
    # A parameter every rank leaves out without find_unused_parameters: the
    # run must stop at the next forward with the unfinished-reduction error.
    # Until then, buckets already launched may or may not have landed in
    # .grad (nothing waits for them), so only the errors are compared.
    expect_error: bool = False
    # The parameter that is an embedding table with a sparse gradient, or None.
    sparse: int | None = None
    # Whether backwards run with create_graph=True.
    create_graph: bool = False
    # The world size the scenario was drawn for.
    world_size: int = 2
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        return (f"seed={self.seed} params={len(self.shapes)} "
                f"numels={[_numel(s) for s in self.shapes]} find_unused={self.find_unused} "
                f"static_graph={self.static_graph} view={self.view} cap_mb={self.cap_mb} "
                f"hook={self.hook} steps={self.steps} join_extra={self.join_extra} "
                f"shared={self.shared} unused={self.unused} sparse={self.sparse} "
                f"create_graph={self.create_graph} dtypes={sorted({str(d) for d in self.dtypes})} "
                f"world_size={self.world_size}")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def make(seed: int, *, world_size: int, max_numel: int) -> Scenario:
    """The scenario of ``seed`` (the same on every rank)."""
    rng = random.Random(seed)
    n = rng.randint(1, 12)
    shapes, dtypes, transposed = [], [], []
    for _ in range(n):
        size = rng.choice([1, rng.randint(2, 64), rng.randint(65, 4096), rng.randint(4097, 70000),
                           rng.randint(70001, max(70002, max_numel))])
        size = min(size, max_numel)
        if size >= 4 and rng.random() < 0.4:
            a = rng.choice([d for d in range(2, 65) if size % d == 0] or [1])
            shapes.append((a, size // a))
            transposed.append(a > 1 and rng.random() < 0.4)
        else:
            shapes.append((size,))
            transposed.append(False)
        dtypes.append(rng.choice([torch.float32, torch.float32, torch.float64]))
    find_unused = rng.random() < 0.35
    static_graph = not find_unused and rng.random() < 0.25
    unused: dict[int, list[int]] = {}
    if (find_unused or static_graph) and n > 1 and rng.random() < 0.6:
        for r in range(world_size):
            if rng.random() < 0.6:
                unused[r] = rng.sample(range(n), rng.randint(1, n - 1))
    elif n > 1 and rng.random() < 0.1:
        # A parameter every rank leaves out without find_unused_parameters: the
        # next forward raises, naming it (the errors are compared too). Left
        # out on some ranks only, it would leave the others waiting in a
        # collective, under torch's DDP as here, until the timeout.
        k = rng.randrange(n)
        unused = {r: [k] for r in range(world_size)}
    expect_error = bool(unused) and not (find_unused or static_graph)
    hook = rng.choice([None, None, None, "allreduce", "fp16"])
    join_extra = 0
    if not static_graph and rng.random() < 0.2:
        join_extra = rng.randint(1, 2)
    if expect_error:
        # A rank that stops with the error leaves a joined peer shadowing
        # collectives that never come (under torch's DDP too): no Join then.
        join_extra = 0
    patterns = ["none", "zero", "keep", "no_sync", "twice"]
    steps = [rng.choice(patterns) for _ in range(rng.randint(2, 5))]
    if static_graph:
        # static_graph: the same graph every iteration (no second backward).
        steps = [s for s in steps if s != "twice"] or ["none"]
    if join_extra:
        steps = [s for s in steps if s not in ("twice", "no_sync")] or ["none"]
    sc = Scenario(
        seed=seed, shapes=shapes, dtypes=dtypes, transposed=transposed,
        shared=rng.randrange(n) if rng.random() < 0.3 else None, unused=unused,
        find_unused=find_unused, static_graph=static_graph, view=rng.random() < 0.35,
        cap_mb=rng.choice([0.001, 0.02, 0.5, 25.0]), hook=hook, steps=steps,
        join_extra=join_extra, expect_error=expect_error, world_size=world_size)
    _draw_extras(sc, random.Random(f"extras-{seed}"))
    return sc


def _draw_extras(sc: Scenario, rng: random.Random) -> None:
    """Sparse gradients, create_graph and mixed precision (see [Note: the
    differential fuzzer]), from their own generator."""
    n = len(sc.shapes)
    if rng.random() < 0.3:
        # 12 lookups into a table of 2 to 8 rows: indices repeat.
        k = rng.randrange(n)
        sc.sparse = k
        if sc.shared == k:
            sc.shared = None
        sc.shapes[k] = (rng.randint(2, 8), rng.randint(1, 16))
        sc.dtypes[k] = torch.float32
        sc.transposed[k] = False
        # torch's comm hooks do not take a sparse bucket, nor its Join a sparse shadow.
        sc.hook = None
        sc.join_extra = 0
    sc.create_graph = rng.random() < 0.2
    if rng.random() < 0.3:
        for k in range(n):
            if k != sc.sparse and rng.random() < 0.5:
                sc.dtypes[k] = rng.choice([torch.bfloat16, torch.float16])


class FuzzNet(nn.Module):
    """The scenario's parameters; the loss gives each an elementwise gradient
    that depends on the parameter and on the rank's input. The sparse one is
    an ``nn.Embedding(sparse=True)`` module's table (torch's DDP learns from
    the module that its gradient is sparse) looked up at rows the input picks."""

    def __init__(self, sc: Scenario) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(sc.seed)
        ps, bases = [], []
        self.emb: nn.Embedding | None = None
        for k, (shape, dtype, t) in enumerate(zip(sc.shapes, sc.dtypes, sc.transposed)):
            if t:
                data = torch.randn(shape[::-1], generator=gen, dtype=dtype).t()
            else:
                data = torch.randn(shape, generator=gen, dtype=dtype)
            bases.append(torch.randn(shape, generator=gen, dtype=dtype))
            if k == sc.sparse:
                self.emb = nn.Embedding(shape[0], shape[1], sparse=True, _weight=data)
                continue
            ps.append(nn.Parameter(data))
        self.ps = nn.ParameterList(ps)
        # Parameter k of the scenario is ps[_pos[k]] (the sparse one is emb.weight).
        self._pos = {k: k - (sc.sparse is not None and k > sc.sparse)
                     for k in range(len(sc.shapes))}
        # Plain attributes, not buffers: DDP would broadcast buffers every forward.
        self.bases = bases
        self.shared = sc.shared
        self.sparse = sc.sparse
        self.skip: set[int] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.sum()
        total = x.new_zeros(())
        for k in range(len(self.bases)):
            if k in self.skip:
                continue
            if k == self.sparse:
                assert self.emb is not None
                # Rows picked by the rank's input, 12 lookups: some rows repeat.
                rows = (x.abs() * 1000).long().flatten() % self.emb.num_embeddings
                e = self.emb(rows)
                total = total + (e.sum() * s + (e * e).sum() * 0.01).to(total.dtype)
                continue
            p = self.ps[self._pos[k]]
            base = self.bases[k]
            term = (p * base).sum() * s + (p * p).sum() * 0.01
            total = total + term.to(total.dtype)
        if self.shared is not None and self.shared not in self.skip:
            p = self.ps[self._pos[self.shared]]
            total = total + (p * p * 0.5).sum().to(total.dtype)
        return total


def _config(config: str) -> contextlib.AbstractContextManager[None]:
    """GRADRING_FAST_PATHS set to ``config`` inside the block."""
    return environ(GRADRING_FAST_PATHS=config)


def _hook(name: str | None) -> Any:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return {None: None, "allreduce": default_hooks.allreduce_hook,
            "fp16": default_hooks.fp16_compress_hook}[name]


def _train(sc: Scenario, rank: int, impl: type) -> list[Any]:
    """Run the scenario under ``impl``; the record (see [Note: the differential fuzzer])."""
    model = FuzzNet(sc)
    model.skip = set(sc.unused.get(rank, []))
    ddp = impl(model, find_unused_parameters=sc.find_unused, static_graph=sc.static_graph,
               gradient_as_bucket_view=sc.view, bucket_cap_mb=sc.cap_mb)
    hook = _hook(sc.hook)
    if hook is not None:
        ddp.register_comm_hook(None, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1000 * sc.seed + rank)
    record: list[Any] = []
    steps = list(sc.steps) + (["none"] * sc.join_extra if rank == 1 else [])
    join = ddp.join() if sc.join_extra else contextlib.nullcontext()
    try:
        with join:
            for how in steps:
                x = torch.randn(3, 4, generator=gen)
                if how == "none":
                    opt.zero_grad(set_to_none=True)
                elif how == "zero":
                    opt.zero_grad(set_to_none=False)
                elif how == "no_sync":
                    with ddp.no_sync():
                        ddp(x * 0.5).backward(create_graph=sc.create_graph)
                loss = ddp(x)
                if how == "twice":
                    loss.backward(retain_graph=True, create_graph=sc.create_graph)
                loss.backward(create_graph=sc.create_graph)
                if sc.expect_error:
                    continue  # see Scenario.expect_error
                record.append([None if p.grad is None else p.grad.detach().clone()
                               for p in model.parameters()])
                opt.step()
                record.append([p.detach().clone() for p in model.parameters()])
    except Exception as exc:  # noqa: BLE001 - the error is part of the record
        record.append(("error", type(exc).__name__, str(exc).splitlines()[0]))
    return record


def _diff(a: list[Any], b: list[Any], *, error_text: bool = True,
          world: int | None = None) -> str | None:
    """Where two records differ, or None if they are the same bits (and
    errors; ``error_text``: their texts' first lines too, else only their types).
    ``world``: values need only be within the summation-order bound of a world
    of that size (see ``_close``); layouts and dtypes must still match."""
    if len(a) != len(b):
        return f"{len(a)} entries against {len(b)}: last {a[-1:]!s:.200} / {b[-1:]!s:.200}"
    for k, (x, y) in enumerate(zip(a, b)):
        if isinstance(x, tuple) or isinstance(y, tuple):
            if (x != y) if error_text else (x[:2] != y[:2]):
                return f"entry {k}: {x!s:.300} against {y!s:.300}"
            continue
        for j, (s, t) in enumerate(zip(x, y)):
            if (s is None) != (t is None):
                return f"entry {k} param {j}: None against a tensor"
            if s is None:
                continue
            if s.layout != t.layout or s.dtype != t.dtype:
                return f"entry {k} param {j}: {s.layout} {s.dtype} against {t.layout} {t.dtype}"
            if s.layout is not torch.strided:
                s, t = s.to_dense(), t.to_dense()
            same = torch.equal(s, t) if world is None else _close(s, t, world)
            if not same:
                return f"entry {k} param {j}: max diff {(s - t).abs().max().item():g}"
    return None


#: About the size of one rank's contribution to an element (parameters, bases
#: and inputs are standard normal; the loss weighs a term by the sum of 12
#: inputs): the ranks' terms can cancel, and their summation order then leaves
#: an error of their size's last bits on a small sum.
_TERM = 4.0


def _close(s: torch.Tensor, t: torch.Tensor, world: int) -> bool:
    """Whether ``s`` is within what summing ``world`` terms in another order can
    change, with room for a few steps of it carried through the optimizer:
    ``8 * world * eps * (|t| + mean |t| + _TERM)`` per element. A wrong average
    or a rank left out of the sum is far outside it."""
    eps = torch.finfo(t.dtype).eps
    mag = t.double().abs()
    bound = 8 * world * eps * (mag + mag.mean() + _TERM)
    return bool(((s.double() - t.double()).abs() <= bound).all())


def _torch_asserted(record: list[Any]) -> bool:
    last = record[-1] if record else None
    return isinstance(last, tuple) and "INTERNAL ASSERT FAILED" in last[2]


def torch_can_run(sc: Scenario) -> bool:
    """Whether torch's DDP runs the scenario here as gradring's does (gloo, CPU)."""
    # A second backward after one forward raises under torch's DDP where it
    # only accumulates under gradring's (docs/ddp-differences.md).
    if "twice" in sc.steps:
        return False
    # torch's DDP takes no sparse gradient under gradient_as_bucket_view
    # ("Cannot access storage of SparseTensorImpl").
    if sc.view and sc.sparse is not None:
        return False
    # Nor one that some rank's forward leaves out ("Expected sparse gradient to
    # be defined" on that rank, while the others wait in the all-reduce).
    return not any(sc.sparse in left_out for left_out in sc.unused.values())


def run_seed(rank: int, world_size: int, seed: int, max_numel: int,
             configs: tuple[str, ...] = CONFIGS) -> list[str]:
    """Every rank: run ``seed``'s scenario under each configuration (and torch's
    DDP where it can), and return the mismatches against the core."""
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        # A second backward after one forward warns once per DDP, as it should.
        warnings.simplefilter("ignore", RuntimeWarning)
        return _run_seed(rank, world_size, seed, max_numel, configs)


def _run_seed(rank: int, world_size: int, seed: int, max_numel: int,
              configs: tuple[str, ...]) -> list[str]:
    sc = make(seed, world_size=world_size, max_numel=max_numel)
    out = []
    with _config(configs[0]):
        core = _train(sc, rank, gradring.DistributedDataParallel)
    for cfg in configs[1:]:
        with _config(cfg):
            got = _train(sc, rank, gradring.DistributedDataParallel)
        d = _diff(got, core)
        if d is not None:
            out.append(f"rank {rank} GRADRING_FAST_PATHS={cfg}: {d}")
    if torch_can_run(sc):
        try:
            # torch's DDP stops at the first create_graph=True backward of a bucket
            # of several parameters ("a leaf Variable that requires grad is being
            # used in an in-place operation"; tests/ranks/test_ddp_create_graph.py):
            # its oracle is then the same steps without create_graph, whose values
            # are the same (the records hold .grad detached).
            plain = dataclasses.replace(sc, create_graph=False)
            got = _train(plain, rank, nn.parallel.DistributedDataParallel)
        except RuntimeError:
            # torch's constructor itself failed (its coalesced broadcast refuses
            # some parameter layouts that gradring's takes): nothing to compare.
            got = []
        # Another summation order than gloo's: at world 3 and more, and for
        # torch's sparse all-reduce (see [Note: the differential fuzzer]).
        loose = world_size > 2 or sc.sparse is not None
        d = _diff(got, core, error_text=False, world=world_size if loose else None) \
            if got else None
        # An internal assert is torch's own bug (static_graph whose first
        # iterations run under no_sync trips one), not a difference to report.
        if d is not None and not _torch_asserted(got):
            out.append(f"rank {rank} torch's DDP: {d}")
    dist.barrier()
    if out:
        out.insert(0, sc.describe())
    return out
