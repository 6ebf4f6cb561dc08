"""What a process that can read the job's store learns: no tensor data.

torch's stores have no authentication: any local process that reaches a
TCPStore's port, or can read a FileStore's file, reads every key. A real
2-rank job here runs gradring's collectives and a DDP step over a FileStore,
on each transport, with tensors full of values found nowhere else; then rank 0
reads the store's file as an outsider would and looks for those tensors' bytes
(inputs, results, the weights DDP broadcast at construction, a gradient) and
their printed values. A control value rank 0 writes there itself must be
found, so the search is known to work. See docs/reliability.md, "What an
attacker with store access can and cannot do".

This file doubles as the job script:
``python tests/jobs/test_store_contents.py --rank R --store PATH``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import struct
import sys
from datetime import timedelta

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repository root

from tests.support import jobs  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

JOB_LIMIT_S = 150.0


# ----------------------------------------------------------------------- job side
def _say(**report: object) -> None:
    print(json.dumps(report), flush=True)


def _entries(raw: bytes) -> list[tuple[str, bytes]]:
    """The key/value records of a FileStore file (each a 4-byte little-endian length
    and its bytes, key then value), in the order written."""
    out, at = [], 0
    while at + 4 <= len(raw):
        (n,) = struct.unpack_from("<I", raw, at)
        key = raw[at + 4:at + 4 + n]
        at += 4 + n
        (m,) = struct.unpack_from("<I", raw, at)
        out.append((key.decode("utf-8", "replace"), raw[at + 4:at + 4 + m]))
        at += 4 + m
    return out


def _job_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--store", required=True)
    a = p.parse_args(argv)

    import torch
    import torch.distributed as dist
    from torch import nn

    import gradring
    from gradring import comm

    torch.set_num_threads(1)
    store = dist.FileStore(a.store, 2)
    dist.init_process_group("gloo", store=store, rank=a.rank, world_size=2,
                            timeout=timedelta(seconds=120))
    big = [torch.full((4096,), 1234.5678 + r) for r in range(2)]  # staged (16 KiB)
    small = [torch.full((4,), 4321.25 + r) for r in range(2)]     # inline
    x, y = big[a.rank].clone(), small[a.rank].clone()
    comm.all_reduce(x)
    comm.all_reduce(y)
    weight = torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64) * 0.001 + 777.0
    model = nn.Linear(64, 64)
    with torch.no_grad():  # rank 0's weights reach rank 1 by DDP's broadcast
        model.weight.copy_(weight if a.rank == 0 else torch.zeros(64, 64))
    ddp = gradring.DistributedDataParallel(model)
    ddp(torch.full((8, 64), 0.5 + a.rank)).pow(2).sum().backward()
    assert torch.equal(model.weight.detach(), weight)
    dist.barrier()
    if a.rank == 0:
        tensors = {"all_reduce input rank 0": big[0], "all_reduce input rank 1": big[1],
                   "all_reduce result": x, "inline input rank 0": small[0],
                   "inline input rank 1": small[1], "inline result": y,
                   "broadcast weights": weight, "gradient": model.weight.grad}
        needles = {name: t.detach().reshape(-1)[:8].numpy().tobytes()
                   for name, t in tensors.items()}
        needles.update({"printed value 1234.56": b"1234.56", "printed value 4321.2": b"4321.2",
                        "printed value 777.0": b"777.0"})
        store.set("test/control", big[1].numpy().tobytes()[:64])
        with open(a.store, "rb") as f:
            entries = _entries(f.read())
        found = {name: [k for k, v in entries if needle in v or needle in k.encode()]
                 for name, needle in needles.items()}
        keys = sorted({re.sub(r"\d+", "N", k) for k, _ in entries})
        _say(found=found, keys=keys, records=len(entries))
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------- test side
@pytest.mark.parametrize("env", [{}, {"GRADRING_TRANSPORT": "torch"}], ids=["shm", "torch"])
def test_the_store_holds_no_tensor_data(tmp_path, env) -> None:
    store = str(tmp_path / "store")
    procs = jobs.start(os.path.abspath(__file__), 2,
                       lambda r: ["--rank", str(r), "--store", store], jobs.job_env(env))
    ranks = jobs.collect(procs, JOB_LIMIT_S)
    assert [r["code"] for r in ranks] == [0, 0], [r["stderr"] for r in ranks]
    (report,) = [r for r in ranks[0]["reports"] if "found" in r]
    found = report["found"]
    # The control: rank 1's input, written by the test itself, is found where it was put.
    assert found.pop("all_reduce input rank 1") == ["/test/control"], found
    assert all(where == [] for where in found.values()), found
    # gradring did use this store (its rendezvous, board and settings are there).
    assert any("/gradring/" in k for k in report["keys"]), report["keys"]


if __name__ == "__main__":
    _job_main(sys.argv[1:])
