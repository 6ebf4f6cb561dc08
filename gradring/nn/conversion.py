"""Which batch-norm layers ``SyncBatchNorm.convert_sync_batchnorm`` replaces, and how.

[Note: which batch norms convert_sync_batchnorm converts]
A converted layer runs SyncBatchNorm's forward instead of the old layer's. That
is only right where the old forward *is* batch norm and nothing else, so the
converter decides by the layer's exact class, never by ``isinstance``:

- ``torch.nn.BatchNorm1d/2d/3d`` and ``torch.nn.SyncBatchNorm`` become a
  SyncBatchNorm (``plain``): their forward is batch norm, which SyncBatchNorm
  reproduces over the global batch.
- timm's ``BatchNormAct2d`` and ``SyncBatchNormAct`` (classes named in
  ``FUSED_ACTIVATION``) run batch norm, then their ``drop`` and ``act``
  children. They become a SyncBatchNormAct (``fused``), which keeps those two
  children and calls them after the synchronised statistics, so the layer's
  forward stays the same and only its statistics span the ranks.
- Any other ``_BatchNorm`` subclass (its own forward, e.g. timm's
  ``SplitBatchNorm2d``, a lazy batch norm not yet initialised, a user's
  subclass) is left as it is, and one ``UserWarning`` names each such layer and
  its class: it keeps per-rank statistics. torch's converter replaces every
  ``_BatchNorm`` and silently drops what a subclass's forward added (timm's
  fused activation: a converted mobilenetv3_small_050 gives outputs off by more
  than their own largest value).
- A layer that already is a gradring SyncBatchNorm (or a subclass) is kept.

Children are converted recursively either way, and the new layers take over
the old ones' parameters and buffers (the same tensors).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

#: Classes whose forward is batch norm alone.
PLAIN: tuple[type[nn.Module], ...] = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d,
                                      nn.SyncBatchNorm)

#: (module, qualified name) of classes whose forward is batch norm, then
#: ``self.drop``, then ``self.act``. Matched by name so that timm is never imported here.
FUSED_ACTIVATION: frozenset[tuple[str, str]] = frozenset({
    ("timm.layers.norm_act", "BatchNormAct2d"),
    ("timm.layers.norm_act", "SyncBatchNormAct"),
})


def convert_batchnorms(module: nn.Module, synced: type[nn.Module],
                       plain: Callable[[_BatchNorm], nn.Module],
                       fused: Callable[[_BatchNorm], nn.Module]) -> nn.Module:
    """``module`` with its batch norms replaced (see the Note above).

    ``synced`` is the class that is already synchronised (kept as it is);
    ``plain(bn)`` and ``fused(bn)`` build the replacement of a plain and of a
    fused-activation batch norm.
    """
    left: list[str] = []
    converted = _convert(module, "", synced, plain, fused, left)
    if left:
        warnings.warn(
            "convert_sync_batchnorm left these batch-norm layers as they are: "
            + "; ".join(left) + ". A SyncBatchNorm reproduces the forward of torch's "
            "BatchNorm1d/2d/3d and SyncBatchNorm and of timm's BatchNormAct2d only, and would "
            "drop what another class's forward does. These layers normalise with per-rank "
            "statistics; build them as one of those classes to synchronise them.",
            UserWarning, stacklevel=3)
    return converted


def _convert(module: nn.Module, path: str, synced: type[nn.Module],
             plain: Callable[[_BatchNorm], nn.Module],
             fused: Callable[[_BatchNorm], nn.Module], left: list[str]) -> nn.Module:
    converted = module
    kind = type(module)
    if isinstance(module, synced):
        pass
    elif kind in PLAIN:
        converted = plain(module)
    elif (kind.__module__, kind.__qualname__) in FUSED_ACTIVATION:
        converted = fused(module)
    elif isinstance(module, _BatchNorm):
        left.append(f"{path or '<the module itself>'} ({kind.__module__}.{kind.__qualname__})")
    for name, child in module.named_children():
        child_path = f"{path}.{name}" if path else name
        converted.add_module(name, _convert(child, child_path, synced, plain, fused, left))
    return converted
