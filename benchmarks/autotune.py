"""Does tuning bucket_cap_mb beat the 25 MiB default here? Predicted and measured, side by side.

    python benchmarks/autotune.py                        # mlp_b1 and deep_mlp, world 2, ~2 min
    python benchmarks/autotune.py --models mlp --rounds 5 --nproc 2

For each model, ``gradring.tools.tune.tune_bucket_cap`` measures the plain model's
per-parameter gradient-ready times and the all-reduce time against message
size, predicts the step time at every candidate cap (see [Note: how the tuner
decides] in gradring/tools/tune.py), and then *runs gradring DDP at every candidate
cap*, rounds interleaved, so the prediction can be checked cap by cap.

The last lines compare, measured in the same run, the tuned cap against the
default: ``measured tuned/default`` below 1.00 means tuning won. Where it does
not, the same lines show why, in milliseconds: how much exposed communication
the default leaves (the most any cap can save), and how far every measured
step sits above its prediction (what the model leaves out: the reducer's
copies and, on a CPU-only machine, collectives competing with the backward for
the same cores).
"""

from __future__ import annotations

import argparse
import statistics
import sys

from gradring.tools import tune, workloads

CAPS_MB = (1, 2, 4, 8, 16, 25, 50, 100)


def summarize(name: str, r: tune.TuneResult) -> list[str]:
    c, d = r.measured[r.chosen.cap_mb], r.measured[r.default.cap_mb]
    best_cap = min(r.measured, key=lambda cap: r.measured[cap]["step_ms"])
    gaps = [r.measured[q.cap_mb]["step_ms"] - q.step_ms for q in r.predictions
            if q.cap_mb in r.measured]
    return [
        f"{name}: tuned cap {r.chosen.cap_mb:g} MiB, measured tuned/default "
        f"{c['step_ms'] / d['step_ms']:.3f} ({c['step_ms']:.1f} vs {d['step_ms']:.1f} ms/step); "
        f"fastest measured cap {best_cap:g} MiB ({r.measured[best_cap]['step_ms']:.1f} ms)",
        f"  predicted exposed: default {r.default.exposed_ms:.1f} ms, tuned "
        f"{r.chosen.exposed_ms:.1f} ms -> at most {r.default.exposed_ms - r.chosen.exposed_ms:.1f} "
        f"ms/step to win, {100 * (r.default.step_ms - r.chosen.step_ms) / r.default.step_ms:.1f}% "
        f"of the predicted step",
        f"  measured exposed: default {d['exposed_ms']:.1f} ms, tuned {c['exposed_ms']:.1f} ms; "
        f"measured minus predicted step: median {statistics.median(gaps):.1f} ms "
        f"(min {min(gaps):.1f}, max {max(gaps):.1f}) on a {r.profile.step_ms:.1f} ms plain step",
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["mlp_b1", "deep_mlp"],
                    choices=sorted(workloads.BUILTIN))
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args(argv)
    summary = []
    for name in a.models:
        r = tune.tune_bucket_cap(nproc=a.nproc, workload=name, caps_mb=CAPS_MB, steps=a.steps,
                                 rounds=a.rounds, measure_all=True)
        print(tune.report(r, nproc=a.nproc, name=name), flush=True)
        print()
        summary += summarize(name, r)
    print("\n".join(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
