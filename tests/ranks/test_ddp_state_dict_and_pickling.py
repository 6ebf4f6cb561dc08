"""state_dict keys, load_state_dict, and torch.save/torch.load of a whole DDP."""

from __future__ import annotations

import io

import torch
from torch import nn

import gradring
from tests.support.side_by_side import IMPLS


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


def _caps_after_load(rank, world_size):
    out = {}
    for name, cls in IMPLS.items():
        caps = []
        for kw in ({"bucket_cap_mb": 5}, {"bucket_cap_mb_list": [1, 3]}):
            buf = io.BytesIO()
            torch.save(cls(nn.Linear(3, 2), **kw), buf)
            buf.seek(0)
            back = torch.load(buf, weights_only=False)
            caps.append((back.bucket_bytes_cap, list(back.bucket_bytes_cap_list)))
        out[name] = caps
    return out


def test_loaded_ddp_keeps_its_caps(pools):
    """The reducer of a loaded DDP starts from the caps the saved one had (torch's
    DDP keeps them as attributes; gradring's reducer owns them)."""
    for r in pools.run(2, _caps_after_load):
        assert r["gradring"] == r["torch"] == [(5 << 20, []), (3 << 20, [1 << 20, 3 << 20])]
