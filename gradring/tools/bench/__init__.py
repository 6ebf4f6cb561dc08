"""Benchmarks shipped with the package, run as ``gradring bench NAME [options]``.

They measure gradring against torch on the user's machine. Each benchmark
module (those in BENCHMARKS) has ``main(argv, prog)`` and runs as ``python -m
gradring.tools.bench.NAME`` too; ``noise.py``, ``load.py`` and ``ranks.py``
are shared by them. Benchmarks that need a source checkout (another commit,
the test suite's harness) or study gradring's internals live in the
checkout's ``benchmarks/`` only; they build on ``ddp_step.measure``/``report``
and ``ranks.run_ranks``, and nothing here imports from there.
"""

from __future__ import annotations

#: ``gradring bench`` subcommand -> (module under gradring.tools.bench, one-line summary).
BENCHMARKS: dict[str, tuple[str, str]] = {
    "allreduce": ("allreduce", "all-reduce time and bus bandwidth: gradring against gloo"),
    "ddp": ("ddp_step", "DDP step time: gradring against torch's DDP"),
    "hooks": ("hooks", "communication hooks: step time, bytes per step, codec time"),
}
