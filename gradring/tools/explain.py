"""``gradring explain``: why is my DDP step slow? Read a run's traces and say.

    gradring explain trace.json          # a merged trace (gradring.observe.overlap.merge_traces)
    gradring explain run-folder/         # a folder of per-rank traces (export_chrome_trace)
    gradring explain trace.json --json   # the numbers, for scripts

Prints the step decomposed per rank (forward, backward, exposed
communication, last bucket, wait for peers, optimizer, other: medians over
the recorded steps), the straggler if one rank is slower, and findings ranked
by the time they cost, each with the change to make and the saving expected
from the measured numbers. From a live model: ``print(gradring.explain(ddp))``
on every rank. See docs/explain.md.
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gradring explain", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", help="merged trace JSON, one rank's trace, or a folder of them")
    ap.add_argument("--last", type=int, default=0,
                    help="medians over the newest N steady steps (default 0: every one "
                         "recorded after the first, as overlap_stats() and the demo)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of text")
    a = ap.parse_args(argv)
    from gradring.observe.explain import analyse, load

    try:
        x = analyse(load(a.trace), last_n=a.last)
    except (OSError, ValueError, KeyError) as exc:
        print(f"gradring explain: {exc}", file=sys.stderr)
        return 1
    if a.json:
        print(json.dumps({"ranks": x.ranks, "steps": x.steps,
                          "parts": {str(r): v for r, v in x.parts.items()},
                          "straggler": x.straggler,
                          "findings": [f._asdict() for f in x.findings], "notes": x.notes},
                         indent=1, default=str))
    else:
        print(x.text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
