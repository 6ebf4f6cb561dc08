"""Are all ranks issuing the same collective? Fingerprints and the checks that use them.

[Note: desync checks]
Collectives pair up by issue order; ranks that disagree (bucket 2 against
bucket 3, other dtypes or sizes) would combine the wrong bytes: garbage, a
hang, or gloo aborting the process. So a *fingerprint* of each collective is
compared before any data is combined: always its sequence number, kind, bytes
and dtype (shm: in every descriptor and mailbox status; the torch transport:
as the message tag, and the watchdog compares the fingerprints waiting ranks
post on the peer board); with ``GRADRING_CHECK=1`` its shape and label too
(the torch transport sends it ahead of the data; native collectives first
all-gather it). A mismatch raises :class:`DesyncError` naming both sides, with
the peer's own words from the board when they arrive in time.
docs/reliability.md ("Desync check") shows the message.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from gradring import config
from gradring.comm.transport import Collective, CollectiveError, Kind, describe_collective

#: dtype <-> small integer, as written into descriptors and fingerprints.
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
          torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
          torch.complex128)
DTYPE_CODES = {d: i + 1 for i, d in enumerate(DTYPES)}
#: Number of int64 words in a fingerprint tensor.
WORDS = 8


class DesyncError(CollectiveError):
    """Ranks issued different collectives (kind, size, dtype, shape or label)."""


#: ``enabled()``: whether ``GRADRING_CHECK`` asks for full fingerprints (shape, label,
#: native), read per collective (see [Note: when the environment is read] in ``config.py``).
enabled = config.view(("check",), lambda c: c.check)


def text_hash(text: str | None) -> int:
    """A hash equal on every rank (Python's ``hash`` of str is salted per process)."""
    return zlib.crc32(text.encode()) if text else 0


def shape_hash(shape: Sequence[int]) -> int:
    return zlib.crc32(repr(tuple(shape)).encode()) if shape else 0


def dtype_name(code: int) -> str:
    return str(DTYPES[code - 1]).replace("torch.", "") if 0 < code <= len(DTYPES) else "?"


def fingerprint_words(seq: int, kind: Kind, nbytes: int, dtype: torch.dtype,
                      shape: Sequence[int], label: str | None, *, full: bool) -> list[int]:
    """A collective's fingerprint, the one definition every check compares:
    ``[seq, kind, nbytes, dtype code, shape hash, label hash, 0, 0]`` (the hashes
    are 0 unless ``full``). shm writes the first six words into its descriptors
    and status block, the torch transport sends or hashes all eight, the peer
    board carries them as a list."""
    return [seq, int(kind), nbytes, DTYPE_CODES.get(dtype, 0),
            shape_hash(shape) if full else 0, text_hash(label) if full else 0, 0, 0]


def fingerprint(info: Collective, *, full: bool) -> torch.Tensor:
    """:func:`fingerprint_words` of ``info`` as an int64 tensor (to send or gather)."""
    return torch.tensor(fingerprint_words(info.seq, info.kind, info.nbytes, info.dtype,
                                          info.shape, info.label, full=full),
                        dtype=torch.int64)


def tag_of(instance: int, fp: torch.Tensor) -> int:
    """A point-to-point message tag from a transport instance and a fingerprint: the
    messages of two different collectives (or instances) never match each other."""
    return zlib.crc32(repr((instance, fp.tolist())).encode()) & 0x7FFFFFFF


def describe_words(words: Sequence[int]) -> str:
    """A fingerprint in words (shape and label appear as "shape/label differ" only)."""
    seq, kind, nbytes, code = (int(w) for w in words[:4])
    name = Kind(kind).label if kind in Kind._value2member_map_ else f"kind {kind}"
    return f"{name} #{seq} ({nbytes} bytes, {dtype_name(code)})"


def difference(mine: Sequence[int], theirs: Sequence[int]) -> str | None:
    """What differs between two fingerprints, or None."""
    names = ("sequence number", "kind", "byte size", "dtype", "shape", "label")
    diff = [n for n, a, b in zip(names, mine, theirs) if int(a) != int(b)]
    return ", ".join(diff) if diff else None


def message(rank: int, mine: str, peer: int, theirs: str, what: str, group: str) -> str:
    """The desync message, the one wording every check uses: ``mine`` and ``theirs``
    describe the two collectives, ``what`` lists the fields that differ."""
    return (f"gradring desync on rank {rank}: rank {rank} issued {mine} but rank {peer} "
            f"issued {theirs} [{what} differ]: ranks issued different collectives "
            f"(group {group})")


def mismatch(info: Collective, rank: int, peer: int, theirs: Sequence[int],
             what: str) -> DesyncError:
    """The error for ``peer`` issuing ``theirs`` (fingerprint words) while ``rank``
    issued ``info``."""
    mine = describe_collective(info.kind.label, info.seq, info.nbytes, info.dtype,
                               info.shape, info.label)
    return DesyncError(message(rank, mine, peer, describe_words(theirs), what, info.group))


def check_native(info: Collective, group: Any, rank: int, world_size: int) -> None:
    """``GRADRING_CHECK=1`` before a native collective: all-gather fingerprints, compare."""
    mine = fingerprint(info, full=True)
    everyone = torch.empty(world_size * WORDS, dtype=torch.int64)
    dist.all_gather_into_tensor(everyone, mine, group=group)
    rows = everyone.view(world_size, WORDS).tolist()
    for p, row in enumerate(rows):
        what = difference(rows[rank], row)
        if what is not None:
            raise mismatch(info, rank, p, row, what)
