"""Sparse gradients whose ids repeat many times in a batch, against torch's DDP, to the last bit.

torch's DDP divides a rank's sparse gradient by the world size, coalesces it
(summing the repeated rows) and adds the ranks' coalesced tensors: at world 2
its result is ``(coalesce(g0) + coalesce(g1)) / 2`` exactly. Summing the
repeated rows in another order (as ``to_dense()`` of the uncoalesced gradient
does) is 1 ulp off. Checked with a plain synchronised step and with a
``no_sync()`` micro-batch before it (whose gradient the synced one adds to).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gradring

pytestmark = pytest.mark.timeout(300)


def _ids(step: int, rank: int) -> torch.Tensor:
    """Ids 0..19 several times (repeats of 3 to 6), shuffled per rank and step."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.arange(20).repeat(3 + (step + rank) % 4)
    return ids[torch.randperm(len(ids), generator=g)]


def _train(rank: int, world: int, rows: int, micro: bool) -> list[str]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = nn.Embedding(rows, 16, sparse=True)
    models = [cls(copy.deepcopy(base)) for cls in (gradring.DistributedDataParallel,
                                                   nn.parallel.DistributedDataParallel)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    wrong = []
    for step in range(3):
        for m, opt in zip(models, opts):
            opt.zero_grad(set_to_none=True)
            w = torch.randn(16, generator=torch.Generator().manual_seed(step))
            if micro:
                with m.no_sync():
                    (m(_ids(step + 7, rank)) * w).tanh().sum().backward()
            (m(_ids(step, rank)) * w).tanh().sum().backward()
        ours, theirs = (m.module.weight.grad for m in models)
        if not (ours.is_sparse and theirs.is_sparse):
            wrong.append(f"step {step}: layouts {ours.layout} / {theirs.layout}")
            continue
        ours_c, theirs_c = ours.coalesce(), theirs.coalesce()
        if not torch.equal(ours_c.indices(), theirs_c.indices()):
            wrong.append(f"step {step}: indices differ")
        elif not torch.equal(ours_c.values(), theirs_c.values()):
            diff = (ours_c.values() - theirs_c.values()).abs().max().item()
            wrong.append(f"step {step}: values differ by up to {diff:.3g}")
        if ours._nnz() != theirs._nnz() or ours.is_coalesced() != theirs.is_coalesced():
            wrong.append(f"step {step}: nnz/coalesced {ours._nnz()}/{ours.is_coalesced()} vs "
                         f"{theirs._nnz()}/{theirs.is_coalesced()}")
        for opt in opts:
            opt.step()
        if not torch.equal(models[0].module.weight, models[1].module.weight):
            wrong.append(f"step {step}: weights differ after the step")
    torch.distributed.barrier()
    return wrong


# 1000 rows: the table; 50 and 40000 take the other two put paths
# (a packed slot, and one put at its own hook; see tests/ranks/test_sparse_grads.py).
@pytest.mark.parametrize("rows", [1000, 50, 40000])
@pytest.mark.parametrize("micro", [False, True], ids=["synced", "no_sync_first"])
def test_repeated_ids_match_torch_bit_for_bit(pools, rows, micro) -> None:
    for wrong in pools.run(2, _train, rows, micro, timeout=200):
        assert not wrong, wrong
