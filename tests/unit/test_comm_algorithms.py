"""Every algorithm against the naive oracle, on the threaded transport (no processes).

The grid follows Gloo's tests: world size × element count × dtype × op, with
integer-valued data so that every summation order gives the same exact
result, then a random fuzz with changing sizes (an early prototype gave wrong
sums when buffer sets were reused across changing sizes).
"""

from __future__ import annotations

import random

import pytest
import torch

import gradring.comm.algos as algos
from gradring.comm import ops
from gradring.comm.algos import direct, ring, tree
from gradring.comm.collective import Collective
from gradring.comm.ops import Op
from gradring.comm.transport import CollectiveError, Kind
from tests.support import comm_oracle
from tests.support.threaded import ThreadedWorld, run_ranks

pytestmark = pytest.mark.timeout(120)

WORLDS = (1, 2, 3, 4)
COUNTS = (0, 1, 4, 100, 1000, 10007)
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64)
OPS = tuple(Op(n) for n in ("SUM", "AVG", "MAX", "MIN"))


def rank_data(rank: int, count: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Small integers in [-5, 5]: sums of up to 4 ranks are exact even in bf16."""
    i = torch.arange(count, dtype=torch.int64)
    return ((i * 7 + rank * 13 + salt * 5) % 11 - 5).to(dtype)


def info(seq: int, kind: Kind, t: torch.Tensor) -> Collective:
    return Collective("threads", seq, kind, t.numel() * t.element_size(), t.dtype,
                      algo="test")


def begin(t, seq: int, kind: Kind, flat: torch.Tensor) -> Collective:
    i = info(seq, kind, flat)
    t.start(i)
    return i


#: The tests' short names for the registry's all-reduce algorithms ("-zc": zero copy).
ALGO_NAMES = {"ring": "ring", "tree": "tree", "naive": "naive", "twoshot": "direct/twoshot",
              "twoshot-zc": "direct/twoshot", "oneshot": "direct/oneshot",
              "inline": "direct/inline"}


def _all_reduce_with(algo: str, t, seq: int, flat: torch.Tensor, op: Op) -> None:
    i = info(seq, Kind.ALL_REDUCE, flat)
    t.start(i)
    algos.run(ALGO_NAMES[algo], t, algos.Call(i, flat, flat, op))


def _sweep_all_reduce(t, algo: str, zero_copy: bool) -> list[torch.Tensor]:
    out = []
    seq = 0
    for count in COUNTS:
        for dtype in DTYPES:
            for op in OPS:
                src = rank_data(t.rank, count, dtype)
                flat = t.world.empty(count, dtype) if zero_copy else torch.empty(count, dtype=dtype)
                flat.copy_(src)
                _all_reduce_with(algo, t, seq, flat, op)
                seq += 1
                out.append(flat.clone())
    return out


ALL_REDUCE_ALGOS = [("ring", False), ("tree", False), ("naive", False), ("twoshot", False),
                    ("twoshot", True), ("oneshot", False), ("oneshot", True), ("inline", False)]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("algo,zero_copy", ALL_REDUCE_ALGOS,
                         ids=[f"{a}{'-zerocopy' if z else ''}" for a, z in ALL_REDUCE_ALGOS])
def test_all_reduce_grid(world: int, algo: str, zero_copy: bool) -> None:
    results = run_ranks(world, _sweep_all_reduce, algo, zero_copy)
    k = 0
    for count in COUNTS:
        for dtype in DTYPES:
            for op in OPS:
                expected = comm_oracle.oracle_all_reduce(
                    [rank_data(r, count, dtype) for r in range(world)], op)
                for r in range(world):
                    got = results[r][k]
                    assert got.dtype == dtype and got.shape == expected.shape
                    assert torch.equal(got, expected), (algo, world, count, dtype, op, r)
                k += 1


#: The registry's algorithm per collective in the point-to-point family ("direct" is one name).
P2P_FAMILY = {Kind.REDUCE_SCATTER: "ring", Kind.ALL_GATHER: "ring", Kind.BROADCAST: "tree",
              Kind.BARRIER: "tree"}


def _collective(family: str, t, i: Collective, out: torch.Tensor, inp: torch.Tensor,
                op: Op = ops.SUM, root: int = 0) -> None:
    """Run collective ``i`` through the algorithm registry: ``family`` "ring" or "direct"."""
    name = "direct" if family == "direct" else P2P_FAMILY[i.kind]
    algos.run(name, t, algos.Call(i, out, inp, op, root))


def _sweep_other(t, algo: str) -> list[torch.Tensor]:
    w, r = t.world_size, t.rank
    out = []
    seq = 0
    for count in (0, 1, 5, 1000):
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            for op in OPS:
                # reduce-scatter: input of w*count elements, output count
                inp = rank_data(r, w * count, dtype)
                keep = inp.clone()
                res = torch.full((count,), 99, dtype=dtype)
                i = begin(t, seq, Kind.REDUCE_SCATTER, inp)
                _collective(algo, t, i, res, inp, op)
                seq += 1
                assert torch.equal(inp, keep), "reduce_scatter modified its input"
                out.append(res)
            gathered = torch.empty(w * count, dtype=dtype)
            mine = rank_data(r, count, dtype, salt=1)
            i = begin(t, seq, Kind.ALL_GATHER, mine)
            _collective(algo, t, i, gathered, mine)
            seq += 1
            out.append(gathered)
            for src in range(w):
                b = rank_data(r, count, dtype, salt=2 + src)
                i = begin(t, seq, Kind.BROADCAST, b)
                _collective(algo, t, i, b, b, root=src)
                seq += 1
                out.append(b)
    i = begin(t, seq, Kind.BARRIER, torch.empty(0, dtype=torch.uint8))
    _collective(algo, t, i, torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.uint8))
    return out


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("algo", ["ring", "direct"])
def test_other_collectives_grid(world: int, algo: str) -> None:
    results = run_ranks(world, _sweep_other, algo)
    k = 0
    for count in (0, 1, 5, 1000):
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            for op in OPS:
                parts = comm_oracle.oracle_reduce_scatter(
                    [rank_data(r, world * count, dtype) for r in range(world)], op)
                for r in range(world):
                    assert torch.equal(results[r][k], parts[r]), ("rs", algo, count, dtype, op)
                k += 1
            gathered = comm_oracle.oracle_all_gather(
                [rank_data(r, count, dtype, salt=1) for r in range(world)])
            for r in range(world):
                assert torch.equal(results[r][k], gathered), ("ag", algo, count, dtype)
            k += 1
            for src in range(world):
                want = rank_data(src, count, dtype, salt=2 + src)
                for r in range(world):
                    assert torch.equal(results[r][k], want), ("bcast", algo, count, dtype, src)
                k += 1


def test_in_place_variants() -> None:
    """all_gather with the input inside the output; reduce_scatter with the output
    inside the input (the patterns FSDP-style callers use)."""

    def body(t, algo):
        w, r, m = t.world_size, t.rank, 37
        buf = torch.zeros(w * m)
        buf[r * m:(r + 1) * m] = rank_data(r, m, torch.float32)
        i = begin(t, 0, Kind.ALL_GATHER, buf[:m])
        _collective(algo, t, i, buf, buf[r * m:(r + 1) * m])
        rs = rank_data(r, w * m, torch.float32)
        out = rs[r * m:(r + 1) * m]
        i = begin(t, 1, Kind.REDUCE_SCATTER, rs)
        _collective(algo, t, i, out, rs, ops.SUM)
        return buf, out.clone()

    for algo in ("ring", "direct"):
        for w in (2, 3):
            res = run_ranks(w, body, algo)
            gathered = torch.cat([rank_data(r, 37, torch.float32) for r in range(w)])
            total = comm_oracle.oracle_all_reduce(
                [rank_data(r, w * 37, torch.float32) for r in range(w)], ops.SUM)
            for r in range(w):
                assert torch.equal(res[r][0], gathered)
                assert torch.equal(res[r][1], total[r * 37:(r + 1) * 37])


def test_random_floats_identical_on_every_rank() -> None:
    """With inexact floats the algorithms may round differently from the oracle,
    but all ranks must agree bit for bit (DDP replicas must not drift)."""

    def body(t, algo):
        g = torch.Generator().manual_seed(t.rank)
        x = torch.randn(4099, generator=g)
        _all_reduce_with(algo, t, 0, x, ops.SUM)
        return x

    for algo in ("ring", "tree", "twoshot", "oneshot", "inline"):
        for w in (3, 4):
            res = run_ranks(w, body, algo)
            expected = comm_oracle.oracle_all_reduce(
                [torch.randn(4099, generator=torch.Generator().manual_seed(r)) for r in range(w)],
                ops.SUM)
            for r in range(w):
                assert torch.equal(res[r], res[0]), (algo, w)
            torch.testing.assert_close(res[0], expected, rtol=1e-5, atol=1e-5)


def _fuzz(t, seed: int, steps: int) -> list[torch.Tensor]:
    rng = random.Random(seed)  # same stream on every rank: same collective sequence
    out = []
    for seq in range(steps):
        algo = rng.choice(["ring", "tree", "twoshot", "oneshot", "twoshot-zc", "inline"])
        count = rng.choice([0, 1, 3, rng.randrange(1, 50), rng.randrange(50, 30000)])
        dtype = rng.choice(DTYPES)
        op = rng.choice(OPS)
        salt = rng.randrange(1000)
        src = rank_data(t.rank, count, dtype, salt)
        zero_copy = algo.endswith("-zc")
        flat = t.world.empty(count, dtype) if zero_copy else torch.empty(count, dtype=dtype)
        flat.copy_(src)
        _all_reduce_with(algo, t, seq, flat, op)
        out.append(flat)
    return out


@pytest.mark.parametrize("world", (2, 3, 4))
def test_fuzz_changing_sizes(world: int) -> None:
    seed, steps = 1234 + world, 150
    results = run_ranks(world, _fuzz, seed, steps)
    rng = random.Random(seed)
    for k in range(steps):
        rng.choice(["ring", "tree", "twoshot", "oneshot", "twoshot-zc", "inline"])
        count = rng.choice([0, 1, 3, rng.randrange(1, 50), rng.randrange(50, 30000)])
        dtype = rng.choice(DTYPES)
        op = rng.choice(OPS)
        salt = rng.randrange(1000)
        expected = comm_oracle.oracle_all_reduce(
            [rank_data(r, count, dtype, salt) for r in range(world)], op)
        for r in range(world):
            assert torch.equal(results[r][k], expected), (k, count, dtype, op)


def test_tree_shapes() -> None:
    for w in range(1, 17):
        for k in (0, 1):
            links = [tree.double_tree(r, w)[k] for r in range(w)]
            roots = [r for r in range(w) if links[r].parent < 0]
            assert len(roots) == 1
            for r in range(w):
                assert len(links[r].children) <= 2
                for c in links[r].children:
                    assert links[c].parent == r
            # every rank reaches the root
            for r in range(w):
                seen, x = 0, r
                while links[x].parent >= 0:
                    x = links[x].parent
                    seen += 1
                    assert seen <= w
                assert x == roots[0]


def test_chunk_bounds_cover_everything() -> None:
    for n in (0, 1, 4, 7, 100, 10007):
        for w in range(1, 9):
            b = ops.chunk_bounds(n, w)
            assert b[0][0] == 0 and b[-1][1] == n
            assert all(b[i][1] == b[i + 1][0] for i in range(w - 1))
            sizes = [hi - lo for lo, hi in b]
            assert max(sizes) - min(sizes) <= 1


def test_mismatched_collectives_raise() -> None:
    def body(t):
        kind = Kind.ALL_REDUCE if t.rank == 0 else Kind.BROADCAST
        i = Collective("threads", 0, kind, 40, torch.float32, algo="test")
        t.start(i)
        direct.barrier(t, i)

    with pytest.raises(CollectiveError, match="different collective"):
        run_ranks(2, body)


def test_missing_peer_times_out() -> None:
    def body(t):
        if t.rank == 1:
            return
        t.start(Collective("threads", 3, Kind.ALL_REDUCE, 4, torch.float32, algo="ring"))
        ring.all_reduce(t, torch.ones(4), ops.SUM)

    world = ThreadedWorld(2, timeout=0.3)
    with pytest.raises(CollectiveError, match=r"all_reduce #3.*rank 1 did not send"):
        run_ranks(2, body, world=world)


def test_selection_thresholds_and_overrides(monkeypatch) -> None:
    from gradring.comm import select

    big, small, mid = 64 << 20, 4, select.INLINE_MAX_BYTES + 4
    assert select.choose(Kind.ALL_REDUCE, small, 2, "shm", None).algo == "direct/inline"
    assert select.choose(Kind.ALL_REDUCE, select.INLINE_MAX_BYTES, 4, "shm",
                         None).algo == "direct/inline"
    assert select.choose(Kind.ALL_REDUCE, mid, 2, "shm", None).algo == "direct/oneshot"
    assert select.choose(Kind.ALL_REDUCE, big, 2, "shm", None).algo == "direct/twoshot"
    assert select.oneshot_max_bytes(4) < select.oneshot_max_bytes(2)
    assert select.choose(Kind.ALL_REDUCE, small, 2, "torch", None).algo == "tree"
    assert select.choose(Kind.ALL_REDUCE, big, 2, "torch", None).algo == "ring"
    assert select.choose(Kind.ALL_REDUCE, small, 2, "shm", "ring") == ("shm", "ring")
    assert select.choose(Kind.ALL_GATHER, big, 2, "shm", "tree").algo == "ring"
    assert select.choose(Kind.BROADCAST, big, 2, "torch", None).algo == "tree"
    assert select.choose(Kind.REDUCE_SCATTER, big, 3, "shm", None).algo == "direct"
    assert select.choose(Kind.ALL_REDUCE, big, 2, "shm", "native").transport == "native"
    monkeypatch.setenv("GRADRING_ALGO", "tree")
    monkeypatch.setenv("GRADRING_TRANSPORT", "torch")
    assert select.overrides() == ("torch", "tree")
    monkeypatch.setenv("GRADRING_ALGO", "bogus")
    with pytest.raises(ValueError, match="GRADRING_ALGO"):
        select.overrides()


def test_registry_has_every_algorithm_select_can_choose() -> None:
    """Every (algorithm, kind) pair ``select.choose`` can return runs through the
    one registry; a pair that does not exist is refused by name, not run."""
    from gradring.comm import select

    chosen = set()
    for kind in Kind:
        for transport in ("shm", "torch", select.HOSTS):
            for algo in (None, "ring", "tree", "hierarchical"):
                for nbytes in (4, 64 << 20):
                    for world in (2, 4):
                        c = select.choose(kind, nbytes, world, transport, algo)
                        chosen.add((c.algo, kind))
                        assert (c.algo, kind) in algos.ALGORITHMS, (c, kind, transport, algo)
    assert ("hierarchical", Kind.ALL_REDUCE) in chosen and ("direct", Kind.BARRIER) in chosen
    with pytest.raises(ValueError, match=r"no broadcast algorithm 'ring'.*known: \['direct', "
                                         r"'tree'\]"):
        algos.lookup("ring", Kind.BROADCAST)


def test_engine_runs_in_order_and_reports_failures() -> None:
    from gradring.comm.engine import Engine, Job, Work

    eng = Engine("test-engine")
    log: list[int] = []
    works = []
    for i in range(20):
        fut = torch.futures.Future()

        def run(i=i):
            if i == 7:
                raise CollectiveError("boom 7")
            log.append(i)

        eng.submit(Job(run, fut, [torch.tensor([i])]))
        works.append(Work(fut, eng))
    eng.run_now(lambda: log.append(100))  # a sync call waits for everything before it
    assert log == [i for i in range(20) if i != 7] + [100]
    assert works[3].wait() and works[3].get_future().value()[0].item() == 3
    with pytest.raises(CollectiveError, match="boom 7"):
        works[7].wait()
    assert not works[7].is_success() and isinstance(works[7].exception(), CollectiveError)

    # A future callback on the engine thread that waits for later work must not deadlock.
    later = torch.futures.Future()
    first = torch.futures.Future()
    seen = []
    chained = first.then(lambda f: seen.append(Work(later, eng).wait()))
    eng.submit(Job(lambda: None, first, []))
    eng.submit(Job(lambda: seen.append("later ran"), later, []))
    chained.wait()  # the callback itself has finished (not just ``first``)
    later.wait()
    assert seen == ["later ran", True]
    eng.shutdown()
    assert eng.pending() == 0
