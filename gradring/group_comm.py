"""The one small interface through which the DDP side talks to collectives.

The reducer never calls a transport or torch.distributed directly: it asks a
``GroupComm`` to all-reduce a flat tensor (getting a future back), to
broadcast a list of tensors from the group's first rank, and to allocate
buffers where the collectives can reach them without a copy.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from gradring import comm
from gradring.byte_stage import ByteStage, byte_layout
from gradring.comm.context import existing_context
from gradring.comm.select import overrides


@functools.cache
def _byte_viewable(dtype: torch.dtype) -> bool:
    """Whether a flat tensor of ``dtype`` can be viewed as bytes (and back)."""
    try:
        torch.zeros(1, dtype=dtype).view(torch.uint8).view(dtype)
    except (RuntimeError, TypeError):
        return False
    return True


class GroupComm:
    """Collectives over one process group, as the DDP side needs them."""

    def __init__(self, group: Any) -> None:
        # The torch process group everything here runs over.
        self.group = group
        # This process's rank inside ``group`` and the group's size.
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        # The per-forward buffer broadcast's byte buffer and layout, kept
        # between calls (broadcast_coalesced(reuse=True)).
        self._stage: ByteStage | None = None

    def all_reduce(self, tensor: torch.Tensor, *, label: str | None = None,
                   on_done: Callable[[Any], None] | None = None,
                   async_op: bool = True) -> torch.futures.Future | None:
        """Sum ``tensor`` in place across the group; the future resolves to ``[tensor]``.
        ``label`` names the collective in errors, desync checks and the flight recorder;
        ``on_done(future)`` runs when it completes (see ``comm.all_reduce``).
        ``async_op=False``: done when this returns (None), on this thread where
        the transport allows (no hand-off to the comm thread)."""
        if not async_op:
            comm.all_reduce(tensor, group=self.group, label=label)
            return None
        work = comm.all_reduce(tensor, group=self.group, async_op=True, label=label,
                               on_done=on_done)
        assert work is not None
        return work.get_future()

    def all_reduce_homed(self, flat: torch.Tensor, pieces: list[tuple[int, torch.Tensor]],
                         scale: float, *, label: str | None = None,
                         on_done: Callable[[Any], None] | None = None,
                         async_op: bool = True) -> torch.futures.Future | None:
        """DDP's bucket all-reduce with gradients left in ``.grad``: ``pieces`` are
        (element offset, flat gradient) pairs sorted by offset, each multiplied by
        ``scale`` where the collective reads it (the all-reduce with external parts:
        [Note: external parts] in ``comm/external.py``).
        ``async_op=False`` as for :meth:`all_reduce`."""
        parts = comm.ExternalParts(pieces, scale)
        if not async_op:
            comm.all_reduce_external(flat, parts, group=self.group, async_op=False,
                                     label=label)
            return None
        work = comm.all_reduce_external(flat, parts, group=self.group, label=label,
                                        on_done=on_done)
        assert work is not None
        return work.get_future()

    @contextlib.contextmanager
    def labelled(self, label: str | None) -> Iterator[None]:
        """Label the collectives issued inside, by code that is not gradring's (a comm
        hook); nothing when ``label`` is None."""
        if label is None:
            yield
        else:
            with comm.label(label):
                yield

    def exchange_lists(self, tag: str, mine: list[int]) -> dict[int, list[int]]:
        """Swap small integer lists with the other ranks through the store (error paths)."""
        from gradring.comm.store import exchange_lists  # local: only on the error path

        return exchange_lists(self, tag, mine)

    def own_range(self, numel: int) -> tuple[int, int]:
        """The part of a ``numel``-element bucket this rank reduces itself."""
        return comm.own_range(numel, self.rank, self.world_size)

    def all_reduce_now(self, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
        comm.all_reduce(tensor, op=op, group=self.group)
        return tensor

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat buffer living where the collectives read it (shared memory on one host)."""
        if device.type == "cpu":
            return comm.empty((numel,), dtype=dtype, group=self.group)
        return torch.empty(numel, dtype=dtype, device=device)

    def _empty_bytes(self, nbytes: int) -> torch.Tensor:
        return self.empty(nbytes, torch.uint8, torch.device("cpu"))

    def global_rank(self, group_rank: int) -> int:
        if self.group is dist.GroupMember.WORLD:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def broadcast_coalesced(self, tensors: Sequence[torch.Tensor], src: int = 0, *,
                            reuse: bool = False) -> None:
        """Overwrite ``tensors`` with group rank ``src``'s values: CPU tensors in
        one collective, as bytes, whatever their dtypes; others one per dtype.

        ``reuse=True`` (the per-forward buffer sync) keeps the byte buffer and its
        layout for the next call with the same tensors (see [Note: buffer sync
        per forward] in ``gradring/ddp/buffers.py``)."""
        if self.world_size == 1 or not tensors:
            return
        src_global = self.global_rank(src)
        if reuse:
            stage = self._stage
            if stage is None or not stage.matches(tensors):
                stage = None
                if all(t.device.type == "cpu" and _byte_viewable(t.dtype) for t in tensors) \
                        and ByteStage.fits(tensors):
                    stage = ByteStage(tensors, self._empty_bytes)
                self._stage = stage
            if stage is not None:
                with torch.no_grad():
                    if self.rank == src:
                        stage.pack()
                    comm.broadcast(stage.buffer, src=src_global, group=self.group)
                    if self.rank != src:
                        stage.unpack()
                return
        by_key: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for t in tensors:
            by_key.setdefault((t.dtype, t.device), []).append(t)
        as_bytes = [(dtype, group) for (dtype, device), group in by_key.items()
                    if device.type == "cpu" and _byte_viewable(dtype)]
        with torch.no_grad():
            if as_bytes:
                self._broadcast_bytes(as_bytes, src, src_global)
            for (dtype, device), group in by_key.items():
                if device.type == "cpu" and _byte_viewable(dtype):
                    continue
                flat = torch.empty(sum(t.numel() for t in group), dtype=dtype, device=device)
                if self.rank == src:
                    flat.copy_(_flatten_dense_tensors(group))
                comm.broadcast(flat, src=src_global, group=self.group)
                if self.rank != src:
                    torch._foreach_copy_(group, _unflatten_dense_tensors(flat, group))

    def _broadcast_bytes(self, groups: list[tuple[torch.dtype, list[torch.Tensor]]], src: int,
                         src_global: int) -> None:
        """One broadcast of a byte buffer holding every group, each flattened at
        an offset aligned for its dtype, so that a model's float buffers and its
        integer batch counters cost one collective and no Python copy per tensor."""
        layout, total = byte_layout(groups)
        buf = torch.empty(total, dtype=torch.uint8)
        if self.rank == src:
            for dtype, group, off, nbytes in layout:
                buf[off:off + nbytes].view(dtype).copy_(_flatten_dense_tensors(group))
        comm.broadcast(buf, src=src_global, group=self.group)
        if self.rank != src:
            for dtype, group, off, nbytes in layout:
                flat = buf[off:off + nbytes].view(dtype)
                torch._foreach_copy_(group, _unflatten_dense_tensors(flat, group))

    def on_shared_memory(self) -> bool:
        """Whether this group's CPU collectives run over the shared-memory transport
        (every rank on this host), as far as known now: False until a collective
        has connected it, after it was given up (see ``transports/group.py``),
        and under GRADRING_TRANSPORT=torch or GRADRING_ALGO=native."""
        forced = overrides()  # cached per environment value: cheap once per backward
        if forced.transport == "torch" or forced.algo == "native":
            return False
        ctx = existing_context(self.group)
        return ctx is not None and ctx.transports.existing_shm() is not None

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out
