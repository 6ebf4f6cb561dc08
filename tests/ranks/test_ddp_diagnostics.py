"""What DDP tells a user: the logging data's keys, the profiler's bucket spans, and
a failed collective's error naming the bucket and its parameters."""

from __future__ import annotations

import torch
from torch import nn

import gradring


def _logging_keys(rank, world_size):
    ddp = gradring.DistributedDataParallel(nn.Linear(3, 2), bucket_cap_mb=5)
    return ddp._get_ddp_logging_data()


def test_logging_data_keys(pools):
    data = pools.run(2, _logging_keys)[0]
    for key in ("bucket_sizes", "rebuilt_bucket_sizes", "rebuilt_per_bucket_param_indices",
                "has_rebuilt_buckets", "world_size", "bucket_cap_bytes",
                "find_unused_parameters", "static_graph", "gradient_as_bucket_view"):
        assert key in data
    assert data["world_size"] == 2 and data["bucket_cap_bytes"] == 5 * 1024 * 1024


def _profiler_spans(rank, world_size):
    ddp = gradring.DistributedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ddp(torch.randn(2, 4)).sum().backward()
    return sorted({e.key for e in prof.key_averages() if e.key.startswith("gradring::")})


def test_profiler_shows_bucket_spans(pools):
    names = pools.run(2, _profiler_spans)[0]
    assert "gradring::bucket_all_reduce#0" in names and "gradring::bucket_wait#0" in names


def _failing_hook(state, bucket):
    fut = torch.futures.Future()
    fut.set_exception(RuntimeError("collective exploded"))
    return fut


def _collective_failure_names_bucket(rank, world_size):
    torch.manual_seed(0)
    ddp = gradring.DistributedDataParallel(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2)))
    ddp.register_comm_hook(None, _failing_hook)
    try:
        ddp(torch.randn(2, 3)).sum().backward()
    except RuntimeError as e:
        msg = str(e)
    else:
        msg = "no error"
    # the DDP object stays usable for a clean next iteration once the hook behaves
    return msg


def test_collective_failure_names_bucket_and_params(pools):
    for msg in pools.run(2, _collective_failure_names_bucket):
        assert "collective exploded" in msg
        assert "bucket 0" in msg and "1.weight" in msg and "0.bias" in msg
