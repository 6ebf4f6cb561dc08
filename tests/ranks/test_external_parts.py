"""The all-reduce with external parts (comm/external.py; DDP leaves gradients in .grad
this way) against oracles.

- ``spans`` against a brute-force element map;
- every algorithm, on the threaded transport, against the exact sum each
  rank's weighted inputs must give: the two-shot reads the external parts itself, the
  others go through ``stage_in``/``finish_out``. Homed elements of the own
  chunk are NaN in the flat buffer, so reading them there instead of from the
  home cannot go unnoticed;
- DDP on a model whose buckets take the two-shot path, against one process
  and torch's DDP, over shared memory, the torch transport and gloo itself.
"""

from __future__ import annotations

import random

import pytest
import torch

import gradring.comm.algos as algos
from gradring.comm import external
from gradring.comm.collective import Collective
from gradring.comm.ops import SUM
from gradring.comm.transport import Kind
from tests.support import oracle
from tests.support.env import environ
from tests.support.threaded import run_ranks

pytestmark = pytest.mark.timeout(180)


def _layout(n: int, seed: int) -> list[tuple[int, int, bool]]:
    """Random pieces covering [0, n): (start, end, homed)."""
    rng = random.Random(seed)
    out, pos = [], 0
    while pos < n:
        end = min(n, pos + rng.randint(1, max(1, n // 3)))
        out.append((pos, end, rng.random() < 0.6))
        pos = end
    return out


def test_spans_match_an_element_map() -> None:
    for seed in range(200):
        n = random.Random(seed).randint(0, 60)
        layout = _layout(n, seed)
        owner = {}
        pieces = []
        for k, (a, b, homed) in enumerate(layout):
            if homed:
                t = torch.arange(a, b, dtype=torch.float64)
                pieces.append((a, t))
                for i in range(a, b):
                    owner[i] = k
        h = external.ExternalParts(pieces)
        lo = random.Random(seed + 1).randint(0, n)
        hi = random.Random(seed + 2).randint(lo, n)
        seen = []
        for a, b, home in external.spans(h, lo, hi):
            assert lo <= a < b <= hi
            if home is None:
                assert all(i not in owner for i in range(a, b))
            else:
                assert home.tolist() == list(range(a, b))  # the right slice of the right piece
            seen.extend(range(a, b))
        assert seen == list(range(lo, hi))


def _rank_input(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    i = torch.arange(n, dtype=torch.int64)
    return ((i * 7 + rank * 13) % 11 - 5).to(dtype)


#: The tests' short names for the registry's all-reduce algorithms.
ALGO_NAMES = {"twoshot": "direct/twoshot", "oneshot": "direct/oneshot", "ring": "ring",
              "tree": "tree"}
SCALES = (0.5, 0.25, 1.0, 0.125)  # powers of two: exact in every dtype


def _homed(t, algo: str, zero_copy: bool, n: int, dtype: torch.dtype, seq: int):
    r, w = t.rank, t.world_size
    x, scale = _rank_input(r, n, dtype), SCALES[r]
    layout = _layout(n, seed=n + r)  # each rank keeps different pieces external
    flat = t.world.empty(n, dtype) if zero_copy else torch.empty(n, dtype=dtype)
    flat.copy_(x * scale)
    lo, hi = external.own_range(n, r, w)
    pieces = []
    for a, b, homed in layout:
        if homed:
            pieces.append((a, x[a:b].clone()))
            lo_a, hi_b = max(a, lo), min(b, hi)
            if lo_a < hi_b:
                flat[lo_a:hi_b] = float("nan")  # must be read from the home
    h = external.ExternalParts(pieces, scale)
    info = Collective("threads", seq, Kind.ALL_REDUCE, n * flat.element_size(), dtype,
                      algo="test")
    t.start(info)
    # The registry runs the two-shot on the parts and stages the others around them.
    algos.run(ALGO_NAMES[algo], t, algos.Call(info, flat, flat, SUM, parts=h))
    result = flat.clone()
    for a, piece in pieces:
        result[a:a + piece.numel()] = piece  # the external parts hold their result
    return result


ALGOS = [("twoshot", True), ("twoshot", False), ("ring", False), ("tree", False),
         ("oneshot", False)]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("algo,zero_copy", ALGOS, ids=[f"{a}-{z}" for a, z in ALGOS])
def test_every_algorithm_gives_the_weighted_sum(world: int, algo: str, zero_copy: bool) -> None:
    def body(t):
        out, seq = [], 0
        for n in (0, 1, 4, 100, 1000, 10007):
            for dtype in (torch.float32, torch.float64, torch.bfloat16):
                out.append(_homed(t, algo, zero_copy, n, dtype, seq))
                seq += 1
        return out

    results = run_ranks(world, body)
    k = 0
    for n in (0, 1, 4, 100, 1000, 10007):
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            want = sum(_rank_input(r, n, dtype).double() * SCALES[r] for r in range(world))
            for r in range(world):
                got = results[r][k]
                assert torch.equal(got.double(), torch.as_tensor(want).double()), \
                    (algo, world, n, dtype, r)
            k += 1


def _compare_with_env(rank: int, world: int, env: dict[str, str], kwargs: dict,
                      accumulate: int) -> dict:
    with environ(**env):
        return oracle.train_compare(rank, world, "wide", kwargs, steps=3, accumulate=accumulate)


DDP_CASES = [
    (2, {}, {}, 1),
    (2, {}, {"bucket_cap_mb": 0.2}, 2),
    (3, {}, {"bucket_cap_mb": 0.2}, 1),
    (2, {"GRADRING_TRANSPORT": "torch"}, {"bucket_cap_mb": 0.2}, 1),
    (2, {"GRADRING_ALGO": "native"}, {}, 1),
]


@pytest.mark.parametrize("world,env,kwargs,accumulate", DDP_CASES)
def test_ddp_with_grads_left_in_place_matches_oracles(pools, world, env, kwargs, accumulate):
    results = pools.run(world, _compare_with_env, env, kwargs, accumulate)
    for r in results:
        assert r["grad_single"] < 1e-9 and r["param_single"] < 1e-9, r
        assert r["grad_torch"] < 1e-9 and r["param_torch"] < 1e-9, r
