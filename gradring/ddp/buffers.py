"""A DDP's module buffers: which ones, whether each forward syncs them, and how.

[Note: buffer sync per forward]
With ``broadcast_buffers=True`` every forward broadcasts rank 0's module
buffers (BatchNorm's running statistics and batch counters). torch's DDP
walks ``named_buffers()`` again before each broadcast, so that a buffer the
model reassigned is the one sent, and then flattens the buffers into a new
tensor per dtype and splits the result back out.

For a ResNet-shaped model (60 buffers over 62 modules) that Python cost more
than the broadcast itself: 0.35 ms to walk, 0.4 ms to flatten and split,
per forward. Two objects keep what the last forward built and only check
that it still holds:

- :class:`BufferWalk` (here) remembers the module tree and its buffers. A
  forward compares, by identity, each module's children and each module's
  buffers with what it saw last time (two list comprehensions); only if
  anything differs (a buffer reassigned, registered or removed, a submodule
  added or replaced) does it walk ``named_buffers()`` again.
- ``ByteStage`` (``gradring/byte_stage.py``, used by ``GroupComm``) keeps one
  byte buffer, in shared memory on one host, laid out with every buffer's
  bytes at a fixed, dtype-aligned offset, and the flat views that copy them
  in and out. The source rank packs with one ``torch.cat`` per dtype, the
  others unpack with one ``torch._foreach_copy_`` per dtype. The stage is
  reused while the tensors are the same objects over the same memory
  (identity, data pointer and shape are compared); otherwise it is laid out
  again.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import distributed as _torch_distributed

from gradring import errors
from gradring.byte_stage import same_objects
from gradring.group_comm import GroupComm

#: Where a buffer comm hook runs, torch's enum itself.
BufferCommHookLocation = _torch_distributed._BufferCommHookLocation


class BufferWalk:
    """``root.named_buffers()`` minus ignored names, walked again only when the
    module tree or its buffers changed (see [Note: buffer sync per forward])."""

    def __init__(self, root: nn.Module, ignore: set[str]) -> None:
        # The module walked, and the buffer names left out (DDP's ignored names).
        self.root = root
        self.ignore = ignore
        # The tree as last seen: modules in pre-order, every module's children,
        # every module's buffer slots (None included), all by identity.
        self._modules: list[nn.Module] = []
        self._children: list[nn.Module | None] = []
        self._slots: list[torch.Tensor | None] = []
        # What named_buffers() gave then.
        self.named: dict[str, torch.Tensor] = {}
        self.buffers: list[torch.Tensor] = []

    def read(self) -> bool:
        """Bring ``buffers`` and ``named`` up to date; True if they changed."""
        mods = self._modules
        if mods:
            children = [c for m in mods for c in m._modules.values()]
            slots = [b for m in mods for b in m._buffers.values()]
            if same_objects(children, self._children) and same_objects(slots, self._slots):
                return False
        self._modules = [m for _, m in self.root.named_modules()]
        self._children = [c for m in self._modules for c in m._modules.values()]
        self._slots = [b for m in self._modules for b in m._buffers.values()]
        named = [(n, b) for n, b in self.root.named_buffers() if n not in self.ignore]
        changed = not same_objects([b for _, b in named], self.buffers)
        self.named = dict(named)
        self.buffers = [b for _, b in named]
        return changed


class BufferSync:
    """All of a DDP's buffer sync: the buffers (read anew before each sync, so
    a reassigned one is the one sent), whether each forward syncs them
    (torch's ``forward_sync_buffers``), and how: a broadcast from one rank, or
    the buffer comm hook registered with ``_register_buffer_comm_hook``."""

    def __init__(self, ignore: set[str], *, each_forward: bool) -> None:
        # The buffer names DDP ignores (its parameters_to_ignore).
        self._ignore = ignore
        # Whether a forward syncs the buffers (torch's forward_sync_buffers).
        self.each_forward = each_forward
        # torch's _BufferCommHook, when one is registered (else rank 0's broadcast).
        self.hook: Any = None
        # The walk that finds the buffers cheaply (built at the first refresh).
        self._walk: BufferWalk | None = None
        # The buffers as last read, in named_buffers() order, and by name
        # (torch's modules_buffers and named_module_buffers).
        self.buffers: list[torch.Tensor] = []
        self.named: dict[str, torch.Tensor] = {}

    def __getstate__(self) -> dict[str, Any]:
        # The walk's identity cache is rebuilt after unpickling.
        return {**self.__dict__, "_walk": None}

    def refresh(self, module: nn.Module) -> None:
        """Read ``module``'s buffers anew; the walk is skipped while the module
        tree is unchanged (see [Note: buffer sync per forward])."""
        walk = self._walk
        if walk is None or walk.root is not module:
            walk = self._walk = BufferWalk(module, self._ignore)
        if walk.read() or not self.buffers:
            self.buffers = list(walk.buffers)
            self.named = dict(walk.named)

    def will_sync(self, param_sync: bool) -> bool:
        """Whether this forward syncs buffers (torch's will_sync_module_buffers)."""
        return bool(param_sync and self.each_forward and len(self.buffers) > 0)

    def before_forward(self, param_sync: bool) -> bool:
        """Whether to sync before the module runs (no hook, or a PRE_FORWARD one)."""
        hook = self.hook
        return self.will_sync(param_sync) and (
            hook is None
            or hook.buffer_comm_hook_location is BufferCommHookLocation.PRE_FORWARD)

    def after_forward(self, param_sync: bool) -> bool:
        """Whether to sync after the module ran (a POST_FORWARD hook)."""
        hook = self.hook
        return self.will_sync(param_sync) and hook is not None and \
            hook.buffer_comm_hook_location is BufferCommHookLocation.POST_FORWARD

    def register_hook(self, state: Any, hook: Any, location: Any) -> None:
        """Sync with ``hook(state, {name: buffer})`` instead of a broadcast."""
        if not callable(hook):
            raise AssertionError(errors.buffer_hook_not_callable(hook))
        self.hook = _torch_distributed._BufferCommHook(
            buffer_comm_hook=hook, buffer_comm_hook_state=state,
            buffer_comm_hook_location=location)

    def sync(self, comm: GroupComm, src: int) -> list[Any] | None:
        """Sync the buffers as last read: the hook's futures (to wait for at the
        end of backward), or None after broadcasting from group rank ``src``."""
        hook = self.hook
        if hook is None:
            self.broadcast(comm, src)
            return None
        futures = hook.buffer_comm_hook(hook.buffer_comm_hook_state, self.named)
        return None if futures is None else list(futures)

    def broadcast(self, comm: GroupComm, src: int) -> None:
        """Broadcast the buffers from group rank ``src``, keeping the byte layout
        for the next forward (see [Note: buffer sync per forward])."""
        with torch.no_grad():
            comm.broadcast_coalesced(self.buffers, src=src, reuse=True)
