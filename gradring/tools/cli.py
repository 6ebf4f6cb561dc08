"""The ``gradring`` command: demo, bench and friends."""

from __future__ import annotations

import importlib
import os
import sys

COMMANDS = {
    "demo": ("gradring.tools.demo", "train digits on N local processes and check the result"),
    "bench": (None, "benchmarks: `gradring bench allreduce|ddp|hooks [args]`"),
    "timeline": ("gradring.observe.timeline", "draw a merged Chrome trace as a Gantt chart (PNG)"),
    "tune": ("gradring.tools.tune",
             "pick bucket_cap_mb by measuring, then check it by running DDP"),
    "flight": ("gradring.tools.flight",
               "merge flight-recorder dumps and name the stuck collective"),
    "plan": ("gradring.tools.plan",
             "predict step time and scaling, 2-1024 ranks (alpha-beta model)"),
}


def _bench(argv: list[str]) -> int:
    if not argv or argv[0] not in ("allreduce", "ddp", "hooks"):
        print("usage: gradring bench allreduce|ddp|hooks [options]   (--help for each)")
        return 2
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.join(root, "benchmarks"))
    name = {"ddp": "ddp_step"}.get(argv[0], argv[0])
    try:
        mod = importlib.import_module(name)
    except ImportError:
        print(f"benchmark '{argv[0]}' is not available (benchmarks/ ships with the source tree)")
        return 2
    return int(mod.main(argv[1:]) or 0)


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
