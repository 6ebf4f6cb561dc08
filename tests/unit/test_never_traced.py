"""The never-traced set covers every module of the package, save the ones listed as traceable.

See [Note: never traced] in gradring/compile/never_traced.py: the gradient
hooks' code (gradring.reducer, gradring.buckets: slot_io and packing run
inside the hooks) must stay eager under compiled autograd.
"""

from __future__ import annotations

import os

import pytest

import gradring
from gradring.compile.never_traced import MAY_BE_TRACED, NEVER_TRACED

ROOT = os.path.dirname(os.path.abspath(gradring.__file__))


def _modules() -> list[str]:
    """Every module of the gradring package, by dotted name, from its files."""
    names = []
    for here, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(here, f), os.path.dirname(ROOT))
                name = rel[:-3].replace(os.sep, ".")
                names.append(name.removesuffix(".__init__"))
    return sorted(names)


def _never_traced(module: str) -> bool:
    return any(module == n or module.startswith(n + ".") for n in NEVER_TRACED)


def test_every_module_is_never_traced_or_listed_as_traceable() -> None:
    uncovered = []
    for m in _modules():
        if m == "gradring":
            continue  # the package's own __init__: names only
        top = m.split(".")[1]
        if not _never_traced(m) and top not in MAY_BE_TRACED:
            uncovered.append(m)
    assert uncovered == []


def test_the_hook_path_is_never_traced() -> None:
    for m in ("gradring.reducer.reducer", "gradring.reducer.static_graph",
              "gradring.buckets.bucket", "gradring.buckets.slot_io", "gradring.buckets.packing",
              "gradring.reducer.bucket_set", "gradring.reducer.launcher",
              "gradring.buckets.grad_bucket", "gradring.comm.external",
              "gradring.observe.trace", "gradring.graph"):
        assert m in _modules() and _never_traced(m), m


def test_traceable_entries_name_real_modules_with_a_reason() -> None:
    tops = {m.split(".")[1] for m in _modules() if m != "gradring"}
    for name, why in MAY_BE_TRACED.items():
        assert name in tops and why, name
        assert f"gradring.{name}" not in NEVER_TRACED


def test_dynamo_skips_the_hook_modules_once_installed() -> None:
    trace_rules = pytest.importorskip("torch._dynamo.trace_rules")
    from gradring import compile as compile_split
    from gradring import step_model
    from gradring.buckets import packing, slot_io

    compile_split.install()
    for mod in (slot_io, packing):
        assert trace_rules.check_file(mod.__file__).skipped, mod.__name__
    # The check can fail: a module listed as traceable is not skipped.
    assert not trace_rules.check_file(step_model.__file__).skipped
