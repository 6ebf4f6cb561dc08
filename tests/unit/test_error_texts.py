"""Error texts that need no process group: the missing-``init_process_group``
advice depends on whether a launcher started the process, and the shape error
names each rank once whichever rank reads it."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch import nn

import gradring
from gradring import errors


def test_not_initialized_under_torchrun_says_the_call_is_missing() -> None:
    msg = errors.not_initialized({"TORCHELASTIC_RUN_ID": "abc", "RANK": "1",
                                  "WORLD_SIZE": "2"})
    assert "launch under torchrun" not in msg
    assert "started by torchrun (RANK=1, WORLD_SIZE=2)" in msg
    assert 'init_process_group("gloo")' in msg


def test_not_initialized_under_another_launcher() -> None:
    msg = errors.not_initialized({"RANK": "0", "WORLD_SIZE": "4"})
    assert "launch under torchrun" not in msg
    assert "started by the launcher (RANK=0, WORLD_SIZE=4)" in msg


def test_not_initialized_without_a_launcher_suggests_torchrun() -> None:
    msg = errors.not_initialized({})
    assert msg.startswith("Default process group has not been initialized, please make sure "
                          "to call init_process_group (or launch under torchrun)")
    assert "torchrun --nproc-per-node=N" in msg


@pytest.mark.parametrize("env, phrase", [
    ({"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "2"}, "started by torchrun"),
    ({}, "RANK is not set"),
])
def test_constructor_reads_the_environment(monkeypatch, env, phrase) -> None:
    if dist.is_available() and dist.is_initialized():
        pytest.skip("this process has a process group")
    for var in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    with pytest.raises(ValueError) as caught:
        gradring.DistributedDataParallel(nn.Linear(2, 2))
    assert phrase in str(caught.value)


def test_shape_mismatch_on_a_third_rank_names_both_sides() -> None:
    """Rank 2 agrees with rank 0; the mismatch is rank 1's."""
    msg = errors.param_shape_mismatch(0, "0.weight", "sizes", [32, 16], [64, 16], 1,
                                      this_rank=2, mine=[64, 16])
    assert ("this process (rank 2) has sizes [64, 16], rank 1 has [32, 16], "
            "rank 0 has [64, 16].)") in msg
    assert msg.endswith(errors.SAME_MODEL)


def test_count_mismatch_ends_with_the_fix() -> None:
    msg = errors.param_count_mismatch([4, 2])
    assert msg.startswith("DDP expects same model across all ranks, but Rank 0 has 4 params, "
                          "while rank 1 has inconsistent 2 params.")
    assert msg.endswith(errors.SAME_MODEL)


def test_static_graph_unused_error_ends_with_the_fix() -> None:
    msg = errors.unfinished_reduction({0: [1], 1: [1]}, ["a", "b"], static_graph=True,
                                      world_size=2)
    assert msg.splitlines()[-1] == ("To fix: use the same parameters in every iteration, or "
                                    "construct DDP with static_graph=False and "
                                    "find_unused_parameters=True.")
