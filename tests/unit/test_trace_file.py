"""The one file reader behind ``gradring explain``, ``timeline`` and ``flight``.

Every bad input of issue 54 section 3 (and issue 53's bad-input list) is made
here in tmp_path and handed to each of the three commands in-process: each
must exit with status 2 and print exactly one line on stderr that names the
file, and no traceback. Good files are checked against the standard
library's own reading of them (``json.load``, ``gzip``)."""

from __future__ import annotations

import gzip
import json
import os
import pickle
import re
import stat
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from gradring.tools import cli
from gradring.tools.trace_file import (
    DEFAULT_MAX_BYTES,
    TraceFileError,
    parse_size,
    read_json,
    trace_files,
)

pytestmark = pytest.mark.timeout(60)  # a FIFO or /dev/zero must never hang a command

DOC = {"traceEvents": [{"name": f"op{i}", "ph": "X", "ts": i, "dur": 1.5,
                        "args": {"Input Dims": [[4, 4]], "s": "[{\"x"}} for i in range(300)],
       "otherData": {"nested": {"a": [1, {"b": None}]}}, "unicode": "µs ✓"}
TEXT = json.dumps(DOC).encode()


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


# Each case: (file name in the run folder, how to make it, limit flag or None, words
# the one line must hold). The maker returns the path to hand to the commands.
def _truncated_json(p: Path) -> Path:
    return _write(p, TEXT[: len(TEXT) // 2])


def _truncated_gzip(p: Path) -> Path:
    whole = gzip.compress(TEXT)
    return _write(p, whole[: len(whole) // 2])


def _empty(p: Path) -> Path:
    return _write(p, b"")


def _binary(p: Path) -> Path:
    return _write(p, bytes(range(256)) * 4)


def _not_json_text(p: Path) -> Path:
    return _write(p, b"step 1: loss 0.25\nstep 2: loss 0.21\n")


def _deep_list(p: Path) -> Path:
    return _write(p, b"[" * 200_000)


def _deep_object(p: Path) -> Path:
    return _write(p, b'{"a":' * 200_000)


def _too_big(p: Path) -> Path:
    return _write(p, TEXT)  # about 40 KiB, run with a 1 KiB limit


def _gzip_bomb(p: Path) -> Path:
    return _write(p, gzip.compress(b'{"traceEvents": [' + b" " * (8 << 20) + b"]}"))


def _link_to_dev_zero(p: Path) -> Path:
    p.parent.mkdir(parents=True, exist_ok=True)
    os.symlink("/dev/zero", p)
    return p


def _fifo(p: Path) -> Path:
    p.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(p)
    return p


def _folder(p: Path) -> Path:
    p.mkdir(parents=True)
    return p


def _device(p: Path) -> Path:
    return Path("/dev/zero")


def _pickle(p: Path) -> Path:
    return _write(p, pickle.dumps(DOC))


def _pickle_protocol0(p: Path) -> Path:
    return _write(p, pickle.dumps([1, "a"], protocol=0))


CASES = {
    "truncated json": ("rank0.json", _truncated_json, None, "truncated"),
    "truncated gzip": ("rank0.pt.trace.json.gz", _truncated_gzip, None, "truncated"),
    "empty": ("rank0.json", _empty, None, "empty"),
    "binary": ("rank0.json", _binary, None, "binary"),
    "not json": ("rank0.json", _not_json_text, None, "not valid JSON"),
    "deep list": ("rank0.json", _deep_list, None, "nest too deeply"),
    "deep object": ("rank0.json", _deep_object, None, "nest too deeply"),
    "above the limit": ("rank0.json", _too_big, "1K", "--max-trace-bytes"),
    "gzip bomb": ("rank0.pt.trace.json.gz", _gzip_bomb, "64K", "--max-trace-bytes"),
    "link to /dev/zero": ("rank0.json", _link_to_dev_zero, None, "character device"),
    "fifo": ("rank0.json", _fifo, None, "FIFO"),
    "folder": ("rank0.json", _folder, None, "folder, not a file"),
    "device": ("rank0.json", _device, None, "character device"),
    "pickle": ("rank0.json", _pickle, None, "is a pickle, not JSON; gradring never unpickles"),
    "pickle protocol 0": ("rank0.json", _pickle_protocol0, None, "is a pickle"),
}


def _argv(command: str, run: Path, bad: Path, tmp_path: Path) -> list[str]:
    """The command line a user would type: explain and flight read the run folder
    (flight globs ``*.json`` only, so it is handed a gzip file itself); timeline reads
    one file; a path outside the folder (a device) is handed over as it is."""
    inside = bad.parent == run
    if command == "timeline":
        return ["timeline", str(bad), "-o", str(tmp_path / "t.png")]
    if command == "flight" and inside and bad.name.endswith(".json"):
        return ["flight", str(run)]
    if command == "explain" and inside:
        return ["explain", str(run)]
    return [command, str(bad)]


@pytest.mark.parametrize("command", ["explain", "timeline", "flight"])
@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_gets_one_line_and_status_2(command, case, tmp_path, capsys) -> None:
    name, make, limit, words = CASES[case]
    run = tmp_path / "run"
    bad = make(run / name)
    argv = _argv(command, run, bad, tmp_path) + (["--max-trace-bytes", limit] if limit else [])
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert code == 2, (argv, out, err)
    assert "Traceback" not in err + out
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"gradring {command}: ")
    assert str(bad) in lines[0], lines[0]
    assert words in lines[0], lines[0]
    assert not (tmp_path / "t.png").exists()


@pytest.mark.parametrize("gz", [False, True], ids=["json", "json.gz"])
def test_good_files_parse_as_json_load_does(gz, tmp_path) -> None:
    path = tmp_path / ("t.pt.trace.json.gz" if gz else "t.json")
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            json.dump(DOC, f)
        with gzip.open(path, "rt", encoding="utf-8") as f:
            expected = json.load(f)
    else:
        path.write_text(json.dumps(DOC, indent=1), encoding="utf-8")
        with open(path, encoding="utf-8") as f:
            expected = json.load(f)
    assert read_json(str(path)) == expected
    # Gzip is told by its bytes, not its name.
    renamed = tmp_path / "renamed.json"
    renamed.write_bytes(path.read_bytes())
    assert read_json(str(renamed)) == expected


def test_concatenated_gzip_members_and_zero_padding_read_as_gzip_does(tmp_path) -> None:
    data = gzip.compress(TEXT[:1000]) + gzip.compress(TEXT[1000:]) + b"\0" * 16
    path = _write(tmp_path / "t.json.gz", data)
    with gzip.open(path, "rb") as f:
        expected = json.loads(f.read())
    assert read_json(str(path)) == expected == DOC


def test_a_link_to_a_good_file_is_followed(tmp_path) -> None:
    target = _write(tmp_path / "real.json", TEXT)
    os.symlink(target, tmp_path / "link.json")
    assert read_json(str(tmp_path / "link.json")) == json.loads(TEXT)


def test_gzip_bomb_is_refused_without_filling_memory(tmp_path) -> None:
    """64 MiB of JSON in 64 KiB of gzip, read with a 1 MiB limit: the reader never
    holds much more than the limit (decompressing it whole would take 64 MiB)."""
    path = _write(tmp_path / "bomb.json.gz", gzip.compress(b"[" + b" " * (64 << 20) + b"]"))
    assert path.stat().st_size < 1 << 20
    tracemalloc.start()
    try:
        with pytest.raises(TraceFileError, match="decompresses to more than the limit of 1 MiB"):
            read_json(str(path), max_bytes=1 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak


def test_the_limit_is_inclusive_and_the_default_generous(tmp_path) -> None:
    path = _write(tmp_path / "t.json", TEXT)
    assert read_json(str(path), max_bytes=len(TEXT)) == DOC
    with pytest.raises(TraceFileError, match=f"above the limit of {len(TEXT) - 1} bytes"):
        read_json(str(path), max_bytes=len(TEXT) - 1)
    gz = _write(tmp_path / "t.json.gz", gzip.compress(TEXT))
    assert read_json(str(gz), max_bytes=len(TEXT)) == DOC
    with pytest.raises(TraceFileError, match="decompresses to more than"):
        read_json(str(gz), max_bytes=len(TEXT) - 1)
    assert DEFAULT_MAX_BYTES == 2 << 30


@pytest.mark.parametrize(("text", "size"), [("4G", 4 << 30), ("500M", 500 << 20),
                                            ("1048576", 1 << 20), ("1.5k", 1536),
                                            ("2GiB", 2 << 30), ("10 MB", 10 << 20)])
def test_sizes_for_the_flag(text, size) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "G", "4X", "-1M", "0"])
def test_bad_sizes_for_the_flag(text) -> None:
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


def test_a_bad_flag_value_is_argparse_s_usage_error(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["explain", str(tmp_path), "--max-trace-bytes", "lots"])
    assert exc.value.code == 2
    assert "'lots' is not a size" in capsys.readouterr().err


def test_trace_files_of_a_file_and_of_a_profiler_folder(tmp_path) -> None:
    """A folder as torch.profiler's tensorboard_trace_handler and gradring leave it."""
    single = _write(tmp_path / "one.json", TEXT)
    assert trace_files(str(single)) == [str(single)]
    run = tmp_path / "run"
    names = ["host_2.1700000000002.pt.trace.json.gz", "host_1.1700000000001.pt.trace.json",
             "rank1.json", "rank0.json", "rank-3.json.gz"]  # the last: HTA's folder layout
    for name in names:
        _write(run / name, TEXT)
    _write(run / "notes.txt", b"not a trace")
    _write(run / "checkpoint.pt", b"\x80\x02.")
    assert trace_files(str(run)) == sorted(str(run / n) for n in names)
    # Every listed file reads back as the document written.
    assert all(read_json(p) == DOC for p in trace_files(str(run))
               if not p.endswith(".gz"))


def test_trace_files_refuses_an_empty_folder_and_a_missing_path(tmp_path) -> None:
    (tmp_path / "empty").mkdir()
    _write(tmp_path / "only-text" / "log.txt", b"x")
    for folder in ("empty", "only-text"):
        with pytest.raises(TraceFileError, match="holds no trace files") as exc:
            trace_files(str(tmp_path / folder))
        assert str(tmp_path / folder) in str(exc.value)
    with pytest.raises(TraceFileError, match="no such file"):
        trace_files(str(tmp_path / "missing"))


@pytest.mark.parametrize("command", ["explain", "timeline", "flight"])
def test_missing_path_and_empty_folder(command, tmp_path, capsys) -> None:
    (tmp_path / "empty").mkdir()
    for target in (tmp_path / "missing.json", tmp_path / "empty"):
        argv = [command, str(target)] + (["-o", str(tmp_path / "t.png")]
                                         if command == "timeline" else [])
        code = cli.main(argv)
        out, err = capsys.readouterr()
        assert code == 2, (argv, out, err)
        assert len(err.splitlines()) == 1 and str(target) in err, err


def test_control_characters_in_a_name_stay_on_one_line(tmp_path) -> None:
    path = _write(tmp_path / "a\nb.json", b"")
    with pytest.raises(TraceFileError) as exc:
        read_json(str(path))
    assert "\n" not in str(exc.value) and "the file is empty" in str(exc.value)


def test_flight_refuses_json_that_is_not_a_dump(tmp_path, capsys) -> None:
    """Valid JSON of the wrong shape (a trace in the recorder's folder) is one line
    too, not a KeyError from inside the analysis."""
    for i, doc in enumerate(([1, 2], {"traceEvents": []},
                             {"rank": 0, "pid": 1, "entries": [{"seq": 1}]})):
        folder = tmp_path / f"fr{i}"
        _write(folder / "rank0.json", json.dumps(doc).encode())
        assert cli.main(["flight", str(folder)]) == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and "rank0.json" in err and "dump" in err, err


def test_no_file_was_left_behind_by_the_refusals(tmp_path) -> None:
    """The reader opens nothing for writing: a refused FIFO is still a FIFO and a
    refused file keeps its bytes."""
    fifo = _fifo(tmp_path / "f.json")
    with pytest.raises(TraceFileError):
        read_json(str(fifo))
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    big = _write(tmp_path / "big.json", TEXT)
    with pytest.raises(TraceFileError):
        read_json(str(big), max_bytes=10)
    assert big.read_bytes() == TEXT


def test_deep_nesting_is_refused_under_a_raised_recursion_limit(tmp_path) -> None:
    """With the interpreter's limit raised to 10**6, Python's JSON parser would run off
    the C stack (SIGSEGV on 100,000 nested ``[``); the reader refuses it all the same
    and gives the caller's limit back. Run in a child, which a crash cannot take down
    with the test run; the module is loaded by itself (no torch import)."""
    deep = _write(tmp_path / "deep.json", b"[" * 200_000 + b"]" * 200_000)
    module = Path(__file__).parents[2] / "gradring" / "tools" / "trace_file.py"
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('trace_file', {str(module)!r})\n"
        "tf = importlib.util.module_from_spec(spec); spec.loader.exec_module(tf)\n"
        "sys.setrecursionlimit(10**6)\n"
        "try:\n"
        f"    tf.read_json({str(deep)!r})\n"
        "except tf.TraceFileError as exc:\n"
        "    print(exc)\n"
        "print(sys.getrecursionlimit())\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, (res.returncode, res.stderr)
    said, limit = res.stdout.splitlines()
    assert "nest too deeply" in said and str(deep) in said and limit == str(10**6)


@pytest.mark.parametrize(("data", "words"), [
    (b"PK\x03\x04" + b"\0" * 60, "a zip archive (torch.save writes these)"),
    (b"\x28\xb5\x2f\xfd" + b"\0" * 60, "zstd-compressed"),
    (b"BZh91AY&SY" + b"\x01" * 60, "bzip2-compressed"),
    (b"\xfd7zXZ\x00" + b"\0" * 60, "xz-compressed"),
    (gzip.compress(TEXT) + b"junk", "data after the end of its gzip stream"),
    (gzip.compress(TEXT)[:-8] + b"\0" * 8, "corrupt gzip file"),
    (b"{} {}", "more than one JSON document"),
    (b"   \n\t ", "only whitespace"),
    (gzip.compress(pickle.dumps(DOC)), "is a pickle"),
], ids=["zip", "zstd", "bzip2", "xz", "gzip+junk", "gzip crc", "two docs", "blank",
        "gzipped pickle"])
def test_other_formats_are_named(data, words, tmp_path) -> None:
    path = _write(tmp_path / "t.json", data)
    with pytest.raises(TraceFileError, match=re.escape(words)) as exc:
        read_json(str(path))
    assert str(path) in str(exc.value) and "\n" not in str(exc.value)


def test_flight_reads_one_dump_file_as_its_folder(tmp_path, capsys) -> None:
    entry = {"group": "0", "seq": 1, "kind": "all_reduce", "nbytes": 16, "dtype": "float32",
             "shape": [4], "label": None, "algo": "x", "issued": 1.0, "started": 1.0,
             "ended": 2.0, "state": "completed", "error": ""}
    dump = {"rank": 0, "pid": 7, "host": "h", "time": 3.0, "reasons": ["exit"],
            "entries": [entry]}
    _write(tmp_path / "fr" / "rank0.json", json.dumps(dump).encode())
    assert cli.main(["flight", str(tmp_path / "fr" / "rank0.json")]) == 0
    by_file = capsys.readouterr().out
    assert cli.main(["flight", str(tmp_path / "fr")]) == 0
    assert capsys.readouterr().out == by_file and "1 dump(s): rank 0" in by_file


def test_a_file_of_several_gigabytes_is_refused_by_its_size(tmp_path, capsys) -> None:
    """A sparse 3 GiB file (no disk used) is refused by the default limit before a
    byte is read; the line names a value of the flag that would admit it."""
    path = tmp_path / "huge.json"
    with open(path, "wb") as f:
        f.truncate(3 << 30)
    assert cli.main(["explain", str(path)]) == 2
    err = capsys.readouterr().err
    assert "it is 3 GiB, above the limit of 2 GiB per file" in err, err
    assert "--max-trace-bytes 4G" in err, err
