"""The flight recorder against a second local user who prepares its folder.

The test process is root, like the job in the report. A child running as
``nobody`` (uid/gid 65534) creates the recorder folder or plants symbolic
links in it, pointing at a file only root may read or write; then root dumps.
The target file must stay as it was, and the dump must be where the warning
says (see [Note: flight-recorder dumps in a folder other users can reach] in
gradring/comm/recorder.py).
"""

from __future__ import annotations

import glob
import json
import os
import pathlib
import re
import shutil
import stat
import tempfile
import traceback
import warnings

import pytest

from gradring.comm.recorder import FlightRecorder
from gradring.tools import flight

pytestmark = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                                reason="needs root, to act as a second user")

NOBODY = 65534
SECRET = "root only\n"

@pytest.fixture(autouse=True)
def _remove_private_folders():
    """Remove the private folders the refused dumps went to."""
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "gradring-flight-*")))
    yield
    for folder in set(glob.glob(os.path.join(tempfile.gettempdir(), "gradring-flight-*"))) - before:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def base():
    """A sticky, world-writable folder in /tmp (which nobody can reach), holding a
    root-only file. pytest's tmp_path lies under a folder only root may enter."""
    path = pathlib.Path(tempfile.mkdtemp(prefix="gradring-fr-test-", dir="/tmp"))
    os.chmod(path, 0o1777)
    secret = path / "secret"
    secret.write_text(SECRET)
    os.chmod(secret, 0o600)
    yield path
    shutil.rmtree(path)


def _as_nobody(folder, mode: int, target, names: list[str]) -> None:
    """In a forked child running as nobody: make ``folder`` with ``mode`` (if given),
    then plant links named ``names`` in it pointing at ``target``."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            if mode:
                os.mkdir(folder)
                os.chmod(folder, mode)
            for name in names:
                os.symlink(target, os.path.join(folder, name))
            code = 0
        except BaseException:  # noqa: BLE001 - reported, then the child exits
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "planting as nobody failed"


def _links_for_likely_pids(name: str) -> list[str]:
    """What the attacker plants: the old temporary name for a range of pids around ours."""
    me = os.getpid()
    return [name] + [f"{name}.{pid}.tmp" for pid in range(max(1, me - 20), me + 20)]


def _recorder() -> FlightRecorder:
    rec = FlightRecorder()
    rec.issue("0", 1, "all_reduce", 16, __import__("torch").float32, [4])
    return rec


def _dump_with_warning(rec: FlightRecorder, folder) -> tuple[str | None, str]:
    """Dump into ``folder``; the path written and the recorder's warning ("" if none)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = rec.dump("test", str(folder))
    texts = [str(w.message) for w in caught if "gradring flight recorder" in str(w.message)]
    return path, "\n".join(texts)


def _check_dump(path: str, name: str) -> None:
    assert os.path.basename(path) == name
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and st.st_uid == 0
    with open(path) as f:
        data = json.load(f)
    assert data["pid"] == os.getpid() and data["entries"][0]["kind"] == "all_reduce"
    dumps = flight.load(os.path.dirname(path))  # the reading tool still works
    assert list(dumps) == [1_000_000 + os.getpid()]


def test_folder_made_by_another_user_is_refused_and_the_dump_kept(base):
    name = f"pid{os.getpid()}.json"
    folder = base / "fr"
    _as_nobody(folder, 0o777, base / "secret", _links_for_likely_pids(name))
    path, message = _dump_with_warning(_recorder(), folder)
    assert (base / "secret").read_text() == SECRET
    assert path is not None
    assert f"did not write into {folder}: it is owned by uid {NOBODY}" in message
    private = re.search(r"Wrote \S+ to (\S+) instead", message).group(1)
    assert os.path.dirname(path) == private and stat.S_IMODE(os.stat(private).st_mode) == 0o700
    _check_dump(path, name)
    # Links were left alone: the final name in the refused folder still points where it did.
    assert os.readlink(folder / name) == str(base / "secret")


def test_env_folder_made_by_another_user_is_refused(base, monkeypatch):
    folder = base / "fr"
    _as_nobody(folder, 0o777, base / "secret", [])
    monkeypatch.setenv("GRADRING_FLIGHT_RECORDER", str(folder))
    with pytest.warns(RuntimeWarning, match=f"did not write into {folder}"):
        path = _recorder().dump("exit")
    assert path is not None and not path.startswith(str(folder))
    assert os.listdir(folder) == []


def test_own_sticky_folder_takes_the_dump_past_planted_links(base):
    """A shared folder of ours (mode 1777): only new files of ours are created in it."""
    name = f"pid{os.getpid()}.json"
    folder = base / "fr"
    folder.mkdir()
    os.chmod(folder, 0o1777)
    _as_nobody(folder, 0, base / "secret", _links_for_likely_pids(name))
    path, message = _dump_with_warning(_recorder(), folder)
    assert (base / "secret").read_text() == SECRET
    assert message == "" and path == str(folder / name)
    _check_dump(path, name)  # the planted link at the final name was replaced, not followed
    assert not [n for n in os.listdir(folder) if n.endswith(".tmp") and not os.path.islink(
        folder / n)], "a temporary file of ours was left behind"


def test_folder_that_is_a_link_is_refused(base):
    victim = base / "victim"
    victim.mkdir(mode=0o700)
    _as_nobody(base, 0, victim, ["fr"])
    path, message = _dump_with_warning(_recorder(), base / "fr")
    assert os.listdir(victim) == []
    assert "it is a symbolic link" in message
    _check_dump(path, f"pid{os.getpid()}.json")


def test_own_folder_writable_by_others_without_sticky_bit_is_refused(base):
    folder = base / "fr"
    folder.mkdir()
    os.chmod(folder, 0o777)
    path, message = _dump_with_warning(_recorder(), folder)
    assert os.listdir(folder) == []
    assert "other users may write to it (mode drwxrwxrwx) and it is not sticky" in message
    _check_dump(path, f"pid{os.getpid()}.json")


def test_missing_folder_is_created_and_used(tmp_path):
    folder = tmp_path / "a" / "fr"
    path = _recorder().dump("test", str(folder))
    assert path == str(folder / f"pid{os.getpid()}.json")
    _check_dump(path, f"pid{os.getpid()}.json")
