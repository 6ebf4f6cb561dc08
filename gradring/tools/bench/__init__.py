"""Benchmarks shipped with the package, run as ``gradring bench NAME [options]``.

Each module has ``main(argv, prog)`` and runs as ``python -m
gradring.tools.bench.NAME`` too; ``benchmarks/*.py`` in a source checkout are
thin wrappers around them. Benchmarks that need the source tree (the
multi-host one uses the test suite's network-namespace harness) stay in
``benchmarks/`` only.
"""

from __future__ import annotations

#: ``gradring bench`` subcommand -> (module under gradring.tools.bench, one-line summary).
BENCHMARKS: dict[str, tuple[str, str]] = {
    "allreduce": ("allreduce", "all-reduce time and bus bandwidth: gradring against gloo"),
    "ddp": ("ddp_step", "DDP step time: gradring against torch's DDP"),
    "hooks": ("hooks", "communication hooks: step time, bytes per step, codec time"),
}
