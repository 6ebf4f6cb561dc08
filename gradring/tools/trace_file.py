"""The one reader behind every gradring command that reads a JSON file from disk.

``gradring explain``, ``gradring timeline``, ``gradring flight`` and the
torch.profiler trace reader all read their input through :func:`read_json`,
so a bad file gets the same answer everywhere: a :class:`TraceFileError`
whose message is one line naming the file and the problem, which each
command prints to stderr before it exits with status 2. Never a traceback,
never a hang, never a read that fills memory.

[Note: what the reader refuses, and how]
- Not a regular file. The path is looked at with ``stat`` before it is
  opened, so a device (``/dev/zero``, a tape that rewinds when opened) is
  never opened at all; then it is opened with ``O_NONBLOCK`` (a FIFO that
  appears meanwhile cannot block the open) and checked again with ``fstat``
  on the descriptor itself, which is what is read. Unlike
  :mod:`gradring.safe_files`, which guards the files gradring *writes*, a
  symbolic link is followed: a link cannot turn a read against the user the
  way it can turn a write, and trace folders are often linked. What the link
  reaches must be a regular file. No message quotes the file's contents.
- Above the size limit. A plain file's size is known before a byte is read;
  a gzip file is decompressed in slices of at most 1 MiB of output and given
  up as soon as the output passes the limit, so a gzip bomb costs at most the
  limit in memory. The limit is per file; ``--max-trace-bytes`` raises it.
- Not JSON: an empty file, a pickle (its protocol marker ``0x80``, or for
  old protocols a stream of pickle opcodes ending in STOP, read with
  :mod:`pickletools`, which only lists opcodes; gradring never unpickles), a
  zip archive (what ``torch.save`` writes), another compression than gzip,
  binary data, text that is not valid JSON, and a truncated file or gzip
  stream (said as such: "ends early").
- Deep nesting. Python's C JSON parser counts its nesting against the
  interpreter's recursion limit and raises ``RecursionError`` at once (200,000
  nested ``[`` fail in well under a millisecond); that is caught and said.
  A program that raised the limit far (``sys.setrecursionlimit(10**6)``) would
  let the parser run off the C stack instead: 100,000 nested ``[`` killed
  Python 3.11 with SIGSEGV that way, while 60,000 still parsed on an 8 MiB
  stack. So while it parses, the reader caps the limit at 5,000, which leaves
  room for threads with small stacks, and puts the caller's limit back after.

Gzip is recognised by its magic bytes (``1f 8b``), not by the name's suffix,
so ``tensorboard_trace_handler(use_gzip=True)``'s ``.pt.trace.json.gz`` and
a gzip file without the suffix are both read.
"""

from __future__ import annotations

import argparse
import gc
import glob
import io
import json
import os
import pickletools
import re
import stat
import sys
import zlib
from typing import Any

#: The largest file :func:`read_json` reads, in bytes of (uncompressed) JSON: 2 GiB.
#: A torch.profiler event takes about 250 bytes of JSON (a synthetic trace of one
#: million CPU-op events with their input shapes was 244 MB), so this admits
#: traces of several million events, beyond the profiles people record with
#: ``schedule(active=...)``. Parsing costs about seven times the text in memory
#: (that trace peaked at 1.7 GB, with ``json.load`` as with this reader), so
#: 2 GiB of text already needs a machine with 14 GB free. A larger file is far
#: more likely a mistake (a checkpoint, a log, a link to /dev/zero) than a
#: trace, and is refused at once instead of after minutes of reading.
#: ``--max-trace-bytes`` raises the limit.
DEFAULT_MAX_BYTES: int = 2 << 30

#: The command-line flag that raises the limit, named in the refusal.
LIMIT_FLAG = "--max-trace-bytes"

_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
#: Compressed bytes read at a time, and decompressed bytes produced at a time.
_CHUNK = 1 << 20
_GZIP_MAGIC = b"\x1f\x8b"
#: Other formats named when found instead of JSON: magic bytes -> what it is.
_OTHER_FORMATS = (
    (b"PK\x03\x04", "a zip archive (torch.save writes these)"),
    (b"\x28\xb5\x2f\xfd", "zstd-compressed; decompress it first (only gzip is read)"),
    (b"BZh", "bzip2-compressed; decompress it first (only gzip is read)"),
    (b"\xfd7zXZ\x00", "xz-compressed; decompress it first (only gzip is read)"),
)
#: The recursion limit the JSON parser runs under at most (see the Note): far
#: below what overflows a thread's stack, far above any trace's nesting.
_PARSE_RECURSION_LIMIT = 5000
#: Pickles of at most this many bytes are checked for old-protocol opcodes.
_PICKLE_SCAN_BYTES = 16 << 20


class TraceFileError(ValueError):
    """A file a gradring command cannot read as JSON; the message is one line naming
    the file and the problem. ``path`` is the file, ``reason`` the problem."""

    def __init__(self, path: str, reason: str, what: str = "trace") -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"cannot read {what} {_shown(path)}: {reason}")


def _shown(path: str) -> str:
    """``path`` on one line: quoted with escapes if it holds control characters."""
    path = os.fspath(path)
    return path if path.isprintable() else ascii(path)


def human_bytes(n: int) -> str:
    """``n`` bytes in words: "17 bytes", "1.5 KiB", "2 GiB"."""
    if n < 1024:
        return f"{n} bytes"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}".replace(".0 ", " ")
    raise AssertionError("unreachable")


_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", re.IGNORECASE)


def parse_size(text: str) -> int:
    """A byte count from ``text``: a number with an optional K, M, G or T (powers of
    1024; "KiB", "MB" and the like are read the same). "4G" is 4 GiB."""
    m = _SIZE.fullmatch(text)
    if m is None:
        raise ValueError(f"{text!r} is not a size (examples: 500M, 4G, 1048576)")
    value = float(m.group(1)) * 1024 ** " kmgt".index(m.group(2).lower() or " ")
    if value < 1:
        raise ValueError(f"{text!r}: the size must be at least 1 byte")
    return int(value)


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_limit_flag(ap: argparse.ArgumentParser) -> None:
    """Add ``--max-trace-bytes SIZE`` to a command's parser (``args.max_trace_bytes``)."""
    ap.add_argument(LIMIT_FLAG, type=_size_arg, default=DEFAULT_MAX_BYTES, metavar="SIZE",
                    help="refuse input files larger than this, uncompressed (K, M, G or T "
                         f"suffix; default {human_bytes(DEFAULT_MAX_BYTES)})")


def _raise_hint(size: int | None, limit: int) -> str:
    """Advice naming the flag, with a value that admits ``size`` (unknown: twice the limit)."""
    want = size + 1 if size is not None else 2 * limit
    unit, step = ("G", 1 << 30) if want > (1 << 30) else ("M", 1 << 20)
    return f"raise the limit with {LIMIT_FLAG} (for example {LIMIT_FLAG} {-(-want // step)}{unit})"


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder, not a file"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe), not a regular file"
    if stat.S_ISCHR(mode):
        return "a character device, not a regular file"
    if stat.S_ISBLK(mode):
        return "a block device, not a regular file"
    if stat.S_ISSOCK(mode):
        return "a socket, not a regular file"
    return "not a regular file"


def _refuse_kind(path: str, mode: int, what: str) -> TraceFileError:
    kind = _kind(mode)
    if os.path.islink(path):
        try:
            target = _shown(os.readlink(path))
        except OSError:
            target = "?"
        return TraceFileError(path, f"it is a symbolic link to {target}, which is {kind}", what)
    return TraceFileError(path, f"it is {kind}", what)


def _os_reason(path: str, exc: OSError) -> str:
    if isinstance(exc, FileNotFoundError):
        return "it is a symbolic link to nothing" if os.path.islink(path) else "no such file"
    if isinstance(exc, PermissionError):
        return "permission denied"
    return exc.strerror or str(exc)


def _open_regular(path: str, what: str) -> tuple[int, int]:
    """An open descriptor of regular file ``path`` and its size (see the Note)."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise _refuse_kind(path, st.st_mode, what)
        fd = os.open(path, _READ_FLAGS)
    except OSError as exc:
        raise TraceFileError(path, _os_reason(path, exc), what) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # it changed between the two looks
            raise _refuse_kind(path, st.st_mode, what)
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def _too_big(path: str, what: str, limit: int, size: int | None, *, gz: bool) -> TraceFileError:
    shown_limit = human_bytes(limit)
    if gz:
        said = f"it decompresses to more than the limit of {shown_limit} per file"
    else:
        shown_size = human_bytes(size or 0)
        if shown_size == shown_limit:  # the rounding would hide the difference
            shown_size, shown_limit = f"{size} bytes", f"{limit} bytes"
        said = f"it is {shown_size}, above the limit of {shown_limit} per file"
    return TraceFileError(path, f"{said}; {_raise_hint(None if gz else size, limit)}", what)


def _read_plain(f: io.BufferedReader, size: int, limit: int, path: str, what: str) -> bytes:
    """All of ``f``: ``size`` bytes (its size when opened) in one read, then, should
    it have grown meanwhile, more in slices up to ``limit``."""
    chunks: list[bytes] = []
    total, want = 0, size + 1  # one byte more: tells whether it grew
    while True:
        chunk = f.read(min(want, limit + 1 - total))
        if not chunk:
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.append(chunk)
        total += len(chunk)
        if total > limit:  # it grew while read
            raise _too_big(path, what, limit, total, gz=False)
        want = 64 << 20


def _read_gzip(f: io.BufferedReader, limit: int, path: str, what: str) -> bytearray:
    """Decompress the gzip stream(s) from ``f``, at most ``limit`` bytes of output."""
    out = bytearray()
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    pending = b""
    try:
        while True:
            if d.eof:  # one gzip member ended: another may follow (gzip allows that)
                rest = d.unused_data + pending
                if not rest:
                    rest = f.read(_CHUNK)
                    if not rest:
                        return out
                if not rest.startswith(_GZIP_MAGIC[:len(rest)]) or len(rest) < 2:
                    if rest.strip(b"\x00") or f.read(_CHUNK).strip(b"\x00"):
                        raise TraceFileError(path, "it has data after the end of its "
                                                   "gzip stream", what)
                    return out  # zeros after the stream: padding, which gzip allows
                d = zlib.decompressobj(16 + zlib.MAX_WBITS)
                pending = rest
            if not pending:
                pending = f.read(_CHUNK)
                if not pending:
                    raise TraceFileError(path, "its gzip stream ends early after "
                                               f"{human_bytes(len(out))} of data (a "
                                               "truncated file)", what)
            out += d.decompress(pending, min(_CHUNK, limit + 1 - len(out)))
            pending = d.unconsumed_tail
            if len(out) > limit:
                raise _too_big(path, what, limit, None, gz=True)
    except zlib.error as exc:
        raise TraceFileError(path, f"it is a corrupt gzip file ({exc})", what) from None


def _is_pickle(data: bytes | bytearray) -> bool:
    """Whether ``data`` is a pickle, read as opcodes only (nothing is unpickled)."""
    if data[:1] == b"\x80" and data[1:2] and 2 <= data[1] <= 5:
        return True  # the protocol marker of pickles of protocol 2 and newer
    if len(data) > _PICKLE_SCAN_BYTES or not data.rstrip().endswith(b"."):
        return False
    stream = io.BytesIO(data)
    try:
        ops = [op.name for op, _, _ in pickletools.genops(stream)]
    except Exception:  # noqa: BLE001 - any opcode error means: not a pickle
        return False
    return bool(ops) and ops[-1] == "STOP" and not data[stream.tell():].strip()


def _not_json(data: bytes | bytearray, exc: ValueError) -> str:
    """Why ``data`` did not parse, in words; ``exc`` is the parser's error."""
    where = ""
    if isinstance(exc, json.JSONDecodeError):
        where = (f"{exc.msg.lower().removesuffix(' at')} at line {exc.lineno} "
                 f"column {exc.colno}")
    if not data:
        return "the file is empty"
    if not data.strip():
        return "the file holds only whitespace"
    if _is_pickle(data):
        return "it is a pickle, not JSON; gradring never unpickles"
    for magic, name in _OTHER_FORMATS:
        if data.startswith(magic):
            return f"it is {name}, not JSON"
    if isinstance(exc, UnicodeDecodeError) or b"\x00" in data[:4096]:
        return f"it is binary data, not JSON (it starts with bytes {bytes(data[:4]).hex(' ')})"
    if isinstance(exc, json.JSONDecodeError):
        end = len(data.rstrip())
        if exc.pos >= end or exc.msg.startswith("Unterminated string"):
            return f"it ends early, at byte {end} of JSON (a truncated file; {where})"
        if exc.msg == "Extra data":
            return (f"it holds more than one JSON document (extra data at line {exc.lineno} "
                    f"column {exc.colno})")
        return f"it is not valid JSON ({where})"
    return f"it is not valid JSON ({exc})"


def _loads(data: bytes | bytearray) -> Any:
    """``json.loads`` under a recursion limit of at most _PARSE_RECURSION_LIMIT, with
    the cyclic garbage collector paused: a trace parses into millions of dicts and
    lists, none of them garbage yet, and each collection pass the allocations set off
    walks all of them again (a 168 MB trace parsed in 15 s with it, 6 s without)."""
    old = sys.getrecursionlimit()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        if old <= _PARSE_RECURSION_LIMIT:
            return json.loads(data)
        sys.setrecursionlimit(_PARSE_RECURSION_LIMIT)
        try:
            return json.loads(data)
        finally:
            sys.setrecursionlimit(old)
    finally:
        if was_enabled:
            gc.enable()


def read_json(path: str, *, max_bytes: int | None = None, what: str = "trace") -> Any:
    """The JSON document in ``path`` (plain or gzip-compressed), parsed.

    ``max_bytes``: the most bytes of (uncompressed) JSON to accept, default
    :data:`DEFAULT_MAX_BYTES`. ``what`` names the kind of file in messages
    ("trace", "flight-recorder dump"). Raises :class:`TraceFileError` for
    anything that is not such a document within the limit (see the Note)."""
    path = os.fspath(path)
    limit = DEFAULT_MAX_BYTES if max_bytes is None else int(max_bytes)
    if limit < 1:
        raise ValueError(f"read_json: max_bytes must be at least 1, not {max_bytes}")
    fd, size = _open_regular(path, what)
    with os.fdopen(fd, "rb") as f:
        if size > limit:  # a gzip file this big holds more JSON still
            raise _too_big(path, what, limit, size, gz=False)
        try:
            if f.peek(2)[:2] == _GZIP_MAGIC:  # peek: the bytes stay to be read
                data = _read_gzip(f, limit, path, what)
            else:
                data = _read_plain(f, size, limit, path, what)
        except OSError as exc:
            raise TraceFileError(path, _os_reason(path, exc), what) from None
    if data[:1] == b"\x80":  # never hand a pickle to a parser, even to fail
        if _is_pickle(data):
            raise TraceFileError(path, "it is a pickle, not JSON; gradring never unpickles", what)
    try:
        return _loads(data)
    except RecursionError:
        raise TraceFileError(path, f"its arrays or objects nest too deeply to be a {what} "
                                   "(deeper than Python's JSON parser goes)", what) from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise TraceFileError(path, _not_json(data, exc), what) from None


#: What a folder given to a command is searched for: torch.profiler's
#: tensorboard_trace_handler writes ``<worker>.<time>.pt.trace.json[.gz]``;
#: gradring's own per-rank traces are ``rank<R>.json`` (and a merged
#: ``trace.json``), so every ``*.json`` is taken as today.
#: A folder's trace files: torch.profiler's ``*.pt.trace.json[.gz]``, gradring's
#: ``rank<R>.json``, and the gzipped per-rank names HTA reads (``rank-N.json.gz``).
TRACE_PATTERNS = ("*.json", "*.json.gz")


def trace_files(path: str) -> list[str]:
    """The trace files ``path`` names: ``[path]`` for a file, the per-rank traces of
    a folder (``*.pt.trace.json``, ``*.pt.trace.json.gz`` as torch.profiler's
    ``tensorboard_trace_handler`` writes them, and gradring's ``rank<R>.json``),
    and any other ``*.json.gz`` (HTA's ``rank-N.json.gz``),
    sorted. A missing path, or a folder without traces, raises TraceFileError."""
    path = os.fspath(path)
    try:
        st = os.stat(path)
    except OSError as exc:
        raise TraceFileError(path, _os_reason(path, exc)) from None
    if not stat.S_ISDIR(st.st_mode):
        return [path]
    if not os.access(path, os.R_OK | os.X_OK):
        raise TraceFileError(path, "permission denied (cannot list the folder)")
    pattern_dir = glob.escape(path)
    found = sorted({p for pat in TRACE_PATTERNS for p in glob.glob(os.path.join(pattern_dir, pat))})
    if not found:
        raise TraceFileError(path, "the folder holds no trace files (*.json or *.json.gz: "
                                   "torch.profiler's *.pt.trace.json[.gz], gradring's "
                                   "rank<R>.json)")
    return found
