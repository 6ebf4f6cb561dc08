"""One collective, described once, from its issue to its end.

[Note: one object per collective]
A :class:`Collective` is made when the caller issues the call (``api.py``,
``runner.small_all_reduce``) and is the one thing every later step reads and
writes: the flight recorder keeps it, the engine runs it, the transport names
it in every descriptor, status block and error, the algorithms get it as
``Call.info``, the watchdog and the failure path describe and fail it. It
holds what the collective is, what it runs on and how it went; its tensors
are dropped when it ends, since the recorder keeps hundreds of collectives.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from gradring.comm import desync, ops
from gradring.comm.transport import Kind, describe_collective


class Collective:
    """One collective: what it is, what it runs on, how it went."""

    __slots__ = ("group", "seq", "kind", "nbytes", "dtype", "shape", "label", "algo",
                 "issued", "started", "ended", "state", "error",
                 "output", "input", "op", "root", "parts", "env")

    #: The fields a dump shows (the rest are the run's arguments).
    SHOWN = ("group", "seq", "kind", "nbytes", "dtype", "shape", "label", "algo",
             "issued", "started", "ended", "state", "error")

    def __init__(self, group: str, seq: int, kind: Kind | str, nbytes: int,
                 dtype: torch.dtype, shape: Sequence[int] = (), label: str | None = None,
                 algo: str = "", *, output: torch.Tensor | None = None,
                 input: torch.Tensor | None = None, op: ops.Op = ops.SUM, root: int = 0,
                 parts: Any = None, env: Any = None) -> None:
        self.group = group  # the process group's name
        self.seq = seq  # per-group issue number, equal on every rank
        self.kind = Kind[kind.upper()] if isinstance(kind, str) else kind
        self.nbytes = nbytes  # bytes of this rank's input
        self.dtype = dtype
        self.shape = tuple(shape)  # the caller's input shape (desync checks, messages)
        self.label = label  # the caller's label, e.g. "DDP bucket 3" (``comm.label``)
        self.algo = algo  # e.g. "direct/twoshot over shm", set when it starts
        self.issued = time.time()  # wall clock: comparable across ranks of one host
        self.started: float | None = None
        self.ended: float | None = None
        self.state = "issued"  # issued -> started -> completed | failed
        self.error = ""
        # What it runs on, until it ends: the tensor written and the one read (the
        # same for in-place collectives), the reduction, the broadcast source (a
        # group rank), external parts (``external.py``) and the GRADRING_TRANSPORT /
        # GRADRING_ALGO overrides at issue (``select.Overrides``).
        self.output = output
        self.input = input
        self.op = op
        self.root = root
        self.parts = parts
        self.env = env

    def start(self, algo: str) -> None:
        self.algo, self.started, self.state = algo, time.time(), "started"

    def finish(self) -> None:
        self.ended, self.state = time.time(), "completed"
        self._drop_tensors()

    def fail(self, error: str) -> None:
        self.ended, self.state, self.error = time.time(), "failed", error
        self._drop_tensors()

    def _drop_tensors(self) -> None:
        self.output = self.input = self.parts = None

    def describe(self) -> str:
        """In words, the same in every message: ``all_reduce #3 (12 bytes, float32,
        shape [3], DDP bucket 0)``, with the algorithm and group once it started."""
        what = describe_collective(self.kind.label, self.seq, self.nbytes, self.dtype,
                                   self.shape, self.label)
        if not self.algo:
            return what
        return f"{what[:-1]}, algo {self.algo}, group {self.group})"

    def fingerprint(self) -> list[int]:
        """``desync.fingerprint_words`` of this collective (what the board compares)."""
        return desync.fingerprint_words(self.seq, self.kind, self.nbytes, self.dtype,
                                        self.shape, self.label, full=desync.enabled())

    def as_dict(self) -> dict[str, Any]:
        """The shown fields, as plain JSON values."""
        d = {k: getattr(self, k) for k in self.SHOWN}
        d["kind"] = self.kind.label
        d["dtype"] = str(self.dtype).replace("torch.", "")
        d["shape"] = list(self.shape)
        return d
