"""Which reducer acts on a parameter's hooks: the owner registry ([Note: owners])."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch


class Owner(Protocol):
    """What the registry asks of a reducer."""

    @property
    def superseded(self) -> bool: ...

    def share(self) -> None: ...

    def step_aside(self) -> None: ...


class Owners:
    """Each parameter's owning reducer.

    [Note: owners]
    Each parameter's hooks belong to every reducer built on it, but only its
    owner, the reducer built or run most recently, acts on them. Wrapping a module
    again while the old wrapper is alive (a second Trainer.fit) makes the old
    reducer step aside: its hooks return at once, as torch's do for a reducer that
    expects no hooks, and never raise "backward twice" or join a reduction of the
    new one. The check costs nothing per gradient: stepping aside clears the
    state the hooks look at. A nested DDP (a DDP wrapping a DDP) hands ownership
    back and forth within one forward, so that both reduce, as torch's do.
    """

    def __init__(self) -> None:
        # id(param) -> (weak param, weak reducer); entries go with their parameter.
        self._by_param: dict[int, tuple[weakref.ref, weakref.ref]] = {}

    def claim(self, owner: Owner, params: Iterable[torch.Tensor], *, again: bool) -> None:
        """Make ``owner`` the owner of ``params``; the previous owners step aside.
        ``again``: an older reducer takes them back, so two act on them and
        both copy (``share``)."""
        me = weakref.ref(owner)
        for p in params:
            entry = self._by_param.get(id(p))
            if entry is not None and entry[0]() is p:
                old = entry[1]()
                if old is not None and old is not owner:
                    if again:
                        old.share()
                        owner.share()
                    if not old.superseded:
                        old.step_aside()
            self._by_param[id(p)] = (weakref.ref(p, self._forgetter(id(p))), me)

    def _forgetter(self, key: int) -> Callable[[Any], None]:
        def forget(_ref: Any) -> None:
            self._by_param.pop(key, None)
        return forget


#: The process's one registry (parameters are shared across every DDP in it).
OWNERS = Owners()
