"""How a dead peer's end is worded (gradring/comm/peers.py), from fake /proc and kernel
logs: the OOM-killed rank used to be reported only as "has exited"."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from gradring.comm import peers

PID = 4242
OOM = ("6,1234,5678,-;Out of memory: Killed process 4242 (python) total-vm:9000000kB, "
       "anon-rss:8000000kB, file-rss:0kB, shmem-rss:0kB, UID:0 pgtables:100kB oom_score_adj:0\n")


def _stat(tmp_path, state: str, status: int) -> str:
    """A fake /proc with ``PID``'s stat line: ``state``, exit status field 52."""
    proc = tmp_path / "proc"
    (proc / str(PID)).mkdir(parents=True)
    fields = [state] + ["0"] * 48 + [str(status)]  # fields 3..52
    (proc / str(PID) / "stat").write_text(f"{PID} (python) " + " ".join(fields) + "\n")
    return str(proc)


def test_oom_kill_is_named_from_the_kernel_log(tmp_path) -> None:
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("6,1,2,-;something else\n" + OOM)
    text = peers.how_it_ended(PID, proc=_stat(tmp_path, "Z", signal.SIGKILL), kmsg=str(kmsg))
    assert text.startswith("killed by the OOM killer (SIGKILL)"), text
    assert "Killed process 4242 (python)" in text, text


def test_sigkill_without_a_kernel_log_points_at_the_oom_killer(tmp_path) -> None:
    text = peers.how_it_ended(PID, proc=_stat(tmp_path, "Z", signal.SIGKILL),
                              kmsg=str(tmp_path / "unreadable"))
    assert text.startswith("killed by signal 9 (SIGKILL)"), text
    assert "OOM killer" in text and "Killed process 4242" in text, text


def test_plain_exit_status_and_other_signals(tmp_path) -> None:
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(OOM.replace("4242", "4243"))  # another process's OOM kill
    assert peers.how_it_ended(PID, proc=_stat(tmp_path, "Z", 3 << 8),
                              kmsg=str(kmsg)) == "exit status 3"
    proc = str(tmp_path / "proc")
    os.remove(os.path.join(proc, str(PID), "stat"))
    os.rmdir(os.path.join(proc, str(PID)))
    _stat(tmp_path, "Z", signal.SIGSEGV)
    assert peers.how_it_ended(PID, proc=proc, kmsg=str(kmsg)) == \
        "killed by signal 11 (SIGSEGV)"


def test_nothing_known_says_where_to_look(tmp_path) -> None:
    # Reaped already (no /proc entry) and no kernel log: the message says what may have
    # happened and where the answer is, instead of a bare "has exited".
    text = peers.how_it_ended(PID, "host-b", proc=str(tmp_path / "none"),
                              kmsg=str(tmp_path / "none"))
    assert "may have been killed" in text and "OOM killer" in text, text
    assert "Killed process 4242" in text and "host-b" in text, text


def test_own_child_killed_is_read_without_reaping_it() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(child.pid, signal.SIGKILL)
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
        assert peers.exited(1, child.pid).startswith(
            f"rank 1 (pid {child.pid}) has exited: killed by signal 9 (SIGKILL)")
    finally:
        child.wait()
