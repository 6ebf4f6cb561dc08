"""The reducer's core built directly: ``Reducer``, ``BucketSet`` and ``Bucket``
with a fake communicator, in one process.

[Note: the fake communicator]
``FakeComm`` stands in for one rank of a group of ``world_size`` ranks. It
offers what the reducer asks of a ``GroupComm`` (``empty``, ``own_range``,
``all_reduce``, ``all_reduce_homed``, ``broadcast_coalesced``, ...), records
every collective launched (what, its label, size and dtype, and how many
parameters already held a gradient at that moment), and performs it at once
as if the other ranks contributed known values: a bucket gets, in each
parameter's slot, ``peer[i]`` (the other ranks' gradients of parameter ``i``,
already divided by the world size, summed), and the unused-parameter map gets
``peer_used``. So every reduced ``.grad`` has an exact oracle computed here
with plain torch: the local gradient times 1/world_size (in the gradient's
precision, as torch's reducer multiplies) plus ``peer[i]``.

The model's loss is ``sum_k (p_k * c_k).sum()`` over the parameters a step
uses, so the local gradient of ``p_k`` is ``c_k`` exactly, and the order in
which the terms are added decides the order in which gradients arrive (the
last term's first).

Bucket assignments are checked against torch's own
``_compute_bucket_assignment_by_size`` with the caps torch's
``_BucketCapacityConfig`` derives from the same arguments.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel.distributed import _BucketCapacityConfig

from gradring.buckets import Bucket, BucketCaps
from gradring.fast_paths import CORE, FastPaths
from gradring.graph import GraphMode
from gradring.reducer import Reducer
from gradring.reducer.bucket_set import BucketSet
from tests.support.env import environ

MAP_LABEL = "DDP unused-parameter map"


@dataclass
class Launch:
    """One collective the fake saw."""

    kind: str  # "all_reduce" or "all_reduce_homed"
    label: str | None
    numel: int
    dtype: torch.dtype
    grads_present: int  # parameters holding a .grad when it launched
    pieces: list[int]  # all_reduce_homed: data_ptr of each external piece


class FakeComm:
    """One rank of a group of ``world_size``, in this process (see [Note: the
    fake communicator])."""

    group = None

    def __init__(self, world_size: int = 2, rank: int = 0) -> None:
        self.world_size = world_size
        self.rank = rank
        self.launches: list[Launch] = []
        self.broadcasts = 0
        self.allocated: list[tuple[int, torch.dtype]] = []
        # Per parameter index: what the other ranks add into its slot.
        self.peer: dict[int, torch.Tensor] = {}
        # What the other ranks add into the unused-parameter map.
        self.peer_used: list[int] | None = None
        # The parameters (to count gradients at launch) and where the buckets are.
        self.params: list[torch.Tensor] = []
        self.bucket_source: Any = None  # a Reducer or a BucketSet: has .buckets

    # -- what the reducer asks of a GroupComm
    def empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        self.allocated.append((numel, dtype))
        # NaN where a slot is never written: it cannot pass for a result.
        fill = float("nan") if dtype.is_floating_point else 0
        return torch.full((numel,), fill, dtype=dtype, device=device)

    def own_range(self, numel: int) -> tuple[int, int]:
        chunk = -(-numel // self.world_size)
        lo = min(self.rank * chunk, numel)
        return lo, min(lo + chunk, numel)

    def all_reduce(self, tensor: torch.Tensor, *, label: str | None = None,
                   on_done: Any = None, async_op: bool = True) -> Any:
        self._record("all_reduce", tensor, label, [])
        tensor.add_(self._from_peers(tensor, label))
        return self._done(tensor, on_done, async_op)

    def all_reduce_homed(self, flat: torch.Tensor, pieces: list[tuple[int, torch.Tensor]],
                         scale: float, *, label: str | None = None, on_done: Any = None,
                         async_op: bool = True) -> Any:
        """The contract of [Note: external parts]: outside this rank's own chunk
        the caller put the scaled input into ``flat``; inside it, the input is
        read from the pieces (scaled here); the result lands in the pieces and
        in ``flat``."""
        self._record("all_reduce_homed", flat, label, [t.data_ptr() for _, t in pieces])
        lo, hi = self.own_range(flat.numel())
        for start, t in pieces:
            a, b = max(start, lo), min(start + t.numel(), hi)
            if a < b:
                flat[a:b] = t[a - start:b - start] * scale
        flat.add_(self._from_peers(flat, label))
        for start, t in pieces:
            t.copy_(flat[start:start + t.numel()])
        return self._done(flat, on_done, async_op)

    def broadcast_coalesced(self, tensors: Sequence[torch.Tensor], src: int = 0, *,
                            reuse: bool = False) -> None:
        self.broadcasts += 1  # this rank is rank 0 (or agrees with it): nothing changes

    def on_shared_memory(self) -> bool:
        return False

    @contextlib.contextmanager
    def labelled(self, label: str | None) -> Iterator[None]:
        yield

    def exchange_lists(self, tag: str, mine: list[int]) -> dict[int, list[int]]:
        return {}  # no peer answers

    # -- the stand-in's own workings
    def buckets_launched(self) -> list[Launch]:
        return [x for x in self.launches if x.label != MAP_LABEL]

    def _record(self, kind: str, t: torch.Tensor, label: str | None, pieces: list[int]) -> None:
        present = sum(p.grad is not None for p in self.params)
        self.launches.append(Launch(kind, label, t.numel(), t.dtype, present, pieces))

    def _from_peers(self, tensor: torch.Tensor, label: str | None) -> torch.Tensor:
        out = torch.zeros_like(tensor)
        if label == MAP_LABEL:
            if self.peer_used is not None:
                out += torch.tensor(self.peer_used, dtype=tensor.dtype)
            return out
        bucket = next(b for b in self.bucket_source.buckets
                      if b.buffer.data_ptr() == tensor.data_ptr())
        offset = 0
        for i in bucket.param_indices:  # slots in order, row-major parameters
            n = self.params[i].numel()
            if i in self.peer:
                out[offset:offset + n] = self.peer[i].reshape(-1)
            offset += n
        return out

    @staticmethod
    def _done(tensor: torch.Tensor, on_done: Any, async_op: bool) -> Any:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result([tensor])
        if on_done is not None:
            on_done(fut)
        return fut if async_op else None


# ---------------------------------------------------------------- the model
def make_params(shapes: Sequence[tuple[int, ...]], dtypes: Sequence[torch.dtype] | None = None,
                seed: int = 0) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    dtypes = dtypes or [torch.float32] * len(shapes)
    return [nn.Parameter(torch.randn(s, generator=gen, dtype=d)) for s, d in zip(shapes, dtypes)]


def coefs(params: Sequence[torch.Tensor], seed: int) -> list[torch.Tensor]:
    """The local gradient each parameter gets from ``loss``."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in params]


def loss(params: Sequence[torch.Tensor], c: Sequence[torch.Tensor],
         order: Sequence[int] | None = None, skip: Sequence[int] = ()) -> torch.Tensor:
    """``sum_k (p_k * c_k).sum()`` over ``order`` (default: definition order),
    leaving out ``skip``. Gradients arrive in reverse ``order``."""
    total = torch.zeros((), dtype=torch.float64)
    for k in (range(len(params)) if order is None else order):
        if k not in skip:
            total = total + (params[k] * c[k]).sum().to(torch.float64)
    return total


def peers(params: Sequence[torch.Tensor], seed: int = 99) -> dict[int, torch.Tensor]:
    """Known contributions of the other ranks (already divided by the world size)."""
    return dict(enumerate(coefs(params, seed)))


def averaged(local: torch.Tensor, peer: torch.Tensor | None, world: int) -> torch.Tensor:
    """The oracle: the local gradient times 1/world in its own precision, plus the peers'."""
    scale = torch.tensor(1.0 / world, dtype=torch.float64 if local.dtype == torch.float64
                         else torch.float32)
    out = local * scale
    return out if peer is None else out + peer


def build(params: list[nn.Parameter], comm: FakeComm, *, mode: GraphMode = GraphMode.DEFAULT,
          cap_mb: float | None = None, view: bool = False, fast: str = "all") -> Reducer:
    caps = BucketCaps.from_args(cap_mb)
    with environ(GRADRING_FAST_PATHS=fast):
        reducer = Reducer(params, [f"p{i}" for i in range(len(params))], comm, caps=caps,
                          mode=mode, gradient_as_bucket_view=view)
    comm.params, comm.bucket_source = params, reducer
    return reducer


def step(reducer: Reducer, params: list[nn.Parameter], c: list[torch.Tensor], *,
         order: Sequence[int] | None = None, skip: Sequence[int] = (), sync: bool = True,
         fast: str = "all") -> None:
    """One iteration as gradring's DDP drives the reducer around a forward."""
    with environ(GRADRING_FAST_PATHS=fast), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "find_unused_parameters found nothing unused"
        if sync:
            reducer.prepare_for_forward()
            reducer.rebuild_if_needed()
        else:
            reducer.check_prior_finished()
            reducer.note_unsynced_forward()
        out = loss(params, c, order, skip)
        if sync:
            reducer.prepare_for_backward([out])
        out.backward()


def in_buckets(reducer: Reducer, t: torch.Tensor) -> bool:
    return any(b.buffer.data_ptr() <= t.data_ptr() < b.buffer.data_ptr() + b.nbytes
               for b in reducer.buckets)


def torch_assignment(params: Sequence[torch.Tensor], limits: list[int],
                     order: Sequence[int] | None = None) -> list[list[int]]:
    """torch's bucket assignment of ``params`` walked in ``order``."""
    if order is None:
        return [list(b) for b in dist._compute_bucket_assignment_by_size(list(params), limits)[0]]
    found = dist._compute_bucket_assignment_by_size(
        [params[i] for i in order], limits, [False] * len(order), list(order))[0]
    return [list(b) for b in found]


def torch_caps(cap_mb: float | None) -> _BucketCapacityConfig:
    return _BucketCapacityConfig.create(bucket_cap_mb=cap_mb, bucket_cap_mb_list=None,
                                        use_python_reducer=False)


def assert_averaged(params: Sequence[torch.Tensor], local: Sequence[torch.Tensor | None],
                    comm: FakeComm) -> None:
    for i, (p, g) in enumerate(zip(params, local)):
        expected = averaged(g, comm.peer.get(i), comm.world_size) if g is not None \
            else comm.peer.get(i)
        assert p.grad is not None, f"p{i} has no .grad"
        assert p.grad.dtype == p.dtype and p.grad.shape == p.shape
        assert torch.equal(p.grad, expected), f"p{i}: max diff {(p.grad - expected).abs().max()}"


# ---------------------------------------------------------------- Bucket
def test_bucket_lays_slots_out_in_order_and_views_take_the_gradients_layout():
    a = nn.Parameter(torch.randn(3, 5))
    b = nn.Parameter(torch.randn(5, 4).t())  # made from a transposed tensor
    c = nn.Parameter(torch.randn(7))
    comm = FakeComm()
    bucket = Bucket(0, [4, 1, 2], [a, b, c], comm.empty)
    assert bucket.buffer.numel() == 15 + 20 + 7 and comm.allocated == [(42, torch.float32)]
    # autograd's own gradient of each parameter gives the layout a slot must have
    (a.sum() + b.sum() + c.sum()).backward()
    start = bucket.buffer.data_ptr()
    for view, p, offset in zip(bucket.views, (a, b, c), (0, 15, 35)):
        assert view.shape == p.shape and view.stride() == p.grad.stride()
        assert view.storage_offset() == offset and view.untyped_storage().data_ptr() == start
    # each slot is its own span: writing one leaves the others
    bucket.buffer.zero_()
    bucket.views[1].fill_(1.0)
    assert bucket.buffer[15:35].eq(1).all() and bucket.buffer[:15].eq(0).all() \
        and bucket.buffer[35:].eq(0).all()


def test_bucket_counts_its_gradients_in_and_starts_afresh():
    params = make_params([(4,), (4,), (4,)])
    bucket = Bucket(2, [0, 1, 2], params, FakeComm().empty)
    for _ in range(2):  # a second backward counts the same way
        assert [bucket.arrive() for _ in params] == [False, False, True]
        bucket.reset()


# ---------------------------------------------------------------- BucketSet
def test_bucket_set_routes_each_parameter_to_its_bucket():
    params = make_params([(3,), (5,), (2, 2), (6,)])
    comm = FakeComm()
    bs = BucketSet(params, comm, view_mode=False)
    bs.install([[3, 1], [0, 2]], CORE)
    assert [b.param_indices for b in bs.buckets] == [[3, 1], [0, 2]]
    assert [b.index for b in bs.buckets] == [0, 1]
    assert [bs.bucket_of(i) for i in range(4)] == [1, 0, 1, 0]
    assert comm.allocated == [(11, torch.float32), (7, torch.float32)]
    # nothing is a view outside view mode: every .grad byte is outside the buckets
    for p in params:
        p.grad = torch.ones_like(p)
    assert bs.grad_bytes_outside() == sum(p.numel() * 4 for p in params)


def test_bucket_set_in_view_mode_keeps_accumulated_grads_and_points_them_at_slots():
    params = make_params([(3,), (2, 5), (4,)])
    grads = coefs(params, 5)
    for p, g in zip(params, grads):
        p.grad = g.clone()
    bs = BucketSet(params, FakeComm(), view_mode=True)
    bs.install([[2, 0], [1]], CORE)
    assert bs.grad_bytes_outside() == 0
    for p, g in zip(params, grads):
        assert torch.equal(p.grad, g)
    # .grad is the slot: what lands in the buffer is .grad
    bs.buckets[1].buffer.fill_(3.0)
    assert params[1].grad.eq(3.0).all()


# ---------------------------------------------------------------- assignment
@pytest.mark.parametrize("cap_mb", [None, 0.0001, 0.0003])
@pytest.mark.parametrize("mode", [GraphMode.DEFAULT, GraphMode.FIND_UNUSED])
def test_initial_buckets_are_torchs_assignment_reversed(mode, cap_mb):
    # 40/100/16/64/100/24 floats, float64 ones between: caps of 100 to 300 bytes
    params = make_params([(40,), (100,), (4, 4), (64,), (100,), (24,)],
                         [torch.float32, torch.float64, torch.float32, torch.float32,
                          torch.float64, torch.float32])
    comm = FakeComm()
    reducer = build(params, comm, mode=mode, cap_mb=cap_mb)
    limits = torch_caps(cap_mb).compute_bucket_size_limits(
        static_graph=False, find_unused_parameters=mode is GraphMode.FIND_UNUSED)[0]
    expected = list(reversed(torch_assignment(params, limits)))
    assert [b.param_indices for b in reducer.buckets] == expected
    assert comm.broadcasts == 1  # rank 0's assignment, sent once


@pytest.mark.parametrize("cap_mb", [None, 0.0002])
def test_rebuild_walks_the_arrival_order_with_torchs_caps(cap_mb):
    params = make_params([(40,), (10,), (30,), (64,), (8,)])
    comm = FakeComm()
    reducer = build(params, comm, cap_mb=cap_mb)
    arrived: list[int] = []
    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(lambda _p, i=i: arrived.append(i))
    order = [3, 0, 4, 1, 2]  # gradients arrive 2, 1, 4, 0, 3
    c = coefs(params, 1)
    step(reducer, params, c, order=order)
    assert len(reducer.buckets) == 1  # one bucket until the rebuild
    for p in params:
        p.grad = None
    step(reducer, params, c, order=order)  # its forward rebuilds
    assert arrived[:5] == [2, 1, 4, 0, 3]
    config = torch_caps(cap_mb)
    limits = [config.first_bucket_bytes_cap, config.bucket_bytes_cap]
    if limits[0] >= limits[1]:
        limits = limits[1:]
    assert [b.param_indices for b in reducer.buckets] == \
        torch_assignment(params, limits, arrived[:5])
    assert reducer.has_rebuilt and comm.broadcasts == 2
    assert_averaged(params, c, comm)


# ---------------------------------------------------------------- launching
@pytest.mark.parametrize("ready", ["in_order", "reversed"])
def test_buckets_launch_in_index_order_whatever_order_they_fill(ready):
    # find_unused keeps the construction-time caps: one 256-byte parameter per bucket,
    # bucket k holding parameter 3 - k
    params = make_params([(64,)] * 4)
    comm = FakeComm()
    comm.peer = peers(params)
    reducer = build(params, comm, mode=GraphMode.FIND_UNUSED, cap_mb=0.0002)
    assert [b.param_indices for b in reducer.buckets] == [[3], [2], [1], [0]]
    c = coefs(params, 2)
    # in order: gradients arrive 3, 2, 1, 0; reversed: 0, 1, 2, 3 (bucket 3 fills first)
    step(reducer, params, c, order=None if ready == "in_order" else [3, 2, 1, 0])
    launched = comm.buckets_launched()
    assert [x.label for x in launched] == [f"DDP bucket {k}" for k in range(4)]
    # in order, each bucket goes as soon as its gradient is in; reversed, none
    # can go before bucket 0, whose gradient is the last
    assert [x.grads_present for x in launched] == \
        ([1, 2, 3, 4] if ready == "in_order" else [4, 4, 4, 4])
    # the usage map follows the last bucket
    assert comm.launches[-1].label == MAP_LABEL and comm.launches[-1].dtype == torch.int32
    assert_averaged(params, c, comm)


def test_each_bucket_is_one_collective_of_its_dtype_and_size():
    params = make_params([(40,), (100,), (24,)], [torch.float32, torch.float64, torch.float32])
    comm = FakeComm()
    reducer = build(params, comm, mode=GraphMode.FIND_UNUSED, cap_mb=25)
    step(reducer, params, coefs(params, 3))
    got = sorted((x.numel, x.dtype) for x in comm.buckets_launched())
    assert got == sorted((b.buffer.numel(), b.buffer.dtype) for b in reducer.buckets) == \
        [(64, torch.float32), (100, torch.float64)]


# ---------------------------------------------------------------- averaging
@pytest.mark.parametrize("world", [2, 3, 4])
def test_gradients_are_averaged_with_the_peers(world):
    params = make_params([(5, 7), (300,), (6000,), (9,)],
                         [torch.float32, torch.float64, torch.float32, torch.float64])
    comm = FakeComm(world_size=world, rank=world - 1)
    comm.peer = peers(params)
    reducer = build(params, comm)
    for it in range(3):  # construction buckets, then rebuilt ones
        for p in params:
            p.grad = None
        c = coefs(params, 10 + it)
        step(reducer, params, c)
        assert_averaged(params, c, comm)


def test_divide_factor_sets_the_average():
    params = make_params([(8,), (5000,)])
    comm = FakeComm(world_size=4)
    comm.peer = peers(params)
    reducer = build(params, comm)
    reducer.set_divide_factor(2)  # Join: two ranks still train
    c = coefs(params, 4)
    step(reducer, params, c)
    for i, p in enumerate(params):
        assert torch.equal(p.grad, averaged(c[i], comm.peer[i], 2))


# ---------------------------------------------------------------- gradient_as_bucket_view
@pytest.mark.parametrize("view", [False, True])
def test_gradient_as_bucket_view(view):
    params = make_params([(4, 8), (5000,), (3,)])
    comm = FakeComm()
    comm.peer = peers(params)
    reducer = build(params, comm, view=view)
    for it in range(3):
        if it == 2:  # zero_grad(set_to_none=False): the same .grad tensors go on
            kept = [p.grad for p in params]
            for p in params:
                p.grad.zero_()
        else:
            for p in params:
                p.grad = None
        c = coefs(params, 20 + it)
        step(reducer, params, c)
        assert_averaged(params, c, comm)
        assert all(in_buckets(reducer, p.grad) for p in params) is view
        assert not any(in_buckets(reducer, p.grad) for p in params) is not view
        if it == 2:
            assert all(p.grad is g for p, g in zip(params, kept))
    assert reducer.grad_bytes_outside_buckets() == (0 if view else 4 * (32 + 5000 + 3))


# ---------------------------------------------------------------- find_unused_parameters
@pytest.mark.parametrize("peer_used", [0, 1])
def test_find_unused_marks_the_unreached_and_sums_the_usage_map(peer_used):
    params = make_params([(6,), (5000,), (7,), (3, 3)])
    comm = FakeComm()
    comm.peer = peers(params)
    if not peer_used:
        del comm.peer[1]  # no rank has a gradient for it: its slot sums zeros
    comm.peer_used = [1, peer_used, 1, 0]
    reducer = build(params, comm, mode=GraphMode.FIND_UNUSED)
    c = coefs(params, 6)
    step(reducer, params, c, skip=[1, 3])
    assert reducer.unused_in_last_forward() == [1, 3]
    # every bucket still launched (unused slots are zeros), then the map
    assert len(comm.buckets_launched()) == len(reducer.buckets)
    assert comm.launches[-1].label == MAP_LABEL and comm.launches[-1].numel == 4
    assert reducer._get_local_used_map().tolist() == [2, peer_used, 2, 0]
    assert_averaged([params[0], params[2]], [c[0], c[2]],
                    _sub(comm, {0: 0, 2: 1}))
    # used by a peer only: its gradient is the peers'; used by none: .grad stays None
    if peer_used:
        assert torch.equal(params[1].grad, comm.peer[1])
    else:
        assert params[1].grad is None
    assert params[3].grad is None


def _sub(comm: FakeComm, index: dict[int, int]) -> FakeComm:
    """A fake whose peers are ``comm``'s, renumbered (for assert_averaged on a subset)."""
    sub = FakeComm(comm.world_size)
    sub.peer = {new: comm.peer[old] for old, new in index.items() if old in comm.peer}
    return sub


def test_unreached_parameter_without_find_unused_is_named_at_the_next_forward():
    params = make_params([(6,), (5,), (7,)])
    comm = FakeComm()
    reducer = build(params, comm)
    step(reducer, params, coefs(params, 7), skip=[1])
    with pytest.raises(RuntimeError, match="p1"):
        reducer.prepare_for_forward()


# ---------------------------------------------------------------- no_sync
@pytest.mark.parametrize("fast", ["none", "all"])
@pytest.mark.parametrize("view", [False, True])
def test_no_sync_accumulates_locally_then_reduces_the_sum(view, fast):
    params = make_params([(4, 4), (5000,), (2,)])
    comm = FakeComm()
    comm.peer = peers(params)
    reducer = build(params, comm, view=view, fast=fast)
    c1, c2 = coefs(params, 8), coefs(params, 9)
    step(reducer, params, c1, sync=False, fast=fast)
    assert comm.launches == []
    for p, g in zip(params, c1):
        assert torch.equal(p.grad, g)
    step(reducer, params, c2, fast=fast)
    assert len(comm.buckets_launched()) == len(reducer.buckets)
    assert_averaged(params, [a + b for a, b in zip(c1, c2)], comm)


# ---------------------------------------------------------------- fast paths
@pytest.mark.parametrize("fast", ["none", "all", "homed", "packed", "-homed", "-packed"])
@pytest.mark.parametrize("view", [False, True])
def test_each_fast_path_gives_the_cores_bits(fast, view):
    # small slots (packed when on) beside large row-major ones (homed when on)
    params = make_params([(6000,), (16,), (70, 80), (3,), (5000,)],
                         [torch.float32, torch.float32, torch.float32, torch.float32,
                          torch.float64])
    comm = FakeComm()
    comm.peer = peers(params)
    reducer = build(params, comm, view=view, fast=fast)
    on = FastPaths(**{n: getattr(reducer.fast, n) for n in ("homed", "packed")})
    assert on.describe() == {"-homed": "packed", "-packed": "homed"}.get(fast, fast)
    for it in range(3):
        for p in params:
            p.grad = None
        c = coefs(params, 30 + it)
        step(reducer, params, c, fast=fast)
        assert_averaged(params, c, comm)
    # the homed all-reduce, and only where it may run: no view mode
    last = comm.buckets_launched()[-len(reducer.buckets):]
    homed = [x for x in last if x.kind == "all_reduce_homed"]
    assert bool(homed) == (on.homed and not view)
    # homed gradients take part where they are, in .grad: the large ones always
    grads = {p.grad.data_ptr() for p in params}
    pieces = {ptr for x in homed for ptr in x.pieces}
    assert pieces <= grads
    if homed:
        assert {params[i].grad.data_ptr() for i in (0, 2, 4)} <= pieces
