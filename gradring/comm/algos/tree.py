"""Tree collectives over any point-to-point transport: latency over bandwidth.

All-reduce is a *double binary tree* (NCCL's, docs/collectives.md): each half
of the buffer is reduced up and broadcast down its own balanced tree, the
second shifted by one rank; ``2·ceil(log2 W)`` hops against ring's ``2(W-1)``.
Inner nodes reduce in a fixed order (own, left, right), not arrival order, and
the root finishes AVG before broadcasting, so every rank gets the root's bits.
Every node handles tree 0 before tree 1 in each phase, and a tree's messages
wait only on that tree's neighbours, so the two advance together without
deadlock ([Note: requests progress in wait_all]).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from gradring.comm import ops
from gradring.comm.ops import Op
from gradring.comm.transport import Transport


class TreeLinks(NamedTuple):
    """One rank's place in one tree."""

    parent: int  # -1 at the root
    children: tuple[int, ...]  # at most two, left first


def inorder_tree(w: int) -> list[TreeLinks]:
    """Balanced binary tree over positions ``0..w-1`` whose in-order walk is 0, 1, 2, ...

    The root is the middle position; each half recursively forms a subtree.
    """
    parent = [-1] * w
    children: list[list[int]] = [[] for _ in range(w)]
    stack = [(0, w - 1, -1)]
    while stack:
        lo, hi, par = stack.pop()
        if lo > hi:
            continue
        mid = (lo + hi) // 2
        parent[mid] = par
        if par >= 0:
            children[par].append(mid)
        # Push right first so the left child is attached first.
        stack.append((mid + 1, hi, mid))
        stack.append((lo, mid - 1, mid))
    return [TreeLinks(parent[p], tuple(sorted(children[p]))) for p in range(w)]


def double_tree(rank: int, w: int) -> tuple[TreeLinks, TreeLinks]:
    """This rank's links in tree 0 (rank = position) and tree 1 (position = rank + 1)."""
    base = inorder_tree(w)
    t0 = base[rank]
    pos = (rank + 1) % w
    to_rank = lambda p: (p - 1) % w if p >= 0 else -1
    t1 = TreeLinks(to_rank(base[pos].parent), tuple(to_rank(c) for c in base[pos].children))
    return t0, t1


def all_reduce(t: Transport, flat: torch.Tensor, op: Op) -> None:
    """Double-binary-tree all-reduce of ``flat`` in place."""
    w = t.world_size
    if w == 1:
        ops.finish(flat, op, w)
        return
    half = flat.numel() // 2
    data = (flat[:half], flat[half:])
    trees = double_tree(t.rank, w)
    live = [k for k in (0, 1) if data[k].numel()]

    # Up: post every receive from children first, then reduce and forward tree by tree.
    tmps = {k: [torch.empty_like(data[k]) for _ in trees[k].children] for k in live}
    recvs = {k: [t.irecv(buf, c) for buf, c in zip(tmps[k], trees[k].children)] for k in live}
    sends: list[Any] = []
    for k in live:
        t.wait_all(recvs[k])
        ops.reduce_into(data[k], [data[k], *tmps[k]], op)
        if trees[k].parent >= 0:
            sends.append(t.isend(data[k], trees[k].parent))
        else:
            ops.finish(data[k], op, w)
    t.wait_all(sends)  # data[k] is overwritten by the broadcast below

    # Down: receive the result from the parent, pass it to the children.
    down = {k: t.irecv(data[k], trees[k].parent) for k in live if trees[k].parent >= 0}
    sends = []
    for k in live:
        if k in down:
            t.wait_all([down[k]])
        sends += [t.isend(data[k], c) for c in trees[k].children]
    t.wait_all(sends)


def broadcast(t: Transport, flat: torch.Tensor, src: int) -> None:
    """Binomial-tree broadcast of ``flat`` from group rank ``src`` (``ceil(log2 W)`` hops)."""
    w = t.world_size
    if w == 1 or flat.numel() == 0:
        return
    vr = (t.rank - src) % w  # rank relative to the root
    low = vr & -vr if vr else 1 << max(0, (w - 1).bit_length())
    if vr:
        t.wait_all([t.irecv(flat, ((vr & (vr - 1)) + src) % w)])
    sends = []
    mask = low >> 1
    while mask:  # biggest subtree first
        if vr + mask < w:
            sends.append(t.isend(flat, (vr + mask + src) % w))
        mask >>= 1
    t.wait_all(sends)


def barrier(t: Transport) -> None:
    """Every rank returns only after every rank has entered (a 1-element tree all-reduce)."""
    all_reduce(t, torch.zeros(1, dtype=torch.int32), ops.SUM)
