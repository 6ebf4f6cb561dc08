"""PowerSGD: low-rank gradient compression (Vogels et al., 2019, arXiv:1905.13727).

A gradient matrix M (n x m; a conv weight is viewed as out_channels x rest) is
replaced by the product of two thin matrices P (n x r) and Q (m x r). One step
of power iteration per training step finds them:

    P = sum_ranks(M_i Q)          all-reduce #1, n*r numbers
    P = orthonormalise(P)
    Q = sum_ranks(M_i^T P) / N    all-reduce #2, m*r numbers
    M_mean ~= P Q^T

so the wire carries (n + m) * r numbers instead of n * m. Q is kept from one
step to the next (warm start) so the iteration keeps improving on a slowly
changing gradient, and what the approximation dropped is added back into the
next step's gradient (error feedback), so nothing is lost for good.

Tensors with fewer than two dimensions, and matrices too small for the
compression to pay (``(n + m) * r * min_compression_rate >= n * m``), are
concatenated and averaged by one plain all-reduce, issued together with
all-reduce #1. For the first ``start_powerSGD_iter`` iterations every bucket
is plainly all-reduced.

The hooks issue two rounds of collectives; see
[Note: launch order of chained collectives] in ``_collectives.py``.
"""

import logging
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from gradring.hooks._collectives import (
    GradBucket,
    HookResult,
    all_reduce,
    chain,
    mean_all_reduce,
    sequencer,
    views_of,
    world_size_of,
)

__all__ = ["PowerSGDState", "batched_powerSGD_hook", "powerSGD_hook"]

_log = logging.getLogger(__name__)
Future = torch.futures.Future


class PowerSGDState:
    """Hyperparameters and per-bucket memory of the PowerSGD hooks.

    Per-bucket memory is keyed by ``bucket.index()``. It is dropped and rebuilt
    if a bucket's layout changes size, but DDP's one bucket rebuild after the
    first iteration may also reorder parameters, which is why error feedback
    and warm start require ``start_powerSGD_iter > 1``.
    """

    # Field names follow torch's PowerSGDState, so code that inspects one works on the other.
    __slots__ = (
        # hyperparameters
        "process_group", "matrix_approximation_rank", "start_powerSGD_iter",
        "min_compression_rate", "use_error_feedback", "warm_start",
        "orthogonalization_epsilon", "batch_tensors_with_same_shape",
        # per-bucket memory
        "rng", "error_dict", "p_memory_dict", "q_memory_dict",
        # counters
        "iter", "total_numel_before_compression", "total_numel_after_compression",
        "compression_stats_logging_frequency", "next_stats_report",
    )

    def __init__(
        self,
        process_group: Any,
        matrix_approximation_rank: int = 1,
        start_powerSGD_iter: int = 1_000,
        min_compression_rate: float = 2,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        orthogonalization_epsilon: float = 0,
        random_seed: int = 0,
        compression_stats_logging_frequency: int = 10_000,
        batch_tensors_with_same_shape: bool = False,
    ) -> None:
        if matrix_approximation_rank < 1:
            raise ValueError(
                f"matrix_approximation_rank must be >= 1, got {matrix_approximation_rank}")
        if start_powerSGD_iter <= 1 and (use_error_feedback or warm_start):
            raise ValueError(
                f"start_powerSGD_iter must be > 1 when use_error_feedback or warm_start is "
                f"on (got {start_powerSGD_iter}): DDP rebuilds its buckets after iteration 1, "
                f"which would invalidate the stored error and Q.")
        if min_compression_rate <= 0:
            raise ValueError(f"min_compression_rate must be > 0, got {min_compression_rate}")
        if orthogonalization_epsilon < 0:
            raise ValueError(
                f"orthogonalization_epsilon must be >= 0, got {orthogonalization_epsilon}")
        # Group to communicate over; None means the default group.
        self.process_group: Any = process_group
        # r: columns of P and Q. Smaller r, stronger compression.
        self.matrix_approximation_rank: int = matrix_approximation_rank
        # Iterations of plain all-reduce before compression starts.
        self.start_powerSGD_iter: int = start_powerSGD_iter
        # Compress a matrix only if that shrinks it at least this many times.
        self.min_compression_rate: float = min_compression_rate
        # Add what the last approximation dropped to the next gradient.
        self.use_error_feedback: bool = use_error_feedback
        # Start each step's power iteration from the previous step's Q.
        self.warm_start: bool = warm_start
        # Added to column norms when orthonormalising (guards all-zero columns).
        self.orthogonalization_epsilon: float = orthogonalization_epsilon
        # Compress same-shaped matrices of a bucket in one batched matmul.
        self.batch_tensors_with_same_shape: bool = batch_tensors_with_same_shape
        # Source of the initial Qs; seeded alike on every rank, so the Qs agree.
        self.rng = np.random.default_rng(random_seed)
        # bucket index -> flat local error left by the last approximation
        self.error_dict: dict[int, Tensor] = {}
        # bucket index -> flat storage of every P of the bucket
        self.p_memory_dict: dict[int, Tensor] = {}
        # bucket index -> flat storage of every Q of the bucket (warm start)
        self.q_memory_dict: dict[int, Tensor] = {}
        # Iterations seen so far (counted on each iteration's last bucket).
        self.iter: int = 0
        # Compression accounting, in elements, since compression started.
        self.total_numel_before_compression: int = 0
        self.total_numel_after_compression: int = 0
        # Log the compression rate every this many iterations.
        self.compression_stats_logging_frequency = max(1, compression_stats_logging_frequency)
        # Iteration at which the stats are logged next.
        self.next_stats_report: int = 0

    def __getstate__(self) -> dict[str, Any]:
        """Everything but the process group, which cannot be pickled."""
        return {k: getattr(self, k) for k in self.__slots__ if k != "process_group"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore; the process group becomes the default group (set it again if needed)."""
        self.process_group = None
        for k, v in state.items():
            setattr(self, k, v)

    def count_iteration(self, bucket: Any) -> None:
        """Count one iteration per backward, on its last bucket."""
        if not bucket.is_last():
            return
        self.iter += 1
        if self.start_powerSGD_iter == self.iter:
            _log.info("PowerSGD compression starts after %d iterations", self.iter)

    # torch's name for it
    maybe_increase_iter = count_iteration

    def compression_stats(self) -> tuple[float, int, int]:
        """(rate, elements before, elements after) since compression started; rate 0 if none."""
        before = self.total_numel_before_compression
        after = self.total_numel_after_compression
        return (before / after if after else 0.0, before, after)

    def report_compression_stats(self, bucket: Any) -> None:
        if bucket.is_last() and self.iter >= self.next_stats_report:
            rate, before, after = self.compression_stats()
            _log.info("PowerSGD iter %d: %d elements compressed to %d (rate %.1fx)",
                        self.iter, before, after, rate)
            self.next_stats_report = self.iter + self.compression_stats_logging_frequency

    def random_like(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``numel`` standard normal numbers, the same on every rank with the same seed."""
        values = torch.from_numpy(self.rng.standard_normal(numel))
        return values.to(device=device, dtype=dtype)


# --------------------------------------------------------------------- numerics
def orthonormalize_(matrices: torch.Tensor, epsilon: float = 0.0) -> torch.Tensor:
    """Make the columns of each matrix in a (batch, n, r) stack orthonormal, in place.

    Modified Gram-Schmidt for r <= 2 or 16-bit dtypes (QR has no half kernels),
    a QR factorisation otherwise. A column that is (numerically) zero becomes
    zero instead of NaN.
    """
    rank = matrices.shape[-1]
    if matrices.numel() == 0:
        return matrices
    if rank > 2 and matrices.dtype not in (torch.float16, torch.bfloat16) and epsilon == 0:
        q, r = torch.linalg.qr(matrices)
        # A zero column of the input leaves a zero on R's diagonal; keep it zero.
        keep = (r.diagonal(dim1=-2, dim2=-1).abs() > 0).unsqueeze(-2)
        matrices.copy_(q * keep)
        return matrices
    for j in range(rank):
        col = matrices[..., j:j + 1]
        norm = col.norm(dim=-2, keepdim=True)
        if epsilon:
            col.div_(norm + epsilon)
        else:
            col.copy_(torch.where(norm > 0, col / norm.clamp_min(torch.finfo(col.dtype).tiny),
                                  torch.zeros_like(col)))
        if j + 1 < rank:
            rest = matrices[..., j + 1:]
            rest.sub_(col * (col * rest).sum(dim=-2, keepdim=True))
    return matrices


def _worth_compressing(n: int, m: int, rank: int, min_rate: float) -> bool:
    return (n + m) * rank * min_rate < n * m


class _LowRankGroup(NamedTuple):
    """Matrices of one shape compressed together (a batch of one unless batching)."""

    # (n, m) views of the bucket's buffer.
    matrices: list[torch.Tensor]
    # (b, n, m): a view when b == 1, else a stacked copy written back at the end.
    stack: torch.Tensor
    # (b, n, r) and (b, m, r) views of the bucket's P and Q memory.
    p: torch.Tensor
    q: torch.Tensor


class _Plan(NamedTuple):
    """How one bucket's gradients are split this iteration."""

    # Views sent as they are (1-D tensors and matrices not worth compressing).
    dense: list[torch.Tensor]
    # Element ranges (start, stop) of ``dense`` in the buffer; their error is zero.
    dense_ranges: list[tuple[int, int]]
    # The (n, m) matrix views to compress, grouped into batches of one shape.
    groups: list[list[torch.Tensor]]
    # Sizes of the bucket's flat P and Q memory (sum of n * r and of m * r).
    p_numel: int
    q_numel: int


def _plan(state: PowerSGDState, bucket: Any, buf: torch.Tensor) -> _Plan:
    views = views_of(buf, bucket)
    dense: list[torch.Tensor] = []
    ranges: list[tuple[int, int]] = []
    by_shape: dict[tuple[int, int], list[torch.Tensor]] = {}
    p_numel = q_numel = 0
    for v in views:
        numel = v.numel()
        state.total_numel_before_compression += numel
        if v.dim() >= 2 and numel > 0:
            n, m = v.shape[0], numel // v.shape[0]
            r = min(n, m, state.matrix_approximation_rank)
            if _worth_compressing(n, m, r, state.min_compression_rate):
                by_shape.setdefault((n, m), []).append(v.view(n, m))
                p_numel += n * r
                q_numel += m * r
                state.total_numel_after_compression += (n + m) * r
                continue
        state.total_numel_after_compression += numel
        dense.append(v)
        start = v.storage_offset() - buf.storage_offset()
        ranges.append((start, start + numel))
    groups = (list(by_shape.values()) if state.batch_tensors_with_same_shape
              else [[mat] for mats in by_shape.values() for mat in mats])
    return _Plan(dense, ranges, groups, p_numel, q_numel)


def _low_rank_memory(state: PowerSGDState, index: int, plan: _Plan,
                     like: torch.Tensor) -> list[_LowRankGroup]:
    """Lay out P and Q for the bucket; draw fresh Qs unless warm-starting."""
    q_mem = state.q_memory_dict.get(index)
    p_mem = state.p_memory_dict.get(index)
    fresh = (not state.warm_start or q_mem is None or p_mem is None
             or (p_mem.numel(), q_mem.numel()) != (plan.p_numel, plan.q_numel)
             or q_mem.dtype != like.dtype)
    if fresh or p_mem is None or q_mem is None:
        p_mem = state.p_memory_dict[index] = like.new_empty(plan.p_numel)
        q_mem = state.q_memory_dict[index] = state.random_like(plan.q_numel, like.dtype,
                                                               like.device)
    groups, p_at, q_at = [], 0, 0
    for mats in plan.groups:
        b, (n, m) = len(mats), mats[0].shape
        r = min(n, m, state.matrix_approximation_rank)
        stack = mats[0].unsqueeze(0) if b == 1 else torch.stack(mats)
        p = p_mem[p_at:p_at + b * n * r].view(b, n, r)
        q = q_mem[q_at:q_at + b * m * r].view(b, m, r)
        p_at += b * n * r
        q_at += b * m * r
        # A warm Q is the last step's (M^T P); re-orthonormalise before reuse.
        orthonormalize_(q, state.orthogonalization_epsilon)
        groups.append(_LowRankGroup(mats, stack, p, q))
    return groups


def _add_error(state: PowerSGDState, index: int, buf: torch.Tensor) -> torch.Tensor | None:
    """Error feedback, part 1: add the stored error; return a copy of the compensated input."""
    if not state.use_error_feedback:
        return None
    err = state.error_dict.get(index)
    if err is not None and err.shape == buf.shape and err.dtype == buf.dtype:
        buf.add_(err)
    return buf.clone()


def _plain_while_warming_up(state: PowerSGDState, bucket: Any, label: str) -> Future | None:
    """Before compression starts: the plain average (and the iteration is counted)."""
    if state.iter >= state.start_powerSGD_iter:
        return None
    state.count_iteration(bucket)
    return mean_all_reduce(bucket.buffer(), state.process_group, label=label)


def _then_second_round(first_work: Any, first: list[Future],
                       second: Callable[[], Future]) -> Future:
    """Issue ``second()`` once the ``first`` round has completed; a future of its result.

    Registers with the sequencer (see [Note: launch order of chained collectives]);
    its marker is released even if the first round failed, so no later hook waits forever.
    """
    launched: Future = Future()
    sequencer().register(first_work, launched)

    def step(done: list[Future]) -> Future:
        try:
            _raise_any(done)
            return second()
        finally:
            launched.set_result(None)

    return chain(torch.futures.collect_all(first), step)


def _end_of_bucket(state: PowerSGDState, bucket: Any, index: int) -> None:
    """Count the iteration; after an iteration's last bucket, let nothing else interleave."""
    if not state.warm_start:
        state.p_memory_dict.pop(index, None)
        state.q_memory_dict.pop(index, None)
    state.count_iteration(bucket)
    if bucket.is_last():
        sequencer().wait_for_launches()


def _raise_any(futures: list[Future]) -> None:
    """Re-raise the first failure among already completed futures."""
    for f in futures:
        f.value()


# ------------------------------------------------------------------------ hooks
def powerSGD_hook(state: PowerSGDState, bucket: GradBucket) -> HookResult:
    """Compress each matrix of the bucket to rank ``r`` (see the module docstring).

    Sends ``sum((n + m) * r)`` elements for the compressed matrices plus every
    remaining element once, instead of the whole bucket.
    """
    sequencer().wait_for_launches()
    warm_up = _plain_while_warming_up(state, bucket, "powerSGD")
    if warm_up is not None:
        return warm_up
    group = state.process_group
    buf = bucket.buffer()
    world = world_size_of(group)
    index = bucket.index()
    compensated = _add_error(state, index, buf)
    plan = _plan(state, bucket, buf)
    state.report_compression_stats(bucket)
    groups = _low_rank_memory(state, index, plan, buf)
    for g in groups:
        torch.bmm(g.stack, g.q, out=g.p)
    p_mem = state.p_memory_dict[index]
    q_mem = state.q_memory_dict[index]
    dense_flat = (torch.cat([v.reshape(-1) for v in plan.dense]) if plan.dense
                  else buf.new_empty(0))
    _, dense_fut = all_reduce(dense_flat, group, label="powerSGD")
    p_work, p_fut = all_reduce(p_mem, group, label="powerSGD")

    def round_two() -> Future:
        dense_flat.div_(world)
        at = 0
        for v in plan.dense:
            v.copy_(dense_flat[at:at + v.numel()].view_as(v))
            at += v.numel()
        for g in groups:
            orthonormalize_(g.p, state.orthogonalization_epsilon)
            # Q = M^T P computed as (P^T M)^T: the same numbers, and far faster on
            # CPU than a batched matmul over a transposed (strided) M.
            g.q.copy_(torch.bmm(g.p.transpose(1, 2), g.stack).transpose(1, 2))
        return all_reduce(q_mem, group, label="powerSGD")[1]

    def decompress(_: Any) -> torch.Tensor:
        q_mem.div_(world)
        for g in groups:
            torch.bmm(g.p, g.q.transpose(1, 2), out=g.stack)
            if len(g.matrices) > 1:
                for mat, approx in zip(g.matrices, g.stack):
                    mat.copy_(approx)
        if compensated is not None:
            err = compensated.sub_(buf)
            # Dense slices were averaged, not approximated: nothing to carry over.
            for start, stop in plan.dense_ranges:
                err[start:stop] = 0
            state.error_dict[index] = err
        return buf

    result = _then_second_round(p_work, [dense_fut, p_fut], round_two)
    result = result.then(lambda f: decompress(f.value()))
    _end_of_bucket(state, bucket, index)
    return result


def batched_powerSGD_hook(state: PowerSGDState, bucket: GradBucket) -> HookResult:
    """Compress the whole bucket as one square matrix (zero-padded) to rank ``r``.

    Cheaper to compute than :func:`powerSGD_hook` but usually much less
    accurate, since the square layout ignores the tensors' own rows and
    columns; prefer ``r == 1`` here. Sends ``2 * ceil(sqrt(numel)) * r`` elements.
    """
    sequencer().wait_for_launches()
    warm_up = _plain_while_warming_up(state, bucket, "batched_powerSGD")
    if warm_up is not None:
        return warm_up
    group = state.process_group
    buf = bucket.buffer()
    world = world_size_of(group)
    index = bucket.index()
    length = buf.numel()
    side = max(1, math.ceil(math.sqrt(length)))
    r = min(side, state.matrix_approximation_rank)
    state.total_numel_before_compression += length
    state.total_numel_after_compression += 2 * side * r
    state.report_compression_stats(bucket)

    # The square, zero-padded copy of the bucket (the buffer itself is never resized).
    square = buf.new_zeros(side * side)
    square[:length].copy_(buf)
    compensated = _add_error(state, index, square)
    matrix = square.view(side, side)

    q = state.q_memory_dict.get(index)
    if not state.warm_start or q is None or q.shape != (side, r) or q.dtype != buf.dtype:
        q = state.random_like(side * r, buf.dtype, buf.device).view(side, r)
        state.q_memory_dict[index] = q
    orthonormalize_(q.unsqueeze(0), state.orthogonalization_epsilon)
    p = torch.mm(matrix, q)
    state.p_memory_dict[index] = p
    p_work, p_fut = all_reduce(p, group, label="batched_powerSGD")

    def round_two() -> Future:
        orthonormalize_(p.unsqueeze(0), state.orthogonalization_epsilon)
        torch.mm(matrix.t(), p, out=q)
        return all_reduce(q, group, label="batched_powerSGD")[1]

    def decompress(_: Any) -> torch.Tensor:
        q.div_(world)
        torch.mm(p, q.t(), out=matrix)
        buf.copy_(square[:length])
        if compensated is not None:
            state.error_dict[index] = compensated.sub_(square)
        return buf

    result = _then_second_round(p_work, [p_fut], round_two)
    result = result.then(lambda f: decompress(f.value()))
    _end_of_bucket(state, bucket, index)
    return result
