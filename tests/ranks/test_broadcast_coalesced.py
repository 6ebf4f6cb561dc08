"""GroupComm.broadcast_coalesced: every dtype and shape arrives bit for bit.

CPU tensors of all dtypes travel in one byte buffer (group_comm.py); the
oracle is the source rank's own tensors, which every rank can regenerate
from the source's seed.
"""

from __future__ import annotations

import pytest
import torch

from gradring.group_comm import GroupComm

pytestmark = pytest.mark.timeout(120)


def _tensors(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    return [
        r(5), r(3, 4).t(),  # float32, one of them not contiguous
        r(7).double(), r(2, 2).to(torch.bfloat16), r(3).half(),
        torch.randint(0, 1 << 40, (3,), generator=g),  # int64 (BatchNorm's counters)
        torch.tensor(seed),  # a 0-dim int64
        r(4) > 0,  # bool
        torch.randint(0, 255, (5,), generator=g).to(torch.uint8),
        torch.complex(r(2), r(2)),
        torch.zeros(0),  # empty
        r(6)[::2],  # strided view
    ]


def _broadcast(rank: int, world: int, src: int) -> list[str]:
    torch.set_num_threads(1)
    mine = _tensors(100 + rank)
    GroupComm(torch.distributed.group.WORLD).broadcast_coalesced(mine, src=src)
    want = _tensors(100 + src)
    return [f"tensor {i} ({w.dtype}, {tuple(w.shape)})" for i, (m, w) in enumerate(zip(mine, want))
            if m.dtype != w.dtype or m.shape != w.shape or not torch.equal(m, w)]


@pytest.mark.parametrize("world,src", [(2, 0), (3, 2)])
def test_every_dtype_arrives_bit_for_bit(pools, world, src):
    for wrong in pools.run(world, _broadcast, src):
        assert wrong == [], wrong
