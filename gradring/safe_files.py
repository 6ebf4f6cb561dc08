"""Files gradring writes (and the checkpoints it reads) where other local users can reach.

[Note: output files in folders other users can reach]
Jobs often run as root, and their files often go to shared places (``/tmp``,
a group's scratch folder). Another local user may have created the folder
beforehand, or planted a symbolic link (or a hard link, or a FIFO) at a name
gradring is about to write; writing through it would let that user overwrite
any file root can. Every file the tools write therefore goes through this
module:

- Folders are reached one component at a time, each opened relative to the
  previous one with ``O_NOFOLLOW``. A symbolic link on the way is followed
  only if this job's user or root owns it; one owned by anybody else is
  refused (the kernel's ``fs.protected_symlinks`` does the same in sticky
  folders, but it is off on some machines). Missing folders are created with
  mode 0700 when the caller asks for it.
- The folder that holds the file must be owned by this job's user or root,
  and if others may write to it, it must be sticky (then nobody else can
  rename or remove what we create there). :func:`make_output_dir` is stricter:
  a folder it hands out is writable by its owner alone.
- :func:`open_output` opens the file relative to that folder with
  ``O_CREAT | O_NOFOLLOW`` and no truncation, and only then, on the opened
  file itself, checks that it is a regular file of ours with no other hard
  link; it truncates afterwards. A link, or a file somebody else made, is
  refused before a byte changes.
- :func:`atomic_output` writes a fresh temporary file (``O_CREAT | O_EXCL |
  O_NOFOLLOW``, mode 0600) and renames it over the final name through the
  folder's descriptor; an existing final name that is not a regular file of
  ours is refused first. A rename never follows a link.
- :func:`open_private_input` opens a file for reading only if it is a regular
  file of ours that nobody else may write to, in a folder that passes the
  checks above (a checkpoint is code-adjacent data: see checkpoint.py).

A refusal raises :class:`UnsafePath` (an ``OSError``) whose message names the
path and the reason.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Iterator
from typing import IO, Any

#: Open a folder without following a link at the name itself.
_DIR_FLAGS = (os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
#: Open (or create) an output file: never through a link, never blocking on a FIFO.
_OUTPUT_FLAGS = (os.O_WRONLY | os.O_CREAT | _NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
                 | getattr(os, "O_NONBLOCK", 0))
#: Create a file that did not exist, never through a link.
_NEW_FILE_FLAGS = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW
                   | getattr(os, "O_CLOEXEC", 0))
#: Open an input file: never through a link, never blocking on a FIFO.
_INPUT_FLAGS = (os.O_RDONLY | _NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
                | getattr(os, "O_NONBLOCK", 0))


class UnsafePath(OSError):
    """A path gradring refuses to use because another user could turn it against us.

    ``path`` is the path refused and ``reason`` why, in words ("it is a
    symbolic link owned by uid 65534"); the message carries both."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"refusing {path}: {reason}")
        self.path = path
        self.reason = reason


def _me() -> int:
    return os.geteuid() if hasattr(os, "geteuid") else 0


def folder_refusal(st: os.stat_result, *, shared_ok: bool = True) -> str | None:
    """Why a folder with status ``st`` is refused, or None when it is accepted.

    Accepted: owned by this job's user or root, and writable by nobody else --
    or, with ``shared_ok``, writable by others but sticky."""
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a folder"
    if not hasattr(os, "geteuid"):
        return None  # no owners to compare (Windows)
    me = _me()
    if st.st_uid not in (me, 0):
        return f"it is owned by uid {st.st_uid}, not by this job's user (uid {me}) or root"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        if not shared_ok:
            return f"other users may write to it (mode {stat.filemode(st.st_mode)})"
        if not st.st_mode & stat.S_ISVTX:
            return (f"other users may write to it (mode {stat.filemode(st.st_mode)}) and it "
                    "is not sticky")
    return None


def _file_refusal(st: os.stat_result, *, writing: bool) -> str | None:
    """Why an existing file with status ``st`` is refused, or None."""
    if not stat.S_ISREG(st.st_mode):
        return "it is not a regular file"
    me = _me()
    if hasattr(os, "geteuid") and st.st_uid != me:
        return f"it is owned by uid {st.st_uid}, not by this job's user (uid {me})"
    if writing and st.st_nlink > 1:
        return f"it has {st.st_nlink - 1} other hard link(s)"
    if not writing and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"other users may write to it (mode {stat.filemode(st.st_mode)})"
    return None


def _step(parent: int, name: str, shown: str, create: bool, mode: int) -> int:
    """Open folder ``name`` inside folder descriptor ``parent`` (see the Note)."""
    for _ in range(3):  # a name that appears or changes kind meanwhile: look again
        try:
            return os.open(name, _DIR_FLAGS | _NOFOLLOW, dir_fd=parent)
        except FileNotFoundError:
            if not create:
                raise
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, mode, dir_fd=parent)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
                raise
            st = os.stat(name, dir_fd=parent, follow_symlinks=False)
            if not stat.S_ISLNK(st.st_mode):
                raise NotADirectoryError(errno.ENOTDIR, "not a folder", shown) from exc
            me = _me()
            if hasattr(os, "geteuid") and st.st_uid not in (me, 0):
                raise UnsafePath(shown, f"it is a symbolic link owned by uid {st.st_uid}, not "
                                        f"by this job's user (uid {me}) or root") from exc
            # A link of ours or root's: follow it.
            return os.open(name, _DIR_FLAGS, dir_fd=parent)
    raise UnsafePath(shown, "it kept changing while it was opened")


def open_folder(path: str, *, create: bool = False, mode: int = 0o700,
                shared_ok: bool = True) -> int:
    """A descriptor of folder ``path``, reached without untrusted links, once it passes
    :func:`folder_refusal`. ``create``: make missing folders with ``mode``.
    The caller closes the descriptor."""
    path = os.fspath(path)
    parts = [p for p in path.split(os.sep) if p not in ("", ".")]
    fd = os.open(os.sep if os.path.isabs(path) else ".", _DIR_FLAGS)
    try:
        for i, part in enumerate(parts):
            shown = (os.sep if os.path.isabs(path) else "") + os.sep.join(parts[:i + 1])
            nxt = _step(fd, part, shown, create, mode)
            os.close(fd)
            fd = nxt
        why = folder_refusal(os.fstat(fd), shared_ok=shared_ok)
        if why is not None:
            raise UnsafePath(path or ".", why)
    except BaseException:
        os.close(fd)
        raise
    return fd


def make_output_dir(path: str, *, fresh: bool = False) -> str:
    """Make folder ``path`` (missing parts with mode 0700) for a tool's output; return it.

    An existing folder is accepted only if it is ours (or root's) and nobody
    else may write to it; with ``fresh`` it must not exist at all."""
    path = os.fspath(path)
    if fresh:
        parent, name = os.path.split(os.path.normpath(path))
        pfd = open_folder(parent or ".", create=True)
        try:
            try:
                os.mkdir(name, 0o700, dir_fd=pfd)
            except FileExistsError:
                raise UnsafePath(path, "it already exists (this folder must be new)") from None
        finally:
            os.close(pfd)
    os.close(open_folder(path, create=True, shared_ok=False))
    return path


def make_fresh_dir(prefix: str, parent: str = ".") -> str:
    """A new folder ``parent/prefix`` (mode 0700), or ``prefix-XXXXXXXX`` if that name
    is taken; never a folder that existed before."""
    candidates = [prefix] + [f"{prefix}-{secrets.token_hex(4)}" for _ in range(16)]
    for name in candidates:
        path = os.path.join(parent, name) if parent != "." else name
        try:
            return make_output_dir(path, fresh=True)
        except UnsafePath as exc:
            if "already exists" not in exc.reason:
                raise
    raise UnsafePath(os.path.join(parent, prefix), "17 fresh names were all taken")


def _split(path: str) -> tuple[str, str]:
    path = os.fspath(path)
    folder, name = os.path.split(path)
    if not name or name in (".", ".."):
        raise IsADirectoryError(errno.EISDIR, "not a file name", path)
    return folder or ".", name


def open_output(path: str, mode: str = "w", *, perms: int = 0o666) -> IO[Any]:
    """Open ``path`` for writing (``mode`` "w", "wb", "a" or "ab") the safe way.

    Creates it with ``perms`` (less the umask) if missing; refuses a link, a
    file that is not a regular file of ours, one with other hard links, and a
    folder that fails :func:`folder_refusal` (see the Note)."""
    if mode not in ("w", "wb", "a", "ab"):
        raise ValueError(f"open_output: mode {mode!r} is not one of w, wb, a, ab")
    folder, name = _split(path)
    dfd = open_folder(folder)
    try:
        try:
            fd = os.open(name, _OUTPUT_FLAGS, perms, dir_fd=dfd)
        except OSError as exc:
            # ELOOP for a link, ENXIO for a FIFO nobody reads, EACCES where the kernel's
            # fs.protected_* settings refuse: say what is there, if it is refusable.
            _check_existing(dfd, name, path, writing=True, cause=exc)
            raise
    finally:
        os.close(dfd)
    try:
        why = _file_refusal(os.fstat(fd), writing=True)
        if why is not None:
            raise UnsafePath(path, why)
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        if mode.startswith("w"):
            os.ftruncate(fd, 0)
        else:
            os.lseek(fd, 0, os.SEEK_END)
        return os.fdopen(fd, mode)
    except BaseException:
        os.close(fd)
        raise


@contextlib.contextmanager
def atomic_output(path: str, mode: str = "wb", *, create_folders: bool = False,
                  perms: int = 0o600) -> Iterator[IO[Any]]:
    """Write a new ``path`` whole or not at all: yields a fresh temporary file in the
    same folder, then flushes it to disk and renames it over ``path``.

    ``create_folders``: make missing folders (mode 0700). An existing ``path``
    that is not a regular file of ours is refused before anything is written."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_output: mode {mode!r} is not w or wb")
    folder, name = _split(path)
    dfd = open_folder(folder, create=create_folders)
    try:
        _check_existing(dfd, name, path)
        for _ in range(16):
            tmp = f".{name}.{os.getpid()}.{secrets.token_hex(6)}.tmp"
            try:
                fd = os.open(tmp, _NEW_FILE_FLAGS, perms, dir_fd=dfd)
                break
            except FileExistsError:
                continue
        else:
            raise UnsafePath(path, "16 fresh temporary names next to it were all taken")
        try:
            with os.fdopen(fd, mode) as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            _check_existing(dfd, name, path)
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
            raise
        with contextlib.suppress(OSError):  # the rename itself on disk
            os.fsync(dfd)
    finally:
        os.close(dfd)


def _check_existing(dfd: int, name: str, path: str, *, writing: bool = True,
                    cause: BaseException | None = None) -> None:
    """Refuse (UnsafePath) an existing ``name`` in ``dfd`` that is not a regular file
    of ours; ``cause``: the error that made us look."""
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePath(path, f"it is a symbolic link (owned by uid {st.st_uid})") from cause
    why = _file_refusal(st, writing=writing)
    if why is not None:
        raise UnsafePath(path, why) from cause


def check_output(path: str) -> str:
    """Refuse ``path`` now (UnsafePath) if :func:`open_output` would refuse it later:
    its folder fails the checks, or something other than a regular file of ours is
    there. Returns ``path``. A tool calls it before long work, so that it fails early."""
    folder, name = _split(path)
    dfd = open_folder(folder)
    try:
        _check_existing(dfd, name, path)
    finally:
        os.close(dfd)
    return path


def open_private_input(path: str) -> IO[bytes]:
    """Open ``path`` for reading in binary, only if it is a regular file of ours that no
    other user may write to, in a folder that passes :func:`folder_refusal`.
    A missing file or folder raises FileNotFoundError."""
    folder, name = _split(path)
    dfd = open_folder(folder)
    try:
        try:
            fd = os.open(name, _INPUT_FLAGS, dir_fd=dfd)
        except FileNotFoundError:
            raise
        except OSError as exc:
            _check_existing(dfd, name, path, writing=False, cause=exc)
            raise
    finally:
        os.close(dfd)
    try:
        why = _file_refusal(os.fstat(fd), writing=False)
        if why is not None:
            raise UnsafePath(path, why)
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
