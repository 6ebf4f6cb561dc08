"""state_dict keys, load_state_dict, and torch.save/torch.load of a whole DDP."""

from __future__ import annotations

import io

import torch
from torch import nn

import gradring


def _state_dict_and_pickle(rank, world_size):
    ddp = gradring.DistributedDataParallel(nn.Linear(3, 2))
    keys = sorted(ddp.state_dict())
    ddp.load_state_dict(ddp.state_dict())
    buf = io.BytesIO()
    torch.save(ddp, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    same = torch.equal(back.module.weight, ddp.module.weight)
    return keys, same


def test_state_dict_and_torch_save(pools):
    for keys, same in pools.run(2, _state_dict_and_pickle):
        assert keys == ["module.bias", "module.weight"] and same
