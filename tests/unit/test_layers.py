"""The package's layers: importing the runtime loads no command-line tool.

``import gradring`` must stay free of ``gradring.tools`` (the CLI, the tuner
and its workloads, argparse): the runtime and the tools share only the pure
step model (``gradring/step_model.py``) and ``link_curve.measure_allreduce``.
Each check runs in a fresh interpreter, so nothing an earlier test imported
can hide or fake a dependency.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Records every module whose code runs ``import argparse`` (or ``from argparse ...``)
# while gradring is imported, even when argparse itself is already loaded (torch
# loads it), then reports that and the gradring modules that got loaded.
_PROBE = r"""
import builtins, json, sys
import torch, torch.distributed  # gradring's own dependencies, loaded first
importers = set()
real_import = builtins.__import__

def spy(name, globals=None, locals=None, fromlist=(), level=0):
    if name == "argparse" or name.startswith("argparse."):
        importers.add((globals or {}).get("__name__", "?"))
    return real_import(name, globals, locals, fromlist, level)

builtins.__import__ = spy
try:
    import gradring
    import gradring.comm, gradring.hooks, gradring.nn
    ddp = gradring.DistributedDataParallel  # the public entry point resolves
finally:
    builtins.__import__ = real_import
print(json.dumps({"modules": sorted(m for m in sys.modules if m.startswith("gradring")),
                  "argparse_importers": sorted(importers)}))
"""


def _probe(also: str = "") -> dict:
    """Run the probe in a fresh interpreter; ``also`` is one more module to import."""
    code = _PROBE.replace("    import gradring\n", f"    import gradring\n    import {also}\n") \
        if also else _PROBE
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_gradring_loads_no_tool_module() -> None:
    found = _probe()
    assert "gradring.ddp" in found["modules"] and "gradring.reducer.autocap" in found["modules"]
    assert "gradring.step_model" in found["modules"]
    tools = [m for m in found["modules"] if m == "gradring.tools" or
             m.startswith("gradring.tools.")]
    assert tools == [], f"import gradring loaded tool modules: {tools}"
    via_gradring = [m for m in found["argparse_importers"] if m.startswith("gradring")]
    assert via_gradring == [], f"gradring modules that import argparse: {via_gradring}"


def test_the_probe_sees_a_tool_import() -> None:
    # The same probe, importing a tool on purpose, must report it: the check can fail.
    found = _probe("gradring.tools.tune")
    assert "gradring.tools.tune" in found["modules"]
    assert "gradring.tools.tune" in found["argparse_importers"]
