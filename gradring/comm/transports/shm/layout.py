"""Where everything lives in a rank's control segment: every offset, once.

Each rank owns a *control segment* that every peer maps. Below, in the order
they lie in it: the header and naming key ([Note: segment names and leaks] in
``segments.py``), the barrier word and doorbell, the status block
(``status.py``), two descriptor slots, the verdict and lock holder (rank 0's
segment only) and the reason in words (``verdict.py``), the retired-segment
ring, one mailbox channel per peer, two inline data slots
(``ShmTransport.exchange_inline``) and, page-aligned, the mailbox slots; the
asserts at the end keep them apart. Offsets are in bytes; ``*_WORD`` names are
indices into the segment's 32-bit word view (the hot loops' and the futexes').
"""

from __future__ import annotations

import mmap
import struct

# -- header -------------------------------------------------------------------------
#: Written first in every control segment ("grdring1").
MAGIC = 0x31676E6972647267
#: magic, pid, rank, world, reserved, cookie; at byte 0.
HEADER = struct.Struct("<QIIIIQ")
#: The owner's naming key: peers derive the names of its data segments from it. It
#: travels only here (a mode-0600 segment), never through the store.
KEY_OFF = 32
KEY_BYTES = 16

# -- barrier and doorbell -----------------------------------------------------------------
#: Number of barriers this rank has arrived at (written by the owner only).
BARRIER_WORD = 64 // 4
#: Bumped (atomically) by any peer that moved a mailbox towards or from this rank.
DOORBELL_WORD = 128 // 4

# -- status block (status.py) ---------------------------------------------------------------
# =========  ======  =====================================================
# offset     type    meaning
# =========  ======  =====================================================
# 192        u64     sequence number of the collective started last
# 200        u32     its kind (``Kind``)
# 204        u32     state: running, closed (shut gradring down), failed
# 208        u64     its byte size
# 216        u32     its dtype code (``desync.DTYPE_CODES``)
# 220        u32     why the rank failed (timed out, lost a peer, ...)
# 224        u64     its shape hash (``GRADRING_CHECK`` only, else 0)
# 232        u32     version: odd while the owner rewrites the block
# =========  ======  =====================================================
STATUS_OFF = 192
#: seq (u64), kind, state, nbytes (u64), dtype, why, shape hash (u64), then the version.
STATUS = struct.Struct("<QIIQIIQ")
STATUS_STATE_WORD = (STATUS_OFF + 12) // 4
STATUS_WHY_WORD = (STATUS_OFF + 28) // 4
STATUS_VERSION_WORD = (STATUS_OFF + 40) // 4

# -- descriptors (exchange of the direct algorithms) ------------------------------------------
#: seq, kind, flags, nbytes, dtype, segno, offset, shape hash, label hash.
DESC = struct.Struct("<QIIQIIQQQ")
DESC_OFF = 256
DESC_STRIDE = 64


def desc_offset(slot: int) -> int:
    """Byte offset of descriptor slot ``slot`` (0 or 1)."""
    return DESC_OFF + DESC_STRIDE * slot


# -- verdict (verdict.py) ------------------------------------------------------------------
#: In rank 0's segment: 1 + the rank that failed first (0: none yet), then the low
#: 32 bits of that collective's sequence number. Written under the group's lock.
VERDICT_WORD = 384 // 4
#: In rank 0's segment: 1 + the rank holding the group's lock (0: nobody), written by
#: the holder, so that a rank that cannot get the lock can name (and check) its holder.
LOCK_HOLDER_WORD = 392 // 4
#: This rank's own failure, in words: byte length (u32), then UTF-8 text.
REASON_OFF = 640
REASON_BYTES = 384

# -- retired segments ---------------------------------------------------------------------
#: Count of retirements announced, then ``RETIRED_RING`` segment numbers.
RETIRED_WORD = 448 // 4
RETIRED_RING = 30

# -- mailbox channels ---------------------------------------------------------------------
CHAN_OFF = 1024
#: sent, acked and lengths on separate cache lines.
CHAN_STRIDE = 192
#: Words of a channel header: fragments sent, fragments acked, length of slot k
#: (``CHAN_LEN + k``), highest segno of the peer's segments mapped here.
CHAN_SENT, CHAN_ACKED, CHAN_LEN, CHAN_MAPPED = 0, 16, 32, 40

#: Mailbox geometry: slots per (sender, receiver) pair and bytes per slot.
SLOTS = 4
SLOT_BYTES = 256 * 1024


def chan_word(peer: int, which: int) -> int:
    """Word index of field ``which`` of the channel towards ``peer``."""
    return (CHAN_OFF + CHAN_STRIDE * peer) // 4 + which


# -- inline data ---------------------------------------------------------------------------
#: Bytes of one inline data slot: the largest all-reduce whose input travels in the
#: control segment itself (``select.INLINE_MAX_BYTES`` follows it).
INLINE_BYTES = 64 * 1024


def inline_offset(world_size: int, slot: int) -> int:
    """Byte offset of inline data slot ``slot`` (0 or 1), 64-byte aligned."""
    end = CHAN_OFF + CHAN_STRIDE * world_size
    return -(-end // 64) * 64 + INLINE_BYTES * slot


def slots_offset(world_size: int) -> int:
    """Byte offset of the first mailbox slot in a control segment."""
    end = inline_offset(world_size, 2)
    return -(-end // mmap.PAGESIZE) * mmap.PAGESIZE


def control_size(world_size: int) -> int:
    """Bytes of one rank's control segment, mailbox slots included."""
    return slots_offset(world_size) + world_size * SLOTS * SLOT_BYTES


assert HEADER.size <= KEY_OFF and KEY_OFF + KEY_BYTES <= BARRIER_WORD * 4, "key overlaps"
assert VERDICT_WORD + 2 <= LOCK_HOLDER_WORD < RETIRED_WORD, "lock holder overlaps"
assert RETIRED_WORD * 4 + 4 * (1 + RETIRED_RING) <= REASON_OFF, "retired ring overlaps reason"
assert REASON_OFF + REASON_BYTES <= CHAN_OFF, "reason text overlaps the channels"
assert STATUS_OFF + 44 <= DESC_OFF, "status block overlaps the descriptors"
