"""``gradring bench ddp`` from a source checkout: the benchmark lives in
gradring/tools/bench/ddp_step.py (its docstring says what it measures)."""

import sys

from gradring.tools.bench.ddp_step import main

if __name__ == "__main__":
    sys.exit(main())
