"""The one small interface through which the DDP side talks to collectives.

The reducer never calls a transport or torch.distributed directly: it asks a
``GroupComm`` to all-reduce a flat tensor (getting a future back), to
broadcast a list of tensors from the group's first rank, and to allocate
buffers where the collectives can reach them without a copy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from gradring import comm


class GroupComm:
    """Collectives over one process group, as the DDP side needs them."""

    def __init__(self, group: Any) -> None:
        # The torch process group everything here runs over.
        self.group = group
        # This process's rank inside ``group`` and the group's size.
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def all_reduce(self, tensor: torch.Tensor, *, label: str | None = None,
                   ) -> torch.futures.Future:
        """Sum ``tensor`` in place across the group; the future resolves to ``[tensor]``.
        ``label`` names the collective in errors, desync checks and the flight recorder."""
        with self.labelled(label):
            return comm.all_reduce(tensor, group=self.group, async_op=True).get_future()

    def all_reduce_homed(self, flat: torch.Tensor, pieces: list[tuple[int, torch.Tensor]],
                         scale: float, *, label: str | None = None) -> torch.futures.Future:
        """DDP's bucket all-reduce with gradients left in ``.grad``: ``pieces`` are
        (element offset, flat gradient) pairs sorted by offset, each multiplied by
        ``scale`` where the collective reads it (see [Note: homed all-reduce])."""
        with self.labelled(label):
            work = comm.all_reduce_homed(flat, comm.Homes(pieces, scale), group=self.group)
        assert work is not None
        return work.get_future()

    @contextlib.contextmanager
    def labelled(self, label: str | None) -> Iterator[None]:
        """Label the collectives issued inside (nothing when ``label`` is None)."""
        if label is None:
            yield
        else:
            with comm.label(label):
                yield

    def exchange_lists(self, tag: str, mine: list[int]) -> dict[int, list[int]]:
        """Swap small integer lists with the other ranks through the store (error paths)."""
        from gradring._store import exchange_lists  # local: only on the error path

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

    def global_rank(self, group_rank: int) -> int:
        if self.group is dist.GroupMember.WORLD:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def broadcast_coalesced(self, tensors: Sequence[torch.Tensor], src: int = 0) -> None:
        """Overwrite ``tensors`` with group rank ``src``'s values, one collective per dtype."""
        if self.world_size == 1 or not tensors:
            return
        src_global = self.global_rank(src)
        by_key: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for t in tensors:
            by_key.setdefault((t.dtype, t.device), []).append(t)
        for (dtype, device), group in by_key.items():
            total = sum(t.numel() for t in group)
            flat = torch.empty(total, dtype=dtype, device=device)
            if self.rank == src:
                torch.cat([t.detach().reshape(-1) for t in group], out=flat)
            comm.broadcast(flat, src=src_global, group=self.group)
            if self.rank != src:
                offset = 0
                with torch.no_grad():
                    for t in group:
                        n = t.numel()
                        t.copy_(flat[offset:offset + n].view_as(t))
                        offset += n

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out
