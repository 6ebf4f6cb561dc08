"""Elastic restart under torchrun: a SIGKILLed worker, a restart, identical final parameters."""

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def _run(tmp_path, name, crash_at):
    folder = tmp_path / name
    folder.mkdir()
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node=2", "--max-restarts=1",
           os.path.join(ROOT, "examples", "elastic_train.py"), "--steps", "12", "--every", "3",
           "--ckpt", str(folder / "ckpt.pt"), "--out", str(folder / "final.pt"),
           "--crash-at", str(crash_at)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return torch.load(folder / "final.pt"), proc.stdout + proc.stderr


@pytest.mark.skipif(not os.path.exists(TORCHRUN), reason="torchrun not installed in this env")
def test_killed_worker_restarts_and_matches_uninterrupted_run(tmp_path):
    clean, _ = _run(tmp_path, "clean", -1)
    crashed, log = _run(tmp_path, "crashed", 7)
    assert "exitcode: -9" in log and "resuming from step 6" in log
    assert clean.keys() == crashed.keys()
    for k in clean:
        assert torch.equal(clean[k], crashed[k]), k


def test_atomic_checkpoint_never_torn(tmp_path, monkeypatch):
    from gradring.tools import checkpoint

    path = tmp_path / "c.pt"
    checkpoint.save_atomic({"v": 1}, str(path))

    def boom(*a, **k):
        raise OSError("disk full halfway")
    monkeypatch.setattr(checkpoint.os, "replace", boom)
    with pytest.raises(OSError):
        checkpoint.save_atomic({"v": 2}, str(path))
    assert checkpoint.load_if_exists(str(path)) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]  # no temp file left behind
