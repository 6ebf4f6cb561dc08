"""The ``gradring`` command: demo, bench and friends."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "demo": ("gradring.tools.demo", "train digits on N local processes and check the result"),
    "bench": ("gradring.tools.bench", "benchmarks: `gradring bench allreduce|ddp|hooks [args]`"),
    "timeline": ("gradring.observe.timeline", "draw a merged Chrome trace as a Gantt chart (PNG)"),
    "tune": ("gradring.tools.tune",
             "pick bucket_cap_mb by measuring, then check it by running DDP"),
    "flight": ("gradring.tools.flight",
               "merge flight-recorder dumps and name the stuck collective"),
    "explain": ("gradring.tools.explain",
                "why is my DDP step slow? step breakdown and measured findings from a trace"),
    "plan": ("gradring.tools.plan",
             "predict step time and scaling, 2-1024 ranks (alpha-beta model)"),
}


def _bench(argv: list[str]) -> int:
    from gradring.tools.bench import BENCHMARKS

    if not argv or argv[0] not in BENCHMARKS:
        lines = [] if not argv or argv[0] in ("-h", "--help") else \
            [f"gradring bench: unknown benchmark '{argv[0]}'"]
        lines += [f"usage: gradring bench {'|'.join(BENCHMARKS)} [options]   (--help for each)",
                 ""]
        lines += [f"  {name:<10}{text}" for name, (_, text) in BENCHMARKS.items()]
        lines += ["", "A source checkout's benchmarks/ also holds autotune.py, trace_cost.py "
                  "and multihost.py", "(run them there with python benchmarks/NAME.py)."]
        print("\n".join(lines))
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    mod = importlib.import_module(f"gradring.tools.bench.{BENCHMARKS[argv[0]][0]}")
    return int(mod.main(argv[1:], prog=f"gradring bench {argv[0]}") or 0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: gradring COMMAND [options]\n\ncommands:")
        for name, (_, text) in COMMANDS.items():
            print(f"  {name:<10}{text}")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "bench":
        return _bench(rest)
    if cmd not in COMMANDS:
        print(f"gradring: unknown command '{cmd}' (try --help)")
        return 2
    mod = importlib.import_module(COMMANDS[cmd][0])
    return int(mod.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
