"""The flight recorder: the last collectives of this process, and the labels they carry.

Each process keeps its last ``GRADRING_FLIGHT_SIZE`` (256)
collectives in a ring buffer (:class:`Entry`: seq, kind, bytes, dtype, shape,
label -- e.g. the DDP bucket -- times, state). With
``GRADRING_FLIGHT_RECORDER=<dir>`` it is written to ``<dir>/rank<R>.json`` on
every collective failure and at exit; ``gradring flight <dir>`` merges the
ranks' files and points at the first collective the ranks disagree on.

``label("bucket 3")`` names the collectives issued inside it (in errors, in
the recorder, and -- with ``GRADRING_CHECK`` -- in the desync fingerprint).

[Note: flight-recorder dumps in a folder other users can reach]
The folder is typically shared (``/tmp/fr``) and ranks often run as root, so
another local user may have made it, or planted links in it, first (issue 31:
links named ``rank0.json.<pid>.tmp`` once made a root job overwrite a
root-only file). ``FlightRecorder.dump`` therefore reaches the folder without
following another user's link and works through its descriptor
(``safe_files.open_folder``, [Note: output files in folders other users can
reach] in gradring/safe_files.py); accepts it only if owned by this user or
root, and sticky if others may write to it; creates a fresh temporary file
with ``O_CREAT | O_EXCL | O_NOFOLLOW`` and renames it onto ``rank<R>.json``
(a rename never follows a planted link). A refused folder does not lose the
dump: it goes to a private ``mkdtemp`` folder, and a ``RuntimeWarning`` says
why and where.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import socket
import tempfile
import threading
import time
import warnings
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from gradring import config, safe_files
from gradring.comm.collective import Collective
from gradring.comm.transport import Kind

#: Ring-buffer length of the flight recorder.
FLIGHT_SIZE = config.current().flight_size

_local = threading.local()


@contextlib.contextmanager
def label(text: str | None) -> Iterator[None]:
    """Label the collectives issued inside (e.g. ``"bucket 3"``) for errors and the recorder.

    A context rather than an argument because it must cross code that is not
    gradring's: a DDP comm hook is the user's function, and the collectives it
    issues (through ``torch.distributed`` or ``gradring.comm``) carry the bucket's
    label without being told. gradring's own calls pass ``label=`` directly.
    """
    prev = getattr(_local, "label", None)
    _local.label = text
    try:
        yield
    finally:
        _local.label = prev


#: The flight recorder's name for what it keeps: one :class:`Collective` per call.
Entry = Collective


class FlightRecorder:
    """The last ``size`` collectives of this process, all groups together."""

    def __init__(self, size: int = FLIGHT_SIZE) -> None:
        self._ring: deque[Entry] = deque(maxlen=size)
        # Why the recorder was dumped so far ("timeout in all_reduce #7", "exit").
        self.reasons: list[str] = []
        # Group name -> this process's rank in it and its size (to know who is missing).
        self.groups: dict[str, dict[str, int]] = {}
        # Group name -> {peer rank: what this rank last saw of its progress} (seq it
        # started last, state), noted at failures: ``gradring flight`` uses it for a
        # rank that left no dump of its own.
        self.peers: dict[str, dict[str, dict[str, Any]]] = {}
        self._lock = threading.Lock()
        # Where dumps go when their folder is refused (created on first need; see
        # [Note: flight-recorder dumps in a folder other users can reach]).
        self._private_folder: str | None = None

    def note_group(self, name: str, rank: int, world_size: int) -> None:
        self.groups[name] = {"rank": rank, "world_size": world_size}

    def note_peers(self, group: str, progress: dict[int, dict[str, Any]]) -> None:
        """What this rank knows of its peers' progress in ``group`` (see ``peers``)."""
        self.peers[group] = {str(p): dict(v) for p, v in progress.items()}

    def issue(self, group: str, seq: int, kind: Kind | str, nbytes: int, dtype: torch.dtype,
              shape: Sequence[int], label: str | None = None, **run: Any) -> Collective:
        """A new :class:`Collective` kept in the ring, labelled ``label`` (else by the
        enclosing :func:`label`); ``run``: what it runs on (``output=``, ``input=``...)."""
        entry = Collective(group, seq, kind, nbytes, dtype, shape,
                           label if label is not None else getattr(_local, "label", None),
                           **run)
        self._ring.append(entry)  # deque.append is atomic under the GIL
        return entry

    def entries(self) -> list[Entry]:
        return list(self._ring)

    def clear(self) -> None:
        self._ring.clear()
        self.reasons = []
        self.peers = {}

    def snapshot(self, reason: str) -> dict[str, Any]:
        rank = dist_rank()
        return {"rank": rank, "pid": os.getpid(), "host": socket.gethostname(),
                "time": time.time(), "reasons": self.reasons + [reason],
                "groups": dict(self.groups), "peers": dict(self.peers),
                "entries": [e.as_dict() for e in self.entries()]}

    def dump(self, reason: str, directory: str | None = None) -> str | None:
        """Write this rank's buffer to ``directory`` (default ``$GRADRING_FLIGHT_RECORDER``).

        Returns the file written, or None when no folder is set or nothing could
        be written. See [Note: flight-recorder dumps in a folder other users can
        reach] for how the folder is checked and what happens when it is refused.
        """
        directory = directory or config.current().flight_recorder
        if not directory:
            return None
        with self._lock:
            data = self.snapshot(reason)
            self.reasons.append(reason)
            name = f"rank{data['rank']}.json" if data["rank"] >= 0 else f"pid{data['pid']}.json"
            text = json.dumps(data, indent=1)
            try:
                return write_into(directory, name, text)
            except UnsafeFolder as exc:
                why = str(exc)
            except OSError as exc:
                why = f"writing {name} there failed ({exc.strerror or exc})"
            try:
                if self._private_folder is None:
                    self._private_folder = tempfile.mkdtemp(prefix="gradring-flight-")
                path = write_into(self._private_folder, name, text)
            except OSError as exc:
                warnings.warn(f"gradring flight recorder: did not write into {directory}: {why}; "
                              f"writing to a private folder failed too ({exc}), so this dump "
                              "is lost", RuntimeWarning, stacklevel=2)
                return None
        warnings.warn(f"gradring flight recorder: did not write into {directory}: {why}. "
                      f"Wrote {name} to {self._private_folder} instead (read it with "
                      f"`gradring flight {self._private_folder}`).", RuntimeWarning, stacklevel=2)
        return path


class UnsafeFolder(OSError):
    """A dump folder that other users could use against us; the message says why."""


#: Create a file that did not exist, never through a link.
_NEW_FILE_FLAGS = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
                   | getattr(os, "O_CLOEXEC", 0))


def write_into(directory: str, name: str, text: str) -> str:
    """Write ``text`` to ``directory/name`` the safe way; return the path.

    Raises UnsafeFolder for a folder it refuses, OSError when writing fails (see
    [Note: flight-recorder dumps in a folder other users can reach]).
    """
    folder = _open_folder(directory)
    try:
        for _ in range(16):
            tmp = f"{name}.{os.getpid()}.{secrets.token_hex(6)}.tmp"
            try:
                fd = os.open(tmp, _NEW_FILE_FLAGS, 0o644, dir_fd=folder)
                break
            except FileExistsError:
                continue  # someone planted this name: draw another
        else:
            raise UnsafeFolder(f"16 fresh temporary names for {name} were all taken")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=folder)
            raise
    finally:
        os.close(folder)
    return os.path.join(directory, name)


def _open_folder(directory: str) -> int:
    """A descriptor of ``directory`` (created if missing) once it passes the checks of
    ``safe_files.open_folder``; raises UnsafeFolder saying why not."""
    try:
        return safe_files.open_folder(directory, create=True, mode=0o755)
    except safe_files.UnsafePath as exc:
        same = os.path.normpath(exc.path) == os.path.normpath(directory)
        raise UnsafeFolder(exc.reason if same else f"on its way, {exc.path}: {exc.reason}") \
            from exc
    except NotADirectoryError as exc:
        raise UnsafeFolder("it is not a folder") from exc
    except OSError as exc:
        raise UnsafeFolder(f"it cannot be opened ({exc.strerror or exc})") from exc


def dist_rank() -> int:
    """Global rank, or -1 outside a process group."""
    import torch.distributed as dist

    try:
        return dist.get_rank() if dist.is_initialized() else -1
    except Exception:  # noqa: BLE001 - being torn down
        return -1


#: This process's flight recorder (every group writes into it).
RECORDER = FlightRecorder()


def _dump_at_exit() -> None:
    if RECORDER.entries():
        RECORDER.dump("exit")


atexit.register(_dump_at_exit)
if hasattr(os, "register_at_fork"):  # a forked child's recorder starts empty
    os.register_at_fork(after_in_child=lambda: RECORDER.clear())
