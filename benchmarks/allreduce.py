"""``gradring bench allreduce`` from a source checkout: the benchmark lives in
gradring/tools/bench/allreduce.py (its docstring says what it measures)."""

import sys

from gradring.tools.bench.allreduce import main

if __name__ == "__main__":
    sys.exit(main())
