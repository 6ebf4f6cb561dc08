"""The reducer's fast paths: what each one is, and the switch that turns it off.

[Note: the core and its fast paths]
The reducer's *core* does what torch's Reducer does and nothing more: every
gradient is copied into its bucket slot (scaled by 1/world_size) by its own
hook, or becomes the slot under ``gradient_as_bucket_view``; buckets launch
asynchronously in index order as they fill; the finalize waits for each and
copies the results back into ``.grad``. It is the oracle: every fast path
below must give the same bits and the same errors as the core, in every
case, and ``tests/ranks/test_reducer_fuzz.py`` runs seeded random models and
training patterns under the core, under the default, and under each fast
path alone to check it.

A fast path is a special case that won a paired measurement beyond the
spread (``benchmarks/ablation.py``; the figures are in docs/design.md,
"Fast paths, measured"). Each is one name in ``GRADRING_FAST_PATHS``, one
object per bucket in its own file that owns its state (``buckets/homed.py``,
``buckets/packed.py``), and one line of ``TABLE`` below:

- ``homed``: a CPU bucket's gradient stays in ``.grad``; only the part the
  peers read is copied into the bucket, and the collective writes the result
  straight back into ``.grad`` ([Note: external parts] in ``comm/external.py``).
  Only where gradient and slot are both row-major: homing moves flat memory.
- ``packed``: slots of at most ``SMALL_SLOT_NUMEL`` elements are copied in
  and out a bucket at a time, by batched calls, when the bucket is ready
  ([Note: packed slots] in ``buckets/packing.py``).
Four more were measured the same way and removed: ``held`` (small slots
put in when their bucket is ready), ``at_end`` (every bucket reduced at the
end of the backward on a host with no free core), ``joined`` (those buckets
as one collective) and ``inline_last`` (the last bucket reduced by the
finalize on its own thread), which showed no win beyond what an identical
configuration shows by chance. Lent gradients and end counting are not
fast paths at all: they could give wrong results (see docs/design.md).

``GRADRING_FAST_PATHS`` is ``all`` (the default), ``none`` (the core), a
comma-separated list of the names to keep, or of names each prefixed with
``-`` to drop from all. It is read when a DDP is built and at its bucket
rebuild, and rank 0's set travels with rank 0's bucket assignment, so every
rank takes the same paths.
"""

from __future__ import annotations

from typing import Any

from gradring.buckets.homed import HomedPath
from gradring.buckets.packed import PackedPath

#: Every fast path: its name and its class, in the order slots are offered to
#: them (see [Note: slot kinds] in ``buckets/bucket.py``). Removing a fast
#: path is deleting its file and its line here.
TABLE: tuple[tuple[str, Any], ...] = (
    ("packed", PackedPath),
    ("homed", HomedPath),
)

#: Every fast path's name, in the order of the bits rank 0 broadcasts.
NAMES = tuple(name for name, _ in TABLE)


class FastPaths:
    """Which fast paths are on (see [Note: the core and its fast paths]):
    ``FastPaths(packed=False)``; ``.homed`` says whether one is on."""

    __slots__ = ("on",)

    def __init__(self, **on: bool) -> None:
        unknown = [n for n in on if n not in NAMES]
        if unknown:
            raise TypeError(f"unknown fast path(s) {', '.join(unknown)}")
        self.on = frozenset(n for n in NAMES if on.get(n, True))

    def __getattr__(self, name: str) -> bool:
        if name in NAMES:
            return name in self.on
        raise AttributeError(name)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FastPaths) and self.on == other.on

    def __hash__(self) -> int:
        return hash(self.on)

    def __repr__(self) -> str:
        return f"FastPaths({self.describe()})"

    def classes(self) -> list[Any]:
        """The classes of the fast paths that are on, in offering order."""
        return [cls for name, cls in TABLE if name in self.on]

    def bits(self) -> int:
        """The set as an integer (bit k: ``NAMES[k]`` is on), for a broadcast."""
        return sum(1 << k for k, name in enumerate(NAMES) if name in self.on)

    @classmethod
    def from_bits(cls, bits: int) -> FastPaths:
        return cls(**{name: bool(bits >> k & 1) for k, name in enumerate(NAMES)})

    def describe(self) -> str:
        on = [name for name in NAMES if name in self.on]
        return "all" if len(on) == len(NAMES) else ",".join(on) or "none"


#: Every fast path on (the default), and the core (none on).
ALL = FastPaths()
CORE = FastPaths(**{name: False for name in NAMES})


def parse(text: str) -> FastPaths:
    """``GRADRING_FAST_PATHS``'s value as a set; ValueError names what is wrong."""
    value = text.strip().lower()
    if value in ("", "all"):
        return ALL
    if value == "none":
        return CORE
    items = [item.strip() for item in value.split(",") if item.strip()]
    dropping = [item.startswith("-") for item in items]
    if any(dropping) and not all(dropping):
        raise ValueError("either names to keep or names to drop (each with '-'), not both")
    names = [item.lstrip("-") for item in items]
    unknown = [n for n in names if n not in NAMES]
    if unknown:
        raise ValueError(f"unknown fast path(s) {', '.join(unknown)}; the names are "
                         f"{', '.join(NAMES)}")
    if all(dropping):
        return FastPaths(**{name: name not in names for name in NAMES})
    return FastPaths(**{name: name in names for name in NAMES})
