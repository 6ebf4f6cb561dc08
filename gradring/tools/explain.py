"""``gradring explain``: why is my DDP step slow? Read a run's traces and say.

The command line of ``gradring.observe.explain`` (see docs/explain.md): the
step decomposed per rank, the straggler if one rank is slower, and findings
ranked by the time they cost, each with the change to make and the saving
expected from the measured numbers. From a live model:
``print(gradring.explain(ddp))`` on every rank.
"""

from __future__ import annotations

import argparse
import json
import sys


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
    add_limit_flag(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if a.last < 0:
        print("gradring explain: --last must be 0 (every step) or more", file=sys.stderr)
        return 2
    from gradring.observe.explain import analyse, load
    from gradring.tools.trace_file import TraceFileError

    try:
        x = analyse(load(a.trace, max_bytes=a.max_trace_bytes), last_n=a.last)
    except TraceFileError as exc:
        print(f"gradring explain: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError, KeyError) as exc:
        print(f"gradring explain: {exc}", file=sys.stderr)
        return 1
    if a.json:
        print(json.dumps(x.as_json(), indent=1, default=str))
    else:
        print(x.text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
