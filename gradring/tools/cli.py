"""The ``gradring`` command: demo, explain, timeline, tune, plan, flight and bench."""

from __future__ import annotations

import importlib
import sys

#: command -> (module with ``main(argv)`` and ``parser()``, one line for ``gradring --help``).
COMMANDS = {
    "demo": ("gradring.tools.demo", "train digits on N local processes and check the result"),
    "bench": ("gradring.tools.bench", "benchmarks: `gradring bench allreduce|ddp|hooks [args]`"),
    "timeline": ("gradring.tools.timeline", "draw a run's steps as a picture (PNG)"),
    "tune": ("gradring.tools.tune",
             "pick bucket_cap_mb by measuring, then check it by running DDP"),
    "flight": ("gradring.tools.flight",
               "find the collective a hung or failed job got stuck on"),
    "explain": ("gradring.tools.explain",
                "why is my DDP step slow? step breakdown and measured findings from a trace"),
    "plan": ("gradring.tools.plan",
             "predict step time and scaling, 2-1024 ranks, from link bandwidth and latency"),
}

USAGE = """usage: gradring COMMAND [options]

gradring's tools: see a run work, say why a step is slow, pick a bucket size,
predict scaling, and find where a hung job got stuck. `gradring COMMAND --help`
describes each command, its options and their defaults.

commands:
{commands}

examples:
  gradring demo --small
      train a small model on 2 processes and explain its steps
  gradring explain run/trace.json
      why is the step of a recorded run slow?
  gradring tune mlp
      pick bucket_cap_mb for a built-in model on this machine"""


def _bench(argv: list[str]) -> int:
    from gradring.tools.bench import BENCHMARKS

    if not argv or argv[0] not in BENCHMARKS:
        lines = [] if not argv or argv[0] in ("-h", "--help") else \
            [f"gradring bench: unknown benchmark '{argv[0]}'"]
        lines += [f"usage: gradring bench {'|'.join(BENCHMARKS)} [options]", "",
                  "Measure gradring against torch on this machine. `gradring bench NAME "
                  "--help`", "describes each benchmark, its options and their defaults.", "",
                  "benchmarks:"]
        lines += [f"  {name:<10}{text}" for name, (_, text) in BENCHMARKS.items()]
        lines += ["", "examples:", "  gradring bench allreduce",
                  "      all-reduce time and bandwidth at several sizes",
                  "  gradring bench ddp --help", "      the DDP step benchmark's options",
                  "", "A source checkout's benchmarks/ folder holds a few more "
                  "(python benchmarks/NAME.py)."]
        print("\n".join(lines))
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    mod = importlib.import_module(f"gradring.tools.bench.{BENCHMARKS[argv[0]][0]}")
    return int(mod.main(argv[1:], prog=f"gradring bench {argv[0]}") or 0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE.format(commands="\n".join(f"  {name:<10}{text}"
                                               for name, (_, text) in COMMANDS.items())))
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
