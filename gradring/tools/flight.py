"""``gradring flight DIR``: merge every rank's flight-recorder dump and name the culprit.

Each rank writes ``DIR/rank<R>.json`` when one of its collectives fails and
at exit (``GRADRING_FLIGHT_RECORDER=DIR``, see ``gradring/comm/watchdog.py``).
A killed rank writes nothing; what the surviving ranks saw of its progress
when they failed (its shm status block or its peer-board post, kept in their
dumps under ``peers``) stands in for it. This command lines the dumps up by process
group and sequence number and reports the *first disagreement*: the first
collective that some rank never reached, that ranks issued differently (kind,
size, dtype, shape), or that did not complete everywhere. For every rank it
shows what that rank was doing there instead, and when it arrived relative to
the first rank that gave up.

    GRADRING_FLIGHT_RECORDER=/tmp/fr torchrun --nproc-per-node=2 train.py
    gradring flight /tmp/fr
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
from typing import Any, NamedTuple

from gradring.tools.trace_file import TraceFileError, add_limit_flag, read_json

#: Seconds after which an arrival counts as late (the rank was not there in time).
LATE_S = 1.0


class Finding(NamedTuple):
    """The first collective of a group the ranks disagree on."""

    group: str
    seq: int
    lines: list[str]  # one per rank, then the verdict
    culprits: list[int]  # group ranks that did not reach it, reached it late or differ


#: How flight's messages call the files it reads.
WHAT = "flight-recorder dump"


def _check_dump(path: str, data: Any) -> dict[str, Any]:
    """``data`` if it has the shape of a recorder dump, else TraceFileError naming ``path``."""
    if not isinstance(data, dict) or not isinstance(data.get("entries"), list):
        raise TraceFileError(path, "it is JSON but not a flight-recorder dump (no \"entries\" "
                                   "list; `gradring explain` reads traces)", WHAT)
    for key in ("rank", "pid"):
        if not isinstance(data.get(key), int):
            raise TraceFileError(path, f"it is not a flight-recorder dump (no integer "
                                       f"\"{key}\")", WHAT)
    fields = {"group": str, "seq": int, "kind": str, "nbytes": int, "dtype": str,
              "issued": (int, float), "state": str}
    for i, e in enumerate(data["entries"]):
        if not isinstance(e, dict) or not all(isinstance(e.get(k), t) for k, t in fields.items()):
            raise TraceFileError(path, f"entry {i} is not a recorded collective (it needs "
                                       + ", ".join(fields) + ")", WHAT)
    return data


def load(directory: str, *, max_bytes: int | None = None) -> dict[int, dict[str, Any]]:
    """Every dump in ``directory`` (or the one dump file ``directory`` names), by global
    rank (pid for dumps without one). An unreadable dump raises TraceFileError;
    ``max_bytes``: the largest file read (see gradring.tools.trace_file)."""
    paths = sorted(glob.glob(os.path.join(glob.escape(directory), "*.json"))) \
        if os.path.isdir(directory) else [directory]
    dumps: dict[int, dict[str, Any]] = {}
    for path in paths:
        data = _check_dump(path, read_json(path, max_bytes=max_bytes, what=WHAT))
        key = data["rank"] if data["rank"] >= 0 else 1_000_000 + data["pid"]
        dumps[key] = data
    return dumps


def _group_ranks(dumps: dict[int, dict[str, Any]], group: str) -> tuple[dict[int, int], int]:
    """Group rank of each dump that knows the group, and the group's size."""
    ranks, size = {}, 0
    for key, d in dumps.items():
        info = d.get("groups", {}).get(group)
        if info is not None:
            ranks[key] = info["rank"]
            size = max(size, info["world_size"])
        elif any(e["group"] == group for e in d["entries"]):
            ranks[key] = key
    return ranks, max(size, max(ranks.values(), default=-1) + 1)


def reported_progress(dumps: dict[int, dict[str, Any]], group: str,
                      rank: int) -> dict[str, Any] | None:
    """What the other ranks saw of ``rank``'s progress in ``group`` when they failed
    (its shm status or its peer-board post): the report with the highest seq."""
    best = None
    for d in dumps.values():
        seen = d.get("peers", {}).get(group, {}).get(str(rank))
        if seen is not None and (best is None or seen.get("seq", 0) > best.get("seq", 0)):
            best = seen
    return best


def _fingerprint(e: dict[str, Any]) -> tuple:
    return e["kind"], e["nbytes"], e["dtype"], tuple(e.get("shape") or ())


def _describe(e: dict[str, Any]) -> str:
    shape = f", shape {e['shape']}" if e.get("shape") else ""
    label = f", {e['label']}" if e.get("label") else ""
    return f"{e['kind']} #{e['seq']} ({e['nbytes']} bytes, {e['dtype']}{shape}{label})"


def _first_line(text: str, limit: int = 200) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[:limit] + "..."


def analyse_group(dumps: dict[int, dict[str, Any]], group: str) -> Finding | None:
    """The first disagreement in ``group``, or None if every rank agrees."""
    ranks, size = _group_ranks(dumps, group)
    by_rank: dict[int, dict[int, dict[str, Any]]] = {r: {} for r in range(size)}
    for key, gr in ranks.items():
        for e in dumps[key]["entries"]:
            if e["group"] == group:
                by_rank[gr][e["seq"]] = e
    dumped = set(ranks.values())
    # A rank without a dump reached every collective up to the one the others saw it
    # start last (a collective needs every rank): count it there, not missing.
    reached = {r: p.get("seq", 0) for r in range(size) if r not in dumped
               and (p := reported_progress(dumps, group, r)) is not None}
    # Ring buffers forget old entries: only compare where every dump still remembers.
    floor = max((min(s) for s in by_rank.values() if s), default=0)
    seqs = sorted({q for s in by_rank.values() for q in s if q >= floor})
    for seq in seqs:
        here = {r: s[seq] for r, s in by_rank.items() if seq in s}
        kinds = {_fingerprint(e) for e in here.values()}
        present = len(here) + sum(seq <= last for last in reached.values())
        if present == size and len(kinds) == 1 and \
                all(e["state"] == "completed" for e in here.values()):
            continue
        return _finding(group, seq, size, here, by_rank, dumped, dumps, ranks)
    return None


def _finding(group: str, seq: int, size: int, here: dict[int, dict[str, Any]],
             by_rank: dict[int, dict[int, dict[str, Any]]], dumped: set[int],
             dumps: dict[int, dict[str, Any]], ranks: dict[int, int]) -> Finding:
    gave_up = min((e["ended"] for e in here.values() if e["state"] == "failed" and e["ended"]),
                  default=None)
    first = min(e["issued"] for e in here.values())
    majority = max({_fingerprint(e) for e in here.values()},
                   key=lambda fp: sum(_fingerprint(e) == fp for e in here.values()))
    reasons = {gr: dumps[key].get("reasons", []) for key, gr in ranks.items()}
    lines, culprits = [], []
    for r in range(size):
        e = here.get(r)
        if e is None:
            culprits.append(r)
            if r not in dumped:
                seen = reported_progress(dumps, group, r)
                if seen is not None and seen.get("seq", 0) >= seq:
                    culprits.remove(r)  # it was there, as far as the others could see
                    lines.append(f"rank {r}: left no dump; the others saw it in "
                                 f"{seen.get('what') or '#' + str(seen['seq'])} "
                                 f"({seen.get('state', '?')}, from its {seen.get('source')})")
                    continue
                last = (f"; the others saw it last start {seen.get('what') or seen['seq']} "
                        f"({seen.get('state', '?')}"
                        + (", alive" if seen.get("alive") else "")
                        + f", from its {seen.get('source')})") if seen else ""
                lines.append(f"rank {r}: did not reach it; left no dump (killed, or still "
                             f"running when the others gave up){last}")
                continue
            older = [q for q in by_rank[r] if q < seq]
            last = by_rank[r][max(older)] if older else None
            what = f"last: {_describe(last)} {last['state']}" if last else "no collective"
            why = "; ".join(reasons.get(r, [])[-2:])
            lines.append(f"rank {r}: did not reach it; {what}" + (f" (dumped: {why})"
                                                                   if why else ""))
            continue
        late = e["issued"] - (gave_up if gave_up is not None else first)
        note = ""
        if gave_up is not None and e["issued"] > gave_up:
            note = f", reached it {late:.1f}s after the first rank gave up"
            culprits.append(r)
        elif _fingerprint(e) != majority:
            note = ", issued a different collective"
            culprits.append(r)
        elif e["issued"] - first > LATE_S:
            note = f", arrived {e['issued'] - first:.1f}s after the first rank"
        err = f": {_first_line(e['error'])}" if e.get("error") else ""
        lines.append(f"rank {r}: {_describe(e)} {e['state']}{note}{err}")
    reached = sorted(r for r in here if r not in culprits)
    lines.append(f"verdict: ranks {reached} reached #{seq} in time; "
                 f"ranks {sorted(set(culprits))} did not (or disagree)")
    return Finding(group, seq, lines, sorted(set(culprits)))


def analyse(dumps: dict[int, dict[str, Any]]) -> list[Finding]:
    groups = sorted({e["group"] for d in dumps.values() for e in d["entries"]})
    return [f for g in groups if (f := analyse_group(dumps, g)) is not None]


def parser() -> argparse.ArgumentParser:
    """``gradring flight``'s command line."""
    from gradring.tools.helpfmt import command_parser

    ap = command_parser(
        "gradring flight",
        "Find the collective a hung or failed job got stuck on. With the flight "
        "recorder on, every rank writes what its recent collectives were when one of "
        "them fails and at exit; this command lines the ranks' records up and reports "
        "the first collective that some rank never reached, issued differently, or did "
        "not complete, and what each rank was doing instead. Exits with status 1 when "
        "it finds one.",
        [("GRADRING_FLIGHT_RECORDER=/tmp/fr torchrun --nproc-per-node=2 train.py",
          "run the job with the flight recorder writing into /tmp/fr"),
         ("gradring flight /tmp/fr", "then read what the ranks wrote")],
        "A rank that was killed writes nothing; what the other ranks saw of it stands "
        "in for it. See docs/reliability.md.")
    ap.add_argument("directory",
                    help="the folder GRADRING_FLIGHT_RECORDER pointed to (rank<R>.json "
                         "files), or one of its files")
    add_limit_flag(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    """Print the merged view; exit status 1 when a disagreement was found."""
    args = parser().parse_args(argv)
    if not os.path.exists(args.directory):
        print(f"gradring flight: {args.directory}: no such folder", file=sys.stderr)
        return 2
    try:
        dumps = load(args.directory, max_bytes=args.max_trace_bytes)
    except TraceFileError as exc:
        print(f"gradring flight: {exc}", file=sys.stderr)
        return 2
    if not dumps:
        print(f"gradring flight: no flight-recorder dumps (rank*.json) in {args.directory}",
              file=sys.stderr)
        return 2
    print(f"{len(dumps)} dump(s): " + ", ".join(
        f"rank {d['rank']} (pid {d['pid']}, {len(d['entries'])} entries, "
        f"{_first_line('; '.join(d.get('reasons', [])), 80)})" for d in dumps.values()))
    findings = analyse(dumps)
    if not findings:
        print("every rank reached and completed every recorded collective")
        return 0
    for f in findings:
        print(f"first disagreement: group {f.group} #{f.seq}")
        for line in f.lines:
            print(f"  {line}")
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
