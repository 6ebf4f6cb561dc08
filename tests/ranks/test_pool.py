import pytest
import torch
import torch.distributed as dist

from tests.support.rankpool import RankFailure


def _sum_ranks(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def _boom(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


def test_pool_runs_real_collectives(pools):
    assert pools.run(2, _sum_ranks) == [1.0, 1.0]


def test_pool_reports_rank_failures(pools):
    with pytest.raises(RankFailure, match="boom on rank 1"):
        pools.run(2, _boom)
    assert pools.run(2, _sum_ranks) == [1.0, 1.0]
