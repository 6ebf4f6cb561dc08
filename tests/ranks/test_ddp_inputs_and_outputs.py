"""What DDP's forward takes and returns, against torch's DDP: namedtuples,
dataclasses and dicts in and out, and inputs moved to the device."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import pytest
import torch
from torch import nn

from tests.support.side_by_side import BOTH, _batch, _equal, _state

pytestmark = pytest.mark.timeout(180)


class Pair(NamedTuple):
    x: torch.Tensor
    scale: torch.Tensor


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    extra: torch.Tensor


class ContainerNet(nn.Module):
    """Takes a namedtuple, a dataclass and a dict; returns a namedtuple and a dataclass."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(5, 3)
        self.side = nn.Linear(5, 3)

    def forward(self, pair: Pair, batch: Batch, opts: dict) -> tuple[Pair, Batch]:
        a = self.fc(pair.x) * pair.scale
        b = self.side(batch.x) + batch.extra
        return Pair(a, b), Batch(a + opts["bias"], b)


def _containers(rank: int, world: int) -> dict:
    out = {}
    for kw in ({}, {"find_unused_parameters": True}, {"static_graph": True}):
        per = {}
        for name, cls in BOTH:
            model = ContainerNet().double()
            ddp = cls(model, **kw)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
            types = []
            for s in range(3):
                opt.zero_grad()
                x = _batch(s, rank)
                res = ddp(Pair(x, torch.full((3,), 2.0, dtype=torch.float64)),
                          Batch(x * 2, torch.ones(3, dtype=torch.float64)),
                          {"bias": torch.zeros(3, dtype=torch.float64)})
                types.append((type(res).__name__, type(res[0]).__name__,
                              type(res[1]).__name__))
                (res[0].x.pow(2).sum() + res[1].x.sum() + res[1].extra.mean()).backward()
                opt.step()
            per[name] = {"state": _state(model), "types": types}
        out[str(kw)] = {"diff": _equal(per["ours"]["state"], per["theirs"]["state"], world),
                        "types": per["ours"]["types"] == per["theirs"]["types"]}
    return out


def test_namedtuple_and_dataclass_inputs_and_outputs(pools) -> None:
    for r in pools.run(2, _containers):
        for kw, res in r.items():
            assert res == {"diff": [], "types": True}, (kw, r)


def test_inputs_move_to_the_device_as_torch_moves_them() -> None:
    """gradring.pytree.to_device against torch's DDP input move (_to_kwargs),
    on the meta device (no accelerator needed): namedtuples, lists, tuples and
    dicts are rebuilt with every tensor moved; torch leaves dataclasses alone,
    gradring moves them too ([Note: container rules])."""
    from torch.distributed.utils import _to_kwargs
    from torch.nn.utils.rnn import pack_sequence

    from gradring import pytree

    meta = torch.device("meta")
    t = torch.ones(2)
    inputs = (Pair(t, t + 1), [t, (t, {"k": t})], {"a": Pair(t, t)})
    kwargs = {"pair": Pair(t, t), "n": 3, "packed": pack_sequence([torch.ones(3), torch.ones(2)])}
    theirs_in, theirs_kw = _to_kwargs(inputs, kwargs, meta, False)
    ours_in, ours_kw = pytree.to_device(inputs, meta), pytree.to_device(kwargs, meta)

    def shape(obj: object) -> object:
        if isinstance(obj, torch.Tensor):
            return ("tensor", obj.device.type)
        if pytree.is_namedtuple(obj):
            return (type(obj).__name__, *[shape(v) for v in obj])
        if isinstance(obj, (list, tuple)):
            return (type(obj).__name__, *[shape(v) for v in obj])
        if isinstance(obj, dict):
            return (type(obj).__name__, {k: shape(v) for k, v in obj.items()})
        return obj

    assert shape(ours_in) == shape(theirs_in[0])
    assert shape(ours_kw) == shape(theirs_kw[0])
    assert shape(ours_in[0]) == ("Pair", ("tensor", "meta"), ("tensor", "meta"))
    # A PackedSequence moves whole: its data goes, its batch_sizes stay on the CPU.
    assert ours_kw["packed"].data.is_meta and ours_kw["packed"].batch_sizes.device.type == "cpu"
    assert theirs_kw[0]["packed"].batch_sizes.device.type == "cpu"
    # torch leaves a dataclass where it was; gradring moves the tensors inside it.
    batch = Batch(t, t)
    assert pytree.to_device(batch, meta).x.is_meta and not _to_kwargs((batch,), {}, meta,
                                                                      False)[0][0][0].x.is_meta
