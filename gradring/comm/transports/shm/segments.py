"""Named shared-memory segments under /dev/shm: naming, mapping, cleanup.

[Note: segment names and leaks]
A segment is ``/dev/shm/gradring-<pid>-<pidns>-<transport>-<digest>``: the
owner's pid and pid-namespace inode (so a later process can tell whether the
owner still lives), a per-process transport counter, and a keyed hash of the
segment's number under the owning rank's own *naming key*
(:func:`segment_name`), which sits in its control segment (``layout.KEY_OFF``,
mode 0600) and never in the store, so nobody can derive and squat a future
name. A taken name (``O_EXCL``) is skipped; 16 in a row (:class:`NamesTaken`)
count as a full /dev/shm (``space.py``). Peers open segments with
``O_NOFOLLOW`` and refuse what is not a 0600 regular file of their user
(:meth:`Segment.open`); names from the store must pass :func:`check_name`.
Owners unlink on close and at exit; after a ``kill -9`` survivors unlink the
dead owner's prefix (:func:`remove_dead_owners`), and what remains goes at the
next connect or a live job's sweep (:func:`remove_stale_segments`, [Note: a
live job sweeps too]). docs/reliability.md ("Hostile neighbours", "Leaks")
tells the rest.

[Note: whose segment is stale]
Several jobs share one /dev/shm and every process sweeps it, so a sweep must
never take a live job's segment. It trusts one fact only: the owner's pid and
pid namespace in the name (not the store, the job or the boot id). A name is
stale when its namespace is ours and no live (non-zombie) process has its pid.
Two rules keep this true when pids are reused:

- The directory is listed *before* the owner is judged dead: every listed
  name was created before the listing, so a pid absent afterwards means its
  creator is gone. In the other order, a process given the same pid in
  between could lose its fresh segments.
- A live pid is never judged dead: a reused pid can make a dead owner look
  alive (a leak until that pid ends), never the reverse.

A process whose pid namespace cannot be read (0) sweeps nothing.
``tests/jobs/test_concurrent_jobs.py`` sweeps in a loop beside crashing jobs.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import mmap
import os
import re
import resource
import stat
import weakref
from typing import Any

import numpy as np
import torch

SHM_DIR = "/dev/shm"
PREFIX = "gradring-"


def pid_namespace() -> int:
    """Inode of this process's pid namespace (0 if unknown)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return pid_state(pid) not in ("Z", "X")  # "" (unreadable) counts as alive


def pid_state(pid: int) -> str:
    """The kernel's one-letter state of ``pid`` (``/proc/<pid>/stat``): ``T`` stopped
    (SIGSTOP), ``t`` stopped by a debugger, ``Z`` zombie...; "" if unknown or gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        end = stat.rindex(b")")
        return stat[end + 2:end + 3].decode("ascii", "replace")
    except (OSError, ValueError):
        return ""


def pid_stopped(pid: int) -> bool:
    """True while ``pid`` is stopped (SIGSTOP, SIGTSTP, or held by a debugger)."""
    return pid_state(pid) in ("T", "t")


def segment_base(pid: int, ns: int, transport: int) -> str:
    """Common prefix of one transport's segments (see :func:`segment_name`)."""
    return f"{PREFIX}{pid}-{ns}-{transport}"


_NAME = re.compile(r"gradring-[0-9]+-[0-9]+-[0-9a-f-]{1,120}")


def check_name(name: str) -> str:
    """``name`` if it can be one of ours; ValueError for anything else (a name with a
    path separator, dots, or foreign characters, e.g. from a corrupted store)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"refusing shared-memory segment name {name!r}: not a gradring "
                         f"name (gradring-<pid>-<pidns>-..., no path separator)")
    return name


def segment_name(base: str, key: bytes, segno: int) -> str:
    """Name of segment ``segno`` of the transport whose prefix is ``base``: a keyed
    hash, unpredictable without its owner's naming ``key`` (see the module note)."""
    digest = hashlib.blake2b(f"{base}/{segno}".encode(), key=key,
                             digest_size=8).hexdigest()
    return f"{base}-{digest}"


def owner_of(name: str) -> tuple[int, int] | None:
    """``(pid, pidns)`` encoded in a segment name, or None for foreign names."""
    if not name.startswith(PREFIX):
        return None
    parts = name[len(PREFIX):].split("-")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def remove_stale_segments(directory: str = SHM_DIR) -> list[str]:
    """Unlink every gradring segment of this pid namespace whose owner is dead.

    Safe beside other jobs (see [Note: whose segment is stale]): nothing
    when this process's pid namespace is unknown."""
    ns = pid_namespace()
    removed: list[str] = []
    if ns == 0:
        return removed
    try:
        names = os.listdir(directory)  # listed before any owner is judged dead
    except OSError:
        return removed
    alive: dict[int, bool] = {}  # each owner judged once per sweep, after the listing
    for name in names:
        owner = owner_of(name)
        if owner is None or owner[1] != ns:
            continue
        pid = owner[0]
        if pid not in alive:
            alive[pid] = pid_alive(pid)
        if alive[pid]:
            continue
        try:
            os.unlink(os.path.join(directory, name))
            removed.append(name)
        except OSError:
            pass  # someone else removed it first
    return removed


#: Seconds between two sweeps of a live process (:func:`sweep_if_due`).
SWEEP_S = 60.0
_last_sweep = float("-inf")


def sweep_if_due(now: float, *, force: bool = False) -> None:
    """:func:`remove_stale_segments` if the last sweep of this process was ``SWEEP_S``
    seconds before ``now`` (``time.monotonic()``) or more, or ``force``.

    [Note: a live job sweeps too]
    A job whose ranks were all killed -9 leaves segments nobody removes, and a
    job running beside them for days connects no more. So a rank whose shm wait
    slept a whole slice sweeps too, at most once per ``SWEEP_S``: a sleeping
    wait is idle time (a collective whose peers are there never sleeps), and a
    sweep takes well under a millisecond for a few hundred names."""
    global _last_sweep
    if force or now - _last_sweep >= SWEEP_S:
        _last_sweep = now
        remove_stale_segments()


def remove_dead_owners(base: str, directory: str = SHM_DIR) -> list[str]:
    """Unlink every segment of this user named ``<base>-...`` whose owner is dead: what a
    dead peer of this job left (``base`` came through the rendezvous)."""
    owner = owner_of(base)
    removed: list[str] = []
    if owner is None:
        return removed
    try:  # list first, then judge the owner: see [Note: whose segment is stale]
        names = [n for n in os.listdir(directory) if n.startswith(base + "-")]
    except OSError:
        return removed
    if pid_alive(owner[0]):
        return removed
    for name in names:
        path = os.path.join(directory, name)
        try:
            if os.lstat(path).st_uid == os.geteuid():
                os.unlink(path)
                removed.append(name)
        except OSError:
            pass  # gone already
    return removed


def unlink_quietly(name: str, owner_pid: int | None = None) -> None:
    """Remove ``name`` if it exists (and, given ``owner_pid``, only from that process)."""
    if owner_pid is not None and os.getpid() != owner_pid:
        return
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except OSError:
        pass


class Segment:
    """One mapped segment: its bytes as a tensor, its 32-bit words, its address."""

    def __init__(self, name: str, mm: memoryview, *, owner: bool, fd: int = -1) -> None:
        # /dev/shm name (without directory), to unlink and to show in errors.
        self.name = name
        # The mapping (bytes, see :func:`map_shared`); everything below is a view of it.
        self.mm = mm
        # Size in bytes.
        self.size = len(mm)
        # Whether this process created it (and so unlinks it).
        self.owner = owner
        # Byte view for data (typed views are slices of it, then .view(dtype)).
        self.bytes: torch.Tensor | None = torch.frombuffer(mm, dtype=torch.uint8)
        # The same bytes for numpy.copyto (memcpy) in the mailboxes.
        self.array: np.ndarray | None = np.frombuffer(mm, dtype=np.uint8)
        # 32-bit word view for counters, read from Python without numpy overhead.
        self.words = memoryview(mm).cast("I")
        # Keeps the mapping's base address valid for futex calls.
        self._pin = ctypes.c_char.from_buffer(mm)
        # Base address of the mapping in this process.
        self.address = ctypes.addressof(self._pin)
        # False once unlinked (or never owned).
        self._linked = owner
        # The creating process: a forked child must not unlink its parent's segments.
        self._pid = os.getpid()
        # An open descriptor of the segment, kept only where asked (file locks), else -1.
        self.fd = fd
        # Its number within the owner's transport (0 until the transport sets it).
        self.segno = 0

    @classmethod
    def create(cls, name: str, size: int, *, keep_fd: bool = False) -> Segment:
        mm, fd = _create_mapping(name, size, keep_fd=keep_fd)
        return cls(name, mm, owner=True, fd=fd)

    @classmethod
    def open(cls, name: str, *, keep_fd: bool = False, min_size: int = 0) -> Segment:
        """Map a peer's segment: never through a symlink, only a regular file of this
        user with mode 0600 and at least ``min_size`` bytes (else PermissionError or
        ValueError naming what is wrong)."""
        try:
            fd = os.open(os.path.join(SHM_DIR, check_name(name)),
                         os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):  # say which limit
                raise LimitReached.files(name, 0, exc.errno) from None
            raise
        try:
            st = os.fstat(fd)
            mode = stat.S_IMODE(st.st_mode)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or mode & 0o077:
                raise PermissionError(
                    errno.EPERM, f"refusing {SHM_DIR}/{name}: owner uid {st.st_uid}, mode "
                    f"{mode:o}; expected a regular file of uid {os.geteuid()} with mode 600")
            if st.st_size < max(min_size, 1):
                raise ValueError(f"{SHM_DIR}/{name} has {st.st_size} bytes, expected at "
                                 f"least {max(min_size, 1)}")
            mm = map_shared(fd, st.st_size, name)
        except BaseException:
            os.close(fd)
            raise
        if not keep_fd:
            os.close(fd)
            fd = -1
        return cls(name, mm, owner=False, fd=fd)

    def view(self, offset: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat typed tensor over ``[offset, offset + nbytes)``."""
        assert self.bytes is not None
        return self.bytes[offset:offset + nbytes].view(dtype)

    def unlink(self) -> None:
        if self._linked and os.getpid() == self._pid:
            self._linked = False
            unlink_quietly(self.name)

    def close(self) -> None:
        """Unlink (if owned) and unmap; a mapping still viewed by tensors is left to GC."""
        self.unlink()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.words.release()
        self.bytes = None
        self.array = None
        del self._pin
        try:
            self.mm.release()  # unmapped now unless someone else still views it
        except BufferError:
            pass  # a caller still holds a tensor on it: unmapped when that goes

    def __repr__(self) -> str:
        return f"Segment({self.name!r}, {self.size} bytes)"


def user_segment(name: str, nbytes: int) -> tuple[torch.Tensor, Any]:
    """Create a segment for ``comm.empty``: returns its byte tensor and the mapping.

    The tensor keeps the mapping alive; nothing else here holds it, so it is
    unmapped when the caller's last view goes.
    """
    mm, _ = _create_mapping(name, nbytes)
    return torch.frombuffer(mm, dtype=torch.uint8, count=nbytes), mm


def page_round(nbytes: int) -> int:
    """``nbytes`` rounded up to whole pages (at least one): a segment's real size."""
    return max(mmap.PAGESIZE, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)


class ShmFull(OSError):
    """/dev/shm has no room for a segment: nothing was created.

    [Note: reserving shared memory]
    A segment that is only ``ftruncate``d is sparse: its pages are allocated
    when first touched, and a page that no longer fits in /dev/shm kills the
    toucher with SIGBUS. So every segment is reserved whole at creation
    (``posix_fallocate``); when that fails the caller gets this error, and
    the transport falls back (see ``space.py``) instead of dying later.
    """

    def __init__(self, name: str, needed: int, free: int, total: int) -> None:
        super().__init__(errno.ENOSPC, f"no room in {SHM_DIR} for {name}: needs "
                         f"{needed} bytes, {free} of {total} bytes free")
        self.needed, self.free, self.total = needed, free, total


def shm_space(directory: str = SHM_DIR) -> tuple[int, int]:
    """``(free, total)`` bytes of the filesystem under ``directory`` (0, 0 if unknown)."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return 0, 0
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


class NamesTaken(ShmFull):
    """Every one of a rank's next names for a segment exists already (squatted):
    handled like a full /dev/shm (see the module note), with its own message."""

    def __init__(self, base: str, tries: int, needed: int) -> None:
        OSError.__init__(self, errno.EEXIST, f"{tries} fresh shared-memory names of {base} "
                         f"all exist already in {SHM_DIR}: is someone squatting them?")
        self.needed, self.free, self.total = needed, 0, 0


class LimitReached(ShmFull):
    """A limit of the process, not of /dev/shm, stops a new segment: open files
    (``RLIMIT_NOFILE``; a segment needs a descriptor only while it is created or
    mapped, see :func:`map_shared`) or mappings (``vm.max_map_count``). Handled like a
    full /dev/shm, with a message that names the limit."""

    def __init__(self, code: int, text: str, needed: int) -> None:
        OSError.__init__(self, code, text)
        self.needed, self.free, self.total = needed, 0, 0

    @classmethod
    def files(cls, name: str, needed: int, code: int = errno.EMFILE) -> LimitReached:
        if code == errno.ENFILE:
            return cls(code, f"cannot open {SHM_DIR}/{name}: the system's limit on open "
                       f"files is reached (fs.file-max)", needed)
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        return cls(code, f"cannot open {SHM_DIR}/{name}: this process has reached its "
                   f"limit of {soft} open files (RLIMIT_NOFILE, `ulimit -n`)", needed)

    @classmethod
    def mappings(cls, name: str, needed: int) -> LimitReached:
        return cls(errno.ENOMEM, f"cannot map {SHM_DIR}/{name}: this process has reached "
                   f"its limit on memory mappings (vm.max_map_count) or of address space "
                   f"(RLIMIT_AS)", needed)


_libc = ctypes.CDLL(None, use_errno=True)
_mmap = _libc.mmap
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                  ctypes.c_long]
_munmap = _libc.munmap
_munmap.restype = ctypes.c_int
_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def map_shared(fd: int, size: int, name: str = "") -> memoryview:
    """Map ``size`` bytes of ``fd`` shared, read-write, holding no descriptor: the
    bytes of the mapping as a memoryview, unmapped once nothing views them.

    [Note: a mapping holds no descriptor]
    ``mmap.mmap`` keeps a duplicate descriptor per mapping, so a model with one
    bucket per parameter ran out of ``ulimit -n`` (64 in some containers) where
    torch's DDP trains it. The kernel needs no descriptor to keep a mapping, so
    gradring calls ``mmap(2)`` itself and the caller closes its descriptor at
    once. The memoryview (``Segment.mm``) exports a ctypes array over the
    mapping; ``munmap`` runs when that array dies, after the last tensor or view
    on it (each holds it through the buffer protocol), so nothing reads an
    unmapped page; not at interpreter exit, where a reading thread must not fault.
    """
    addr = _mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == _MAP_FAILED:
        code = ctypes.get_errno()
        if code == errno.ENOMEM:
            raise LimitReached.mappings(name, size)
        raise OSError(code, f"cannot map {SHM_DIR}/{name}: {os.strerror(code)}")
    raw = (ctypes.c_ubyte * size).from_address(addr)
    weakref.finalize(raw, _munmap, addr, size).atexit = False
    return memoryview(raw).cast("B")


def _reserve(fd: int, name: str, size: int) -> None:
    """Allocate every page of the segment now (see [Note: reserving shared memory])."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
            raise ShmFull(name, size, *shm_space()) from None
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        free, _ = shm_space()  # no fallocate on this filesystem: check the space at least
        if free and free < size:
            raise ShmFull(name, size, *shm_space()) from None


def _create_mapping(name: str, nbytes: int, *,
                    keep_fd: bool = False) -> tuple[memoryview, int]:
    """Create ``/dev/shm/<name>`` (never an existing one), sized to whole pages and
    reserved (:class:`ShmFull` if it does not fit, :class:`LimitReached` past a
    process limit), and map it."""
    size = max(mmap.PAGESIZE, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
    try:
        fd = os.open(os.path.join(SHM_DIR, name),
                     os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            raise LimitReached.files(name, size, exc.errno) from None
        raise
    try:
        os.ftruncate(fd, size)
        _reserve(fd, name, size)
        mm = map_shared(fd, size, name)
    except BaseException:
        os.close(fd)
        unlink_quietly(name)
        raise
    if keep_fd:
        return mm, fd
    os.close(fd)
    return mm, -1
