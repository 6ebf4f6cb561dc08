"""Every file gradring's tools write, against a second local user who prepared the ground.

Before these checks, run as root in a shared sticky folder, ``gradring demo`` wrote
``explain.txt`` and ``timeline.png`` through links another user planted, and
the checkpoint loader unpickled whatever that user left at the documented
``/tmp/elastic/ckpt.pt``. The test process is root, like the job in the
report. The other user's things are made by root and handed to ``nobody``
(uid 65534) with ``os.lchown``, or made by a forked child running as
``nobody``, inside a sticky, world-writable folder under /tmp. Each writer
must refuse with an error naming the path, and the file a link points at
must stay as it was. See [Note: output files in folders other users can
reach] in gradring/safe_files.py.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import stat
import sys
import tempfile
import traceback
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

from gradring import safe_files
from gradring.comm.recorder import FlightRecorder
from gradring.safe_files import UnsafePath
from gradring.tools import checkpoint, demo, tune

pytestmark = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                                reason="needs root, to act as a second user")

NOBODY = 65534
SECRET = b"root only\n"


@pytest.fixture
def base():
    """A sticky, world-writable folder in /tmp (which nobody can reach), holding a
    root-only file. pytest's tmp_path lies under a folder only root may enter."""
    path = pathlib.Path(tempfile.mkdtemp(prefix="gradring-files-test-", dir="/tmp"))
    os.chmod(path, 0o1777)
    secret = path / "secret"
    secret.write_bytes(SECRET)
    os.chmod(secret, 0o600)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _nobodys(path: pathlib.Path) -> pathlib.Path:
    os.lchown(path, NOBODY, NOBODY)
    return path


def _plant_link(at: pathlib.Path, target: pathlib.Path) -> pathlib.Path:
    """A symbolic link at ``at`` to ``target``, owned by nobody."""
    os.symlink(target, at)
    return _nobodys(at)


def _as_nobody(fn: Callable[[], None]) -> None:
    """Run ``fn`` in a forked child as nobody (a real second user's process)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            fn()
            code = 0
        except BaseException:  # noqa: BLE001 - reported, then the child exits
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "acting as nobody failed"


def _unchanged(base: pathlib.Path) -> None:
    assert (base / "secret").read_bytes() == SECRET
    assert stat.S_IMODE(os.stat(base / "secret").st_mode) == 0o600


# ------------------------------------------------------------------- open_output
def test_open_output_refuses_a_planted_link(base) -> None:
    out = _plant_link(base / "explain.txt", base / "secret")
    with pytest.raises(UnsafePath, match=f"refusing {out}: it is a symbolic link"):
        safe_files.open_output(str(out), "w")
    _unchanged(base)


def test_open_output_refuses_a_dangling_link(base) -> None:
    """A link to a name that does not exist yet: creating through it would make a
    file wherever it points."""
    out = _plant_link(base / "explain.txt", base / "created-through-the-link")
    with pytest.raises(UnsafePath, match="it is a symbolic link"):
        safe_files.open_output(str(out), "w")
    assert not (base / "created-through-the-link").exists()


def test_open_output_refuses_another_users_file(base) -> None:
    out = base / "explain.txt"
    out.write_bytes(b"theirs")
    _nobodys(out)
    with pytest.raises(UnsafePath, match=f"refusing {out}: it is owned by uid {NOBODY}"):
        safe_files.open_output(str(out), "w")
    assert out.read_bytes() == b"theirs"  # not even truncated


def test_open_output_refuses_a_hard_link(base) -> None:
    out = base / "explain.txt"
    os.link(base / "secret", out)
    with pytest.raises(UnsafePath, match="other hard link"):
        safe_files.open_output(str(out), "wb")
    _unchanged(base)


def test_open_output_refuses_a_fifo_without_blocking(base) -> None:
    out = base / "timeline.png"
    os.mkfifo(out)
    _nobodys(out)
    with pytest.raises(UnsafePath, match="it is not a regular file"):
        safe_files.open_output(str(out), "wb")


def test_open_output_refuses_a_folder_of_another_user(base) -> None:
    folder = base / "run"
    _as_nobody(lambda: (os.mkdir(folder), os.chmod(folder, 0o777)))
    with pytest.raises(UnsafePath, match=f"refusing {folder}: it is owned by uid {NOBODY}"):
        safe_files.open_output(str(folder / "explain.txt"), "w")
    assert os.listdir(folder) == []


def test_open_output_refuses_a_folder_others_may_write_without_sticky_bit(base) -> None:
    folder = base / "run"
    folder.mkdir()
    os.chmod(folder, 0o777)
    with pytest.raises(UnsafePath, match="other users may write to it .* not sticky"):
        safe_files.open_output(str(folder / "explain.txt"), "w")
    assert os.listdir(folder) == []


def test_open_output_refuses_a_link_on_the_way(base) -> None:
    """``base/run`` is another user's link to a root-only folder."""
    victim = base / "victim"
    victim.mkdir(mode=0o700)
    link = _plant_link(base / "run", victim)
    with pytest.raises(UnsafePath, match=f"refusing {link}: it is a symbolic link owned by "
                                         f"uid {NOBODY}"):
        safe_files.open_output(str(link / "explain.txt"), "w")
    assert os.listdir(victim) == []


def test_open_output_follows_links_of_our_own(base) -> None:
    real = base / "real"
    real.mkdir(mode=0o700)
    os.symlink(real, base / "mine")
    with safe_files.open_output(str(base / "mine" / "a.txt"), "w") as f:
        f.write("hello")
    assert (real / "a.txt").read_text() == "hello"


def test_open_output_writes_creates_and_truncates_our_files(base) -> None:
    out = base / "explain.txt"
    with safe_files.open_output(str(out), "w") as f:
        f.write("a long first text")
    with safe_files.open_output(str(out), "w") as f:
        f.write("short")
    with safe_files.open_output(str(out), "a") as f:
        f.write("+more")
    assert out.read_text() == "short+more"
    assert os.stat(out).st_uid == 0


# ----------------------------------------------------------------- output folders
def test_make_output_dir_refuses_a_folder_another_user_made(base) -> None:
    folder = base / "run1"
    _as_nobody(lambda: (os.mkdir(folder), os.chmod(folder, 0o777),
                        os.symlink(base / "secret", folder / "explain.txt")))
    with pytest.raises(UnsafePath, match=f"refusing {folder}: it is owned by uid {NOBODY}"):
        safe_files.make_output_dir(str(folder))
    _unchanged(base)


def test_make_output_dir_refuses_a_folder_others_may_write(base) -> None:
    with pytest.raises(UnsafePath, match=r"refusing \S+: other users may write to it"):
        safe_files.make_output_dir(str(base))  # sticky is not enough for an output folder


def test_make_output_dir_creates_private_folders(base) -> None:
    folder = base / "a" / "b"
    assert safe_files.make_output_dir(str(folder)) == str(folder)
    for p in (base / "a", folder):
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o700 and os.stat(p).st_uid == 0
    assert safe_files.make_output_dir(str(folder)) == str(folder)  # ours: accepted again
    with pytest.raises(UnsafePath, match="it already exists"):
        safe_files.make_output_dir(str(folder), fresh=True)


def test_make_fresh_dir_never_takes_a_prepared_name(base, monkeypatch) -> None:
    monkeypatch.chdir(base)
    _as_nobody(lambda: (os.mkdir("gradring-demo-x"), os.chmod("gradring-demo-x", 0o777)))
    _plant_link(base / "gradring-demo-y", base / "secret")
    for name in ("gradring-demo-x", "gradring-demo-y"):
        got = safe_files.make_fresh_dir(name)
        assert got.startswith(name + "-") and os.stat(got).st_uid == 0
        assert stat.S_IMODE(os.stat(got).st_mode) == 0o700
    assert safe_files.make_fresh_dir("gradring-demo-z") == "gradring-demo-z"
    _unchanged(base)


# --------------------------------------------------------------------------- demo
class _Stop(Exception):
    """Raised by the stand-in for the demo's training: the test ends there."""


def _demo_until_training(monkeypatch, argv: list[str]) -> tuple[int | None, str | None]:
    """Run ``gradring demo`` up to its training; its exit status (None when it reached
    the training) and the folder it chose."""
    seen: dict[str, str] = {}

    def fake_run_local(fn, nproc, epochs, batch, lr, max_batches, out):  # noqa: ANN001
        seen["out"] = out
        raise _Stop
    monkeypatch.setattr("gradring.tools.launch.run_local", fake_run_local)
    try:
        code = demo.main(argv)
    except _Stop:
        code = None
    return code, seen.get("out")


def test_demo_default_folder_is_new_even_if_its_name_was_prepared(base, monkeypatch) -> None:
    monkeypatch.chdir(base)
    monkeypatch.setattr(demo.time, "strftime", lambda fmt, *a: "gradring-demo-20250101-000000")
    planted = base / "gradring-demo-20250101-000000"
    _as_nobody(lambda: (os.mkdir(planted), os.chmod(planted, 0o777),
                        os.symlink(base / "secret", planted / "explain.txt"),
                        os.symlink(base / "secret", planted / "timeline.png")))
    code, out = _demo_until_training(monkeypatch, ["--small"])
    assert code is None and out is not None
    assert out != planted.name and out.startswith(planted.name + "-")
    st = os.stat(out)
    assert st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o700 and os.listdir(out) == []
    _unchanged(base)


def test_demo_refuses_an_out_folder_another_user_made(base, monkeypatch, capsys) -> None:
    folder = base / "run1"
    _as_nobody(lambda: (os.mkdir(folder), os.chmod(folder, 0o777),
                        os.symlink(base / "secret", folder / "explain.txt")))
    code, out = _demo_until_training(monkeypatch, ["--small", "--out", str(folder)])
    assert code == 2 and out is None
    assert f"refusing {folder}: it is owned by uid {NOBODY}" in capsys.readouterr().err
    _unchanged(base)


@pytest.mark.parametrize("flag", ["--timeline", "--trace"])
def test_demo_refuses_a_planted_link_before_training(base, monkeypatch, capsys, flag) -> None:
    link = _plant_link(base / "out.file", base / "secret")
    code, out = _demo_until_training(
        monkeypatch, ["--small", "--out", str(base / "mine"), flag, str(link)])
    assert code == 2 and out is None
    assert f"refusing {link}: it is a symbolic link" in capsys.readouterr().err
    _unchanged(base)


# ----------------------------------------------------------------------- timeline
TRACE = {"traceEvents": [
    {"ph": "X", "name": "gradring::backward", "pid": 0, "ts": 0, "dur": 1000,
     "args": {"iteration": 1}},
    {"ph": "X", "name": "gradring::bucket_all_reduce#0", "pid": 0, "ts": 100, "dur": 500,
     "args": {"iteration": 1, "bucket": 0}}]}


def test_timeline_refuses_a_planted_link(base, capsys) -> None:
    pytest.importorskip("matplotlib")
    from gradring.tools import timeline

    trace = base / "trace.json"
    trace.write_text(json.dumps(TRACE))
    link = _plant_link(base / "timeline.png", base / "secret")
    assert timeline.main([str(trace), "-o", str(link)]) == 1
    assert f"refusing {link}: it is a symbolic link" in capsys.readouterr().err
    _unchanged(base)
    # Where nothing was planted, it draws.
    assert timeline.main([str(trace), "-o", str(base / "mine.png")]) == 0
    assert (base / "mine.png").read_bytes()[:4] == b"\x89PNG"


# --------------------------------------------------------------------------- tune
def test_tune_refuses_a_planted_json_link_before_measuring(base, monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    monkeypatch.setattr(tune, "tune_bucket_cap",
                        lambda **kw: pytest.fail("measured before checking --json"))
    link = _plant_link(base / "tune.json", base / "secret")
    assert tune.main(["tiny", "--json", str(link)]) == 2
    assert f"refusing {link}: it is a symbolic link" in capsys.readouterr().err
    _unchanged(base)


# --------------------------------------------------------------------- checkpoints
MARKER_NAME = "payload-ran"


class _Payload:
    """What the other user pickles: unpickling it runs ``os.mkdir(marker)``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (os.mkdir, (self.marker,))


def _evil_checkpoint(path: pathlib.Path, marker: pathlib.Path) -> None:
    torch.save({"model": {}, "step": _Payload(str(marker))}, str(path))


def test_checkpoint_in_a_folder_another_user_made_is_refused(base) -> None:
    """The report: the second user pre-creates the folder of the documented
    ``--ckpt`` path and plants a pickle; root then runs the example."""
    folder, marker = base / "elastic", base / MARKER_NAME

    def plant() -> None:
        os.mkdir(folder)
        os.chmod(folder, 0o777)
        _evil_checkpoint(folder / "ckpt.pt", marker)
    _as_nobody(plant)
    with pytest.raises(UnsafePath, match=f"refusing {folder}: it is owned by uid {NOBODY}"):
        checkpoint.load_if_exists(str(folder / "ckpt.pt"))
    assert not marker.exists()


def test_checkpoint_of_another_user_in_a_sticky_folder_is_refused(base) -> None:
    marker = base / MARKER_NAME
    _as_nobody(lambda: _evil_checkpoint(base / "ckpt.pt", marker))
    with pytest.raises(UnsafePath, match=f"refusing {base / 'ckpt.pt'}: it is owned by uid "
                                         f"{NOBODY}"):
        checkpoint.load_if_exists(str(base / "ckpt.pt"))
    assert not marker.exists()


def test_checkpoint_that_is_a_link_is_refused(base) -> None:
    ours = base / "ours.pt"
    checkpoint.save_atomic({"step": 1}, str(ours))
    link = _plant_link(base / "ckpt.pt", ours)
    with pytest.raises(UnsafePath, match=f"refusing {link}: it is a symbolic link"):
        checkpoint.load_if_exists(str(link))


def test_checkpoint_others_may_write_is_refused(base) -> None:
    path = base / "ckpt.pt"
    checkpoint.save_atomic({"step": 1}, str(path))
    os.chmod(path, 0o666)
    with pytest.raises(UnsafePath, match="other users may write to it"):
        checkpoint.load_if_exists(str(path))


def test_checkpoint_holding_more_than_weights_is_refused(base) -> None:
    """Even a file of ours is loaded weights-only: a pickle that runs code fails."""
    folder, marker = base / "mine", base / MARKER_NAME
    folder.mkdir(mode=0o700)
    _evil_checkpoint(folder / "ckpt.pt", marker)
    with pytest.raises(Exception, match="(?i)weights.only"):
        checkpoint.load_if_exists(str(folder / "ckpt.pt"))
    assert not marker.exists()


def test_checkpoint_save_refuses_a_planted_link_and_keeps_its_target(base) -> None:
    link = _plant_link(base / "ckpt.pt", base / "secret")
    with pytest.raises(UnsafePath, match=f"refusing {link}: it is a symbolic link"):
        checkpoint.save_atomic({"step": 1}, str(link))
    _unchanged(base)
    assert sorted(os.listdir(base)) == ["ckpt.pt", "secret"]  # no temporary file left


def test_checkpoint_save_refuses_a_planted_folder_link(base) -> None:
    victim = base / "victim"
    victim.mkdir(mode=0o700)
    link = _plant_link(base / "elastic", victim)
    with pytest.raises(UnsafePath, match=f"refusing {link}: it is a symbolic link owned by"):
        checkpoint.save_atomic({"step": 1}, str(link / "ckpt.pt"))
    assert os.listdir(victim) == []


def test_checkpoint_round_trip_of_what_the_example_saves(base) -> None:
    """examples/elastic_train.py saves the model, the optimizer and the step; it must
    load weights-only, from folders created private."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 1))
    for opt in (torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                torch.optim.Adam(model.parameters())):
        model(torch.randn(4, 20)).sum().backward()
        opt.step()
        path = base / "elastic-ckpt" / "sub" / "ckpt.pt"
        checkpoint.save_atomic({"model": model.state_dict(), "optim": opt.state_dict(),
                                "step": 6}, str(path))
        assert stat.S_IMODE(os.stat(base / "elastic-ckpt").st_mode) == 0o700
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        state = checkpoint.load_if_exists(str(path))
        assert state["step"] == 6
        for k, v in model.state_dict().items():
            assert torch.equal(state["model"][k], v)
        opt.load_state_dict(state["optim"])
    assert checkpoint.load_if_exists(str(base / "none" / "ckpt.pt")) is None


# ------------------------------------------------------------------ flight recorder
def test_flight_recorder_refuses_a_link_on_the_way(base) -> None:
    """``GRADRING_FLIGHT_RECORDER=base/shared/fr`` where ``base/shared`` is another
    user's link to a root-only folder: no dump lands there."""
    victim = base / "victim"
    victim.mkdir(mode=0o700)
    link = _plant_link(base / "shared", victim)
    rec = FlightRecorder()
    rec.issue("0", 1, "all_reduce", 16, torch.float32, [4])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = rec.dump("test", str(link / "fr"))
    message = "\n".join(str(w.message) for w in caught)
    assert os.listdir(victim) == []
    assert f"{link}: it is a symbolic link owned by uid {NOBODY}" in message, message
    assert path is not None and not path.startswith(str(base))
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)
