"""Where the reducer is in one iteration: ``IterationState``."""

from __future__ import annotations

import enum


class IterationState(enum.Enum):
    """Where the reducer is between two synchronised forwards.

    [Note: the iteration's states]
    One value rather than three flags (whether hooks count, whether a
    finalize is owed, whether one ran since the last forward), so that no
    combination of them can disagree with another::

        IDLE --prepare_for_backward--> EXPECTING --a gradient marked ready--> REDUCING
        REDUCING --finalize--> FINALIZED --next forward, or a later backward's hook--> IDLE
        REDUCING --a failed collective, the unfinished-reduction error, or
                   stepping aside for a newer reducer--> IDLE

    Every way out of an iteration goes through ``Reducer._end_iteration``.
    A forward that finds REDUCING raises the unfinished-reduction error; one
    that finds EXPECTING (its backward never ran) leaves it, so that the next
    backward still reduces, as torch's does. The per-gradient hook reads the
    state once and compares it by identity with module constants.
    """

    #: Hooks are ignored: no synchronised forward since the last iteration ended.
    IDLE = "idle"
    #: A synchronised forward ran; the first gradient of its backward is awaited.
    EXPECTING = "expecting"
    #: Gradients are being marked ready; the finalize must run before the next forward.
    REDUCING = "reducing"
    #: The finalize ran; another backward before the next forward only accumulates.
    FINALIZED = "finalized"
