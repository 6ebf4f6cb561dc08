"""Developer benchmarks, run from a source checkout as ``python benchmarks/NAME.py``.

They study gradring's internals or need a git checkout, so they are not part of
the installed package; ``gradring bench`` holds the ones a user runs on their
own machine. Scripts here may import from gradring (``gradring.tools.bench``'s
``ddp_step.measure``/``report`` and ``ranks.run_ranks`` are the interface they
build on), never the other way round. This file makes the folder importable
from the repository root, so that tests can check the scripts' pieces.
"""
