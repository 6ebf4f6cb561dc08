"""Tensors nested in containers: one walker, with torch's DDP rules.

[Note: container rules]
A forward's inputs and outputs are free-form: tensors inside lists, tuples,
namedtuples, dicts and dataclasses, nested. gradring walks them in three
places, all here, by one set of rules:

- the inputs moved to ``device_ids[0]`` before the module runs (torch's
  ``_to_kwargs`` / ``_recursive_to``): :func:`to_device`;
- the output tensors whose graph find_unused_parameters walks (torch's
  ``_find_tensors``): :func:`tensors`;
- the outputs routed through the output boundary (torch's ``_tree_flatten``
  around ``_DDPSink``): :func:`tensors`, then :func:`map_tensors` to put the
  routed tensors back in place.

The rules: a tensor is a leaf; a namedtuple is rebuilt field by field with its
own type (torch's ``_is_namedtuple``: a tuple with ``_fields`` and
``_asdict``); any other list or tuple is rebuilt with its own type; a dict is
rebuilt with its own type, keys kept (a ``defaultdict`` keeps its factory); a
dataclass instance is rebuilt with ``dataclasses.replace`` (its ``init``
fields; every field is walked); anything else is returned as is. A
``PackedSequence`` is a namedtuple, but ``to_device`` moves it whole with its
own ``.to``, which keeps ``batch_sizes`` on the CPU as packing needs.

Where torch's walkers disagree with each other, gradring takes the widest:
torch's input move leaves dataclasses alone and turns list and tuple
subclasses into plain lists and tuples, its output flatten leaves
dataclasses and list subclasses whole; gradring reaches tensors in all of
them and keeps every container's type.

This module imports nothing from gradring, so the DDP side and the reducer
side can both use it.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.nn.utils.rnn import PackedSequence

__all__ = ["is_namedtuple", "map_tensors", "tensors", "to_device"]


def is_namedtuple(obj: Any) -> bool:
    """Whether ``obj`` is an instance of a namedtuple type (torch's test)."""
    return isinstance(obj, tuple) and hasattr(obj, "_fields") and hasattr(obj, "_asdict")


def _is_dataclass_instance(obj: Any) -> bool:
    return hasattr(obj, "__dataclass_fields__") and not isinstance(obj, type)


def tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside ``obj``, depth first, in container order ([Note: container rules])."""
    stack = [obj]
    while stack:
        cur = stack.pop()
        if isinstance(cur, torch.Tensor):
            yield cur
        elif isinstance(cur, dict):
            stack.extend(reversed(list(cur.values())))
        elif isinstance(cur, (list, tuple)):
            stack.extend(reversed(cur))
        elif _is_dataclass_instance(cur):
            stack.extend(getattr(cur, f.name) for f in reversed(dataclasses.fields(cur)))


def map_tensors(fn: Callable[[Any], Any], obj: Any,
                whole: tuple[type, ...] = ()) -> Any:
    """``obj`` rebuilt with ``fn`` applied to every tensor, and to every instance
    of a ``whole`` type instead of walking into it ([Note: container rules])."""
    if isinstance(obj, torch.Tensor) or (whole and isinstance(obj, whole)):
        return fn(obj)
    if isinstance(obj, dict):
        pairs = [(k, map_tensors(fn, v, whole)) for k, v in obj.items()]
        if isinstance(obj, collections.defaultdict):
            return type(obj)(obj.default_factory, pairs)
        return type(obj)(pairs)
    if isinstance(obj, tuple) and hasattr(obj, "_fields") and hasattr(obj, "_asdict"):
        # A namedtuple (is_namedtuple, written out: this runs once per container node).
        return type(obj)(*(map_tensors(fn, v, whole) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(fn, v, whole) for v in obj)
    if _is_dataclass_instance(obj):
        return dataclasses.replace(obj, **{f.name: map_tensors(fn, getattr(obj, f.name), whole)
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


def to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor moved to ``device`` (a tensor already there is kept)."""
    return map_tensors(lambda t: t.to(device), obj, (PackedSequence,))
