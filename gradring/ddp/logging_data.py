"""What ``_get_ddp_logging_data`` reports beyond the constructor's arguments,
with the keys, types and sampling of torch's C++ ``Logger``.

[Note: logging data as torch gives it]
torch's DDP logging data is a flat dict of ints and strings: lists are
strings ("n1, n2" for bucket sizes, "i j k" for the rebuilt buckets'
parameter indices, flat), dtypes are the C++ type names ("float",
"double"), and the runtime statistics (nanoseconds) are taken at sampled
iterations only: the synchronised forward with ``i`` synchronised forwards
before it samples when ``0 < i <= 10`` or ``i`` is a multiple of the sample
rate (``_set_ddp_runtime_logging_sample_rate``, 100 by default); it then
reports the iteration just finished and sets ``"iteration"`` to ``i``.
gradring reads the statistics from its reducer's trace (observe/trace.py):
forward from DDP's forward start to end, backward compute from the first
gradient hook to the end of the backward, communication from the first
bucket launch to the last bucket's completion.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import torch

from gradring.observe.trace import Trace

#: Added to a perf_counter reading (in ns) to make it wall-clock ns, as torch's stamps are.
_EPOCH_OFFSET_NS = time.time_ns() - time.perf_counter_ns()

#: The C++ type names torch's logger uses for the common dtypes.
_CPP_DTYPE = {torch.float32: "float", torch.float64: "double", torch.float16: "c10::Half",
              torch.bfloat16: "c10::BFloat16", torch.int64: "long int", torch.int32: "int"}


def joined(values: Sequence[Any], sep: str = ", ") -> str:
    """A list as torch's logger writes it."""
    return sep.join(str(v) for v in values)


def dtype_names(dtypes: Sequence[torch.dtype]) -> str:
    """The parameters' dtypes as torch's logger names them, each once."""
    names = sorted({_CPP_DTYPE.get(d, str(d).replace("torch.", "")) for d in dtypes})
    return joined(names)


def environment(backend: str) -> dict[str, Any]:
    """The environment keys torch's logger adds ("N/A" where unset)."""
    def env(name: str) -> str:
        return os.environ.get(name, "N/A")

    data: dict[str, Any] = {
        "master_addr": env("MASTER_ADDR"), "master_port": env("MASTER_PORT"),
        "torch_distributed_debug": env("TORCH_DISTRIBUTED_DEBUG"),
        "cuda_visible_devices": env("CUDA_VISIBLE_DEVICES"),
    }
    if backend == "gloo":
        data.update(gloo_socket_ifname=env("GLOO_SOCKET_IFNAME"),
                    gloo_device_transport=env("GLOO_DEVICE_TRANSPORT"), gloo_num_threads=2)
    return data


def _ns(t: float) -> int:
    return int(t * 1e9) + _EPOCH_OFFSET_NS


class RuntimeStats:
    """The sampled runtime statistics (see [Note: logging data as torch gives it])."""

    def __init__(self) -> None:
        # Sample every this many iterations after the tenth (torch's default: 100).
        self.sample_rate = 100
        # The keys of the last sample (empty before the first).
        self._last: dict[str, int] = {}
        # Sums over every sample, for the avg_* keys, and how many samples there were.
        self._sums: dict[str, int] = {}
        self._samples = 0

    def set_sample_rate(self, rate: int) -> None:
        self.sample_rate = rate

    def on_forward(self, trace: Trace, forwards_before: int) -> None:
        """A synchronised forward starts after ``forwards_before`` others: sample
        the iteration just finished if this is a sampled one. Once per forward."""
        i = forwards_before
        if i <= 0 or (i > 10 and i % self.sample_rate):
            return
        times = _times(trace, trace.iteration - 1)
        if times is None:
            return
        self._samples += 1
        for key in ("forward_compute_time", "backward_compute_time", "backward_comm_time",
                    "backward_compute_comm_overlap_time"):
            self._sums[key] = self._sums.get(key, 0) + times[key]
        self._last = dict(times, iteration=i)

    def fields(self) -> dict[str, int]:
        """The keys of the last sample and the averages over all samples."""
        if not self._samples:
            return {}
        data = dict(self._last)
        for key, total in self._sums.items():
            data[f"avg_{key}"] = total // self._samples
        return data


def _times(trace: Trace, iteration: int) -> dict[str, int] | None:
    """The runtime keys of one traced iteration, or None if it was not traced whole."""
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    for e in trace.iteration_events(iteration):
        first.setdefault(e.kind, e.t)
        last[e.kind] = e.t
    need = ("forward_start", "forward_end", "backward_start", "backward_end", "launch",
            "comm_done")
    if any(k not in first for k in need):
        return None
    fwd0, fwd1 = first["forward_start"], last["forward_end"]
    bwd0, bwd1 = first["backward_start"], last["backward_end"]
    comm0, comm1 = first["launch"], max(last["comm_done"], first["launch"])
    overlap = max(0.0, min(bwd1, comm1) - max(bwd0, comm0))
    return {
        "forward_compute_time": int((fwd1 - fwd0) * 1e9),
        "backward_compute_time": int((bwd1 - bwd0) * 1e9),
        "backward_comm_time": int((comm1 - comm0) * 1e9),
        "backward_compute_comm_overlap_time": int(overlap * 1e9),
        "forward_compute_time_start": _ns(fwd0),
        "backward_compute_time_start": _ns(bwd0),
        "backward_compute_time_end": _ns(bwd1),
        "backward_comm_time_start": _ns(comm0),
        "backward_comm_time_end": _ns(comm1),
    }


# [Note: a torch Logger for torch's helper functions]
# torch's helpers that check a model or assign buckets
# (``_verify_param_shape_across_processes``, ``_compute_bucket_assignment_by_size``)
# take DDP's ``logger``, a C++ ``dist.Logger``, and record the errors they raise
# into it; pybind accepts nothing else there, and a Logger is only made from a
# C++ Reducer. So ``DistributedDataParallel.logger`` is built on first use over a
# stand-in C++ Reducer that manages one throwaway 1-element tensor: no
# parameter of the model is given to it, and it never reduces anything. An
# error recorded in it shows in the logging data as gradring's own do.
class TorchLogger:
    """The C++ Logger torch's helpers log into, made on first use (see [Note: a
    torch Logger for torch's helper functions])."""

    def __init__(self) -> None:
        # The stand-in reducer and its logger, once made (the logger holds the reducer).
        self._logger: Any = None

    def get(self, process_group: Any) -> Any:
        """The Logger, made now if it was not yet."""
        if self._logger is None:
            import torch.distributed as dist

            stand_in = torch.zeros(1, requires_grad=True)
            reducer = dist.Reducer([stand_in], [[0]], [1], process_group)
            self._logger = dist.Logger(reducer)
        return self._logger

    def error(self) -> str | None:
        """The error a torch helper recorded in the Logger, if any."""
        if self._logger is None:
            return None
        data = self._logger._get_ddp_logging_data()
        return data.strs_map.get("error") if data.ints_map.get("has_error") else None
