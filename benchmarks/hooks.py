"""``gradring bench hooks`` from a source checkout: the benchmark lives in
gradring/tools/bench/hooks.py (its docstring says what it measures)."""

import sys

from gradring.tools.bench.hooks import main

if __name__ == "__main__":
    sys.exit(main())
