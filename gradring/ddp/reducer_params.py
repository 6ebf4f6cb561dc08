"""torch's view of which parameters DDP reduces, by position and by name
(``_build_params_for_reducer`` and ``_build_debug_param_to_name_mapping``).

The order is the module's: modules in ``named_modules()`` order, each one's
own parameters, a parameter shared between modules counted at its first
place; parameters that need no gradient or that DDP ignores are left out.
It is the order gradring's reducer indexes its parameters in.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence

import torch
from torch import nn

from gradring import errors


def _reduced(module: nn.Module, ignored: Collection[str], *, once: bool = True,
             ) -> Iterator[tuple[nn.Module, str, torch.Tensor]]:
    """(owning module, qualified name, parameter) for each parameter DDP reduces:
    at its first place only (``once``), or at every place a shared one has."""
    seen: set[int] = set()
    for prefix, owner in module.named_modules():
        for name, param in owner.named_parameters(recurse=False):
            qualified = f"{prefix}.{name}" if prefix else name
            if not param.requires_grad or qualified in ignored or (once and id(param) in seen):
                continue
            seen.add(id(param))
            yield owner, qualified, param


def params_for_reducer(module: nn.Module, ignored: Collection[str],
                       ) -> tuple[list[torch.Tensor], list[bool]]:
    """The parameters DDP reduces, and for each whether its module makes its
    gradient sparse (an Embedding or EmbeddingBag with ``sparse=True``)."""
    found = list(_reduced(module, ignored))
    sparse = [isinstance(owner, (nn.Embedding, nn.EmbeddingBag)) and bool(owner.sparse)
              for owner, _, _ in found]
    return [p for _, _, p in found], sparse


def index_to_name(module: nn.Module, ignored: Collection[str],
                  parameters: Sequence[torch.Tensor]) -> dict[int, str]:
    """Each position in ``parameters`` -> the qualified name of the parameter
    there. ValueError if a parameter DDP reduces is not among ``parameters``
    or if ``parameters`` holds others. A parameter shared between modules
    gets its last name, as torch's mapping gives it."""
    position = {id(p): i for i, p in enumerate(parameters)}
    mapping: dict[int, str] = {}
    for _, qualified, param in _reduced(module, ignored, once=False):
        if id(param) not in position:
            raise ValueError(errors.param_not_in_reducer(qualified))
        mapping[position[id(param)]] = qualified
    if len(position) != len(mapping):
        raise ValueError(errors.param_mapping_incomplete(len(position), len(mapping)))
    return mapping
