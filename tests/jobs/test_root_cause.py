"""torchrun names the rank that failed first ([Note: torchrun's root cause])."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from gradring.comm import root_cause
from gradring.comm.transport import CollectiveError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _ts(path) -> int:
    data = json.loads(open(path).read())
    msg = data["message"]
    return int(msg["extraInfo"]["timestamp"] if isinstance(msg, dict) else data["timestamp"])


def test_root_cause_writes_its_file_and_a_consequence_sorts_after_it(tmp_path) -> None:
    root, peer, recorded = tmp_path / "r.json", tmp_path / "p.json", tmp_path / "rec.json"
    root_cause.record(ValueError("bad batch"), now=100.7, path=str(root))
    assert _ts(root) == 100 and "ValueError: bad batch" in root.read_text()
    # A survivor's error, raised (here: chained) from a gradring collective failure.
    try:
        try:
            raise CollectiveError("rank 1 left")
        except CollectiveError as exc:
            raise RuntimeError("bucket 0 failed") from exc
    except RuntimeError as exc:
        root_cause.record(exc, now=100.9, path=str(peer))
    assert _ts(peer) == 101 and "a peer failed first" in peer.read_text()
    # The same failure raised in the reducer's finalize, which autograd's engine
    # re-raises as a new RuntimeError holding only the text.
    wrapped = tmp_path / "w.json"
    root_cause.record(RuntimeError("Got the following error when running the callback: "
                                   "CollectiveError: rank 1 left"), now=100.9, path=str(wrapped))
    assert _ts(wrapped) == 101 and "a peer failed first" in wrapped.read_text()
    mentions = tmp_path / "m.json"  # a user's own error merely quoting one is a root cause
    root_cause.record(RuntimeError("retry after CollectiveError: x"), now=100.9,
                      path=str(mentions))
    assert _ts(mentions) == 100
    # A file @record already wrote keeps its message; only the time moves.
    rec = {"message": {"message": "CollectiveError: x", "extraInfo": {
        "py_callstack": "tb", "timestamp": "100"}}}
    recorded.write_text(json.dumps(rec))
    root_cause.record(CollectiveError("rank 1 died"), now=100.2, path=str(recorded))
    data = json.loads(recorded.read_text())
    assert data["message"]["message"] == "CollectiveError: x" and _ts(recorded) == 101
    # A root cause never overwrites what @record wrote.
    recorded.write_text(json.dumps(rec))
    root_cause.record(ValueError("mine"), now=105.0, path=str(recorded))
    assert json.loads(recorded.read_text()) == rec


_SCRIPT = textwrap.dedent("""
    import os, torch, torch.distributed as dist
    import gradring
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    model = gradring.DistributedDataParallel(torch.nn.Linear(8, 8))
    for step in range(4):
        if step == 2 and rank == int(os.environ["BAD_RANK"]):
            raise ValueError(f"rank {rank} found a bad batch")
        model(torch.randn(4, 8)).sum().backward()
""")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("bad", [1, 0])
def test_torchrun_names_the_rank_that_raised(tmp_path, bad) -> None:
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = {**os.environ, "BAD_RANK": str(bad), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    named = []
    for _ in range(3):
        proc = subprocess.run([torchrun, "--standalone", "--nproc-per-node=2", str(script)],
                              env=env, capture_output=True, text=True, timeout=180,
                              cwd=tmp_path)
        assert proc.returncode != 0
        text = proc.stdout + proc.stderr
        section = text.split("Root Cause (first observed failure):", 1)[1]
        named.append(int(re.search(r"rank\s*:\s*(\d+)", section).group(1)))
    assert named == [bad] * 3, text[-3000:]
