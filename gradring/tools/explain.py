"""``gradring explain``: why is my DDP step slow? Read a run's traces and say.

The command line of ``gradring.tools.explain_record`` (see docs/explain.md): the
step decomposed per rank, the straggler if one rank is slower, and findings
ranked by the time they cost, each with the change to make and the saving
expected from the measured numbers. From a live model:
``print(gradring.explain(ddp))`` on every rank.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def parser() -> argparse.ArgumentParser:
    """``gradring explain``'s command line."""
    from gradring.tools.helpfmt import command_parser
    from gradring.tools.trace_file import add_limit_flag

    ap = command_parser(
        "gradring explain",
        "Say why a DDP training step is slow, from the traces a run wrote. Prints each "
        "rank's step cut into forward, backward, the communication the backward did not "
        "hide (waiting for other ranks, the last bucket, earlier buckets), copying "
        "gradients, optimizer and the rest, as means over the recorded steps that add up "
        "to the step; the rank the others wait for, if any; and findings ranked by the "
        "time they cost, each with the change to make and the saving expected from this "
        "run's numbers.",
        [("gradring explain run/trace.json", "a merged trace (all ranks)"),
         ("gradring explain run/", "a folder of per-rank traces"),
         ("gradring explain run/trace.json --json", "the same figures as JSON, for scripts")],
        "Write the traces with gradring.observe.overlap.export_chrome_trace on every rank "
        "(and merge_traces on one), or run `gradring demo`, which writes them. See "
        "docs/explain.md.")
    ap.add_argument("trace", help="a merged trace, one rank's trace, or a folder of them")
    ap.add_argument("--last", type=int, default=0, metavar="N",
                    help="summarise the newest N steps only; 0 takes every step recorded "
                         "after the first, the steps ddp.overlap_stats() summarises")
    ap.add_argument("--json", action="store_true", help="print JSON instead of text")
    ap.add_argument("--link-curve", default=None, metavar="FILE",
                    help="the output of `gradring bench allreduce` on this host, saved to a "
                         "file: on a CPU gloo trace of torch's DDP, explain then predicts what "
                         "gradring's collectives would save (default: none)")
    add_limit_flag(ap)
    return ap


def explain_path(path: str, *, last_n: int = 0, max_bytes: int | None = None,
                 link_curve: str | None = None) -> Any:
    """The ``Explanation`` of the trace(s) at ``path``: gradring's own record (written by
    ``export_chrome_trace``) or torch.profiler traces of torch's or gradring's DDP.
    Raises ``TraceFileError`` for a file that cannot be read and ``ValueError`` (one line)
    for a trace explain cannot explain."""
    from gradring.tools.analysis import explain_model
    from gradring.tools.explain_record import analyse, records_of
    from gradring.tools.read_profiler import is_profiler_trace, read_profiler
    from gradring.tools.trace_file import read_json, trace_files

    docs = [(p, read_json(p, max_bytes=max_bytes)) for p in trace_files(path)]
    records = records_of(docs)
    if records:
        return analyse(records, last_n=last_n)
    profiled = [(p, d) for p, d in docs if is_profiler_trace(d)]
    if not profiled:
        raise ValueError(f"{path}: neither a torch.profiler trace (traceEvents with "
                         "ProfilerStep spans) nor gradring's step record (written by "
                         "gradring.observe.overlap.export_chrome_trace)")
    link = None
    if link_curve is not None:
        from gradring.tools.findings import parse_link_curve

        with open(link_curve, errors="replace") as f:
            link = parse_link_curve(f.read(1 << 20))
        if not link:
            raise ValueError(f"{link_curve}: no rows of `gradring bench allreduce` with both "
                             "gradring-shm (comm.empty) and gloo native")
    return explain_model(read_profiler(profiled), link, last_n)


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if a.last < 0:
        print("gradring explain: --last must be 0 (every step) or more", file=sys.stderr)
        return 2
    from gradring.tools.trace_file import TraceFileError

    try:
        x = explain_path(a.trace, last_n=a.last, max_bytes=a.max_trace_bytes,
                         link_curve=a.link_curve)
    except TraceFileError as exc:
        print(f"gradring explain: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError, KeyError) as exc:
        print(f"gradring explain: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(x.as_json(), indent=1, default=str))
    else:
        print(x.text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
