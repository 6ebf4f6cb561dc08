#!/usr/bin/env python3
"""List what torch's DDP helpers (and Lightning's and Accelerate's DDP code) read and
write on the DDP object, on its reducer and on the ``GradBucket`` a comm hook gets.

    python scripts/torch_reads.py            # print the list (docs/torch-reads.md as it would be)
    python scripts/torch_reads.py --write    # regenerate docs/torch-reads.md
    python scripts/torch_reads.py --check    # exit 1 if docs/torch-reads.md is stale

gradring's DDP stands in for torch's wherever these helpers are handed it, so every
attribute they touch must exist with torch's meaning. The list is made by parsing
the installed sources with ``ast`` (nothing is imported or run), so a new release of
torch, Lightning or Accelerate that touches a new name changes the generated list and
``tests/unit/test_torch_reads.py`` fails until the doc is regenerated and the name
looked at. ``tests/ranks/test_torch_reads_present.py`` checks every listed name on
gradring's objects (and on torch's, to keep the heuristics honest).

[Note: how the walker tells a DDP, a reducer and a bucket apart]
Python has no types to read, so the walker uses these rules, each a pattern that
these files actually use; an expression matching none of them is not looked at:

- **DDP.** A name spelled ``ddp``, ``ddp_model``, ``ddp_inst``, ``ddp_instance``,
  ``ddp_module`` or ``ddp_wrapper``; a name or argument annotated with
  ``DistributedDataParallel`` (or torch's alias ``DDP``); a call of a name ending
  in ``ddp_ref`` or ``ddp_weakref`` with no arguments (a dereferenced weakref); a
  call of the ``DistributedDataParallel`` class; in ``join.py``, a name spelled
  ``joinable`` or annotated ``Joinable`` (DDP is the ``Joinable`` there); any
  expression (``model``, ``self.model``) inside ``if isinstance(x, DDP):`` or
  ``while isinstance(x, DDP):``,
  after ``if not isinstance(x, DDP): return`` or ``assert isinstance(x, DDP)``
  (the class may be a tuple of classes, or a local name bound to one); and the
  few untyped arguments listed in ``HINTS`` below, each named by file, function and
  argument.
- **Reducer.** ``<DDP>.reducer``, and a local name bound to it (also through
  ``typing.cast`` or a tuple assignment); a name annotated ``Reducer``.
- **GradBucket.** A name annotated ``GradBucket`` (``dist.GradBucket``), and an
  argument spelled ``bucket`` (torch's helpers that take the hook's bucket along,
  such as ``_report_compression_stats(bucket, state)``, leave it unannotated).
- A local name rebound to something else stops being any of these.

For each attribute of such an expression the walker records the name and whether
it is read, called or written (``getattr``/``hasattr``/``setattr`` with a constant
name count too), and where: the file (relative to ``site-packages``) and the
enclosing function. Methods inherited from ``nn.Module`` (``parameters``, ``to``,
...) are listed as well; gradring's DDP is an ``nn.Module``.

[Note: the status column]
docs/torch-reads.md is generated whole by this script, except the last column,
which says what gradring does with the name and is carried over by
``--write`` from the checked-in doc, keyed by object and name:

- ``ok`` (optionally followed by a note): gradring's object has it, with torch's
  meaning. A name new to the list starts as ``ok``, so the test that checks the
  names on gradring's objects fails until it is implemented or marked.
- ``n/a: <reason>``: deliberately absent, with the reason.
- ``pending: <reason>``: to be added; its presence test is an expected failure.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.metadata
import re
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "torch-reads.md"

#: What is scanned: (package, glob relative to the package's folder).
SOURCES: tuple[tuple[str, str], ...] = (
    ("torch", "distributed/algorithms/ddp_comm_hooks/*.py"),
    ("torch", "distributed/optim/zero_redundancy_optimizer.py"),
    ("torch", "distributed/algorithms/model_averaging/*.py"),
    ("torch", "distributed/algorithms/_optimizer_overlap/*.py"),
    ("torch", "distributed/algorithms/join.py"),
    ("torch", "distributed/checkpoint/state_dict.py"),
    ("lightning", "fabric/**/*.py"),
    ("lightning", "pytorch/**/*.py"),
    ("accelerate", "**/*.py"),
)

#: The packages whose versions the list was made from.
PACKAGES = ("torch", "lightning", "accelerate")

#: Untyped arguments that are a DDP: file (relative to site-packages) ->
#: function qualname -> argument names. Each is checked by the walker (a hint
#: whose function is gone is an error, so it does not go stale silently).
HINTS: dict[str, dict[str, tuple[str, ...]]] = {
    # Accelerator.prepare_model calls it with the DDP it just built.
    "accelerate/utils/dataclasses.py": {
        "DistributedDataParallelKwargs.register_comm_hook": ("model",)},
}

DDP, REDUCER, BUCKET = "DDP", "reducer", "GradBucket"
OBJECTS = (DDP, REDUCER, BUCKET)

_DDP_NAMES = re.compile(r"^ddp(_(model|inst|instance|module|wrapper))?$")
_DDP_REF = re.compile(r"(^|_)ddp_(weak)?ref$")
_DDP_CLASSES = {"DistributedDataParallel", "DDP"}


@dataclasses.dataclass(frozen=True, order=True)
class Access:
    """One attribute access: ``obj.name`` read, called or written at ``where``."""

    obj: str
    name: str
    how: str  # "read", "call" or "write"
    where: str  # "<file relative to site-packages>:<function qualname>"


# ------------------------------------------------------------------ the walker
def _names_class(node: ast.AST | None, classes: set[str]) -> bool:
    """Whether an annotation or isinstance class expression names one of ``classes``."""
    if node is None:
        return False
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return any(re.search(rf"\b{c}\b", node.value) for c in classes)
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and sub.id in classes:
            return True
        if isinstance(sub, ast.Attribute) and sub.attr in classes:
            return True
    return False


def _annotation_kind(node: ast.AST | None, *, joinables: bool) -> str | None:
    if _names_class(node, _DDP_CLASSES) or (joinables and _names_class(node, {"Joinable"})):
        return DDP
    if _names_class(node, {"GradBucket"}):
        return BUCKET
    if _names_class(node, {"Reducer"}):
        return REDUCER
    return None


def _key(node: ast.AST) -> str | None:
    """A stable key for a name or a dotted attribute chain (``self.model``)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _key(node.value)
        return None if inner is None else f"{inner}.{node.attr}"
    return None


class _Walker:
    def __init__(self, rel: str, tree: ast.Module) -> None:
        self.rel = rel
        self.tree = tree
        self.joinables = rel.endswith("distributed/algorithms/join.py")
        self.hints = HINTS.get(rel, {})
        self.hints_used: set[str] = set()
        self.found: list[Access] = []

    # -- kinds of expressions
    def kind(self, node: ast.AST, env: dict[str, str]) -> str | None:
        key = _key(node)
        if key is not None and key in env:
            return env[key] or None
        if isinstance(node, ast.Name):
            if _DDP_NAMES.match(node.id) or (self.joinables and node.id == "joinable"):
                return DDP
            return None
        if isinstance(node, ast.Attribute):
            if node.attr == "reducer" and self.kind(node.value, env) == DDP:
                return REDUCER
            return None
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and _DDP_REF.search(func.id) and not node.args:
                return DDP
            if _names_class(func, _DDP_CLASSES) and isinstance(func, (ast.Name, ast.Attribute)) \
                    and (_key(func) or "").split(".")[-1] in _DDP_CLASSES:
                return DDP
            if (isinstance(func, ast.Name) and func.id == "cast"
                    or isinstance(func, ast.Attribute) and func.attr == "cast") \
                    and len(node.args) == 2:
                return self.kind(node.args[1], env)
        return None

    def _is_ddp_class(self, node: ast.AST, env: dict[str, str]) -> bool:
        key = _key(node)
        if key is not None and env.get(f"<classes>{key}"):
            return True
        if isinstance(node, ast.Tuple):
            return any(self._is_ddp_class(e, env) for e in node.elts)
        return isinstance(node, (ast.Name, ast.Attribute)) \
            and (_key(node) or "").split(".")[-1] in _DDP_CLASSES

    def _isinstance_ddp(self, test: ast.AST, env: dict[str, str]) -> list[str]:
        """Keys that ``test`` (an isinstance check, maybe inside ``and``) proves a DDP."""
        if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
            return [k for v in test.values for k in self._isinstance_ddp(v, env)]
        if isinstance(test, ast.Call) and isinstance(test.func, ast.Name) \
                and test.func.id == "isinstance" and len(test.args) == 2 \
                and self._is_ddp_class(test.args[1], env):
            key = _key(test.args[0])
            return [key] if key is not None else []
        return []

    # -- recording
    def record(self, node: ast.AST, env: dict[str, str], qual: str) -> None:
        """Record the accesses inside the expression or simple statement ``node``."""
        where = f"{self.rel}:{qual}"
        called = {id(sub.func) for sub in ast.walk(node) if isinstance(sub, ast.Call)}
        for sub in ast.walk(node):
            if isinstance(sub, ast.Attribute) and id(sub) not in called:
                obj = self.kind(sub.value, env)
                if obj is None:
                    continue
                if isinstance(sub.ctx, (ast.Store, ast.Del)):
                    how = "write"
                else:
                    how = "read"
                self.found.append(Access(obj, sub.attr, how, where))
            elif isinstance(sub, ast.Call):
                obj = (self.kind(sub.func.value, env)
                       if isinstance(sub.func, ast.Attribute) else None)
                if obj is not None:
                    self.found.append(Access(obj, sub.func.attr, "call", where))
                elif isinstance(sub.func, ast.Name) and sub.func.id in (
                        "getattr", "hasattr", "setattr") and len(sub.args) >= 2 \
                        and isinstance(sub.args[1], ast.Constant) \
                        and isinstance(sub.args[1].value, str):
                    obj = self.kind(sub.args[0], env)
                    if obj is not None:
                        how = "write" if sub.func.id == "setattr" else "read"
                        self.found.append(Access(obj, sub.args[1].value, how, where))

    # -- statements
    def bind(self, target: ast.AST, value: ast.AST | None, env: dict[str, str]) -> None:
        """Assignment ``target = value``: the target takes the value's kind, or loses its own."""
        if isinstance(target, (ast.Tuple, ast.List)):
            if isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(target.elts):
                for t, v in zip(target.elts, value.elts):
                    self.bind(t, v, env)
            else:
                for t in target.elts:
                    self.bind(t, None, env)
            return
        key = _key(target)
        if key is None:
            return
        kind = self.kind(value, env) if value is not None else None
        env[key] = kind or ""
        if value is not None and isinstance(value, ast.Tuple) \
                and any(self._is_ddp_class(e, env) for e in value.elts):
            env[f"<classes>{key}"] = "yes"

    def function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda,
                 env: dict[str, str], qual: str) -> None:
        env = dict(env)
        args = node.args
        every = [*args.posonlyargs, *args.args, *args.kwonlyargs]
        every += [a for a in (args.vararg, args.kwarg) if a is not None]
        hinted = self.hints.get(qual, ())
        if hinted:
            self.hints_used.add(qual)
        for a in every:
            kind = _annotation_kind(a.annotation, joinables=self.joinables)
            if a.arg in hinted:
                kind = DDP
            if kind is None and (_DDP_NAMES.match(a.arg)
                                 or (self.joinables and a.arg == "joinable")):
                kind = DDP
            if kind is None and a.arg == "bucket":
                kind = BUCKET
            env[a.arg] = kind or ""
        for default in [*args.defaults, *(d for d in args.kw_defaults if d is not None)]:
            self.record(default, env, qual)
        if isinstance(node, ast.Lambda):
            self.record(node.body, env, qual)
        else:
            self.block(node.body, env, qual)

    def block(self, body: Iterable[ast.stmt], env: dict[str, str], qual: str) -> None:
        """Walk statements in order; ``env`` is extended in place by what they prove."""
        for stmt in body:
            self.statement(stmt, env, qual)

    def statement(self, stmt: ast.stmt, env: dict[str, str], qual: str) -> None:
        where = qual
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for dec in stmt.decorator_list:
                self.record(dec, env, where)
            name = stmt.name if qual == "<module>" else f"{qual}.{stmt.name}"
            self.function(stmt, env, name)
            return
        if isinstance(stmt, ast.ClassDef):
            name = stmt.name if qual == "<module>" else f"{qual}.{stmt.name}"
            self.block(stmt.body, dict(env), name)
            return
        if isinstance(stmt, ast.If):
            self.record(stmt.test, env, where)
            proven = self._isinstance_ddp(stmt.test, env)
            inner = dict(env)
            for key in proven:
                inner[key] = DDP
            self.block(stmt.body, inner, qual)
            self.block(stmt.orelse, dict(env), qual)
            # `if not isinstance(x, DDP): return` proves x a DDP after the if.
            test = stmt.test
            if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) \
                    and stmt.body and isinstance(stmt.body[-1], (ast.Return, ast.Raise,
                                                                 ast.Continue, ast.Break)):
                for key in self._isinstance_ddp(test.operand, env):
                    env[key] = DDP
            return
        if isinstance(stmt, ast.Assert):
            self.record(stmt, env, where)
            for key in self._isinstance_ddp(stmt.test, env):
                env[key] = DDP
            return
        if isinstance(stmt, ast.Assign):
            self.record(stmt, env, where)
            for target in stmt.targets:
                self.bind(target, stmt.value, env)
            return
        if isinstance(stmt, ast.AnnAssign):
            self.record(stmt, env, where)
            kind = _annotation_kind(stmt.annotation, joinables=self.joinables)
            key = _key(stmt.target)
            if kind is not None and key is not None:
                env[key] = kind
            elif stmt.value is not None:
                self.bind(stmt.target, stmt.value, env)
            return
        if isinstance(stmt, (ast.For, ast.AsyncFor)):
            self.record(stmt.iter, env, where)
            self.bind(stmt.target, None, env)
            self.block(stmt.body, dict(env), qual)
            self.block(stmt.orelse, dict(env), qual)
            return
        if isinstance(stmt, ast.While):
            self.record(stmt.test, env, where)
            inner = dict(env)
            for key in self._isinstance_ddp(stmt.test, env):
                inner[key] = DDP
            self.block(stmt.body, inner, qual)
            self.block(stmt.orelse, dict(env), qual)
            return
        if isinstance(stmt, (ast.With, ast.AsyncWith)):
            for item in stmt.items:
                self.record(item.context_expr, env, where)
                if item.optional_vars is not None:
                    self.bind(item.optional_vars, None, env)
            self.block(stmt.body, env, qual)
            return
        if isinstance(stmt, ast.Try) or type(stmt).__name__ == "TryStar":
            self.block(stmt.body, env, qual)  # type: ignore[attr-defined]
            for handler in stmt.handlers:  # type: ignore[attr-defined]
                self.block(handler.body, dict(env), qual)
            self.block(stmt.orelse, env, qual)  # type: ignore[attr-defined]
            self.block(stmt.finalbody, env, qual)  # type: ignore[attr-defined]
            return
        if isinstance(stmt, ast.Match):
            self.record(stmt.subject, env, where)
            for case in stmt.cases:
                self.block(case.body, dict(env), qual)
            return
        # Expressions, returns, augmented assignments, deletes...: lambdas inside
        # them get their own scope, the rest is recorded here.
        self.record(stmt, env, where)
        for sub in ast.walk(stmt):
            if isinstance(sub, ast.Lambda):
                self.function(sub, env, f"{qual}.<lambda>")

    def run(self) -> list[Access]:
        self.block(self.tree.body, {}, "<module>")
        stale = set(self.hints) - self.hints_used
        if stale:
            raise RuntimeError(f"HINTS in scripts/torch_reads.py name functions that are "
                               f"gone from {self.rel}: {sorted(stale)}")
        return self.found


# ------------------------------------------------------------------ the list
def _site_packages() -> Path:
    import torch

    return Path(torch.__file__).resolve().parents[1]


def source_files() -> Iterator[tuple[str, Path]]:
    """(path relative to site-packages, path) of every scanned file, sorted."""
    site = _site_packages()
    seen: set[Path] = set()
    for package, pattern in SOURCES:
        for path in sorted((site / package).glob(pattern)):
            if path in seen or "__pycache__" in path.parts:
                continue
            seen.add(path)
            yield path.relative_to(site).as_posix(), path


def scan_file(rel: str, source: str) -> list[Access]:
    """Every access ``source`` (the file at ``rel``) makes on a DDP, reducer or bucket."""
    return _Walker(rel, ast.parse(source, filename=rel)).run()


def scan() -> list[Access]:
    """Every access in the scanned files, deduplicated and sorted."""
    found: set[Access] = set()
    for rel, path in source_files():
        found.update(scan_file(rel, path.read_text(encoding="utf-8")))
    return sorted(found)


def versions() -> dict[str, str]:
    return {p: importlib.metadata.version(p) for p in PACKAGES}


@dataclasses.dataclass
class Row:
    obj: str
    name: str
    how: list[str]
    where: list[str]
    status: str = "ok"


def rows(accesses: Iterable[Access]) -> list[Row]:
    """One row per (object, name), its accesses merged."""
    by: dict[tuple[str, str], Row] = {}
    for a in accesses:
        row = by.setdefault((a.obj, a.name), Row(a.obj, a.name, [], []))
        if a.how not in row.how:
            row.how.append(a.how)
        if a.where and a.where not in row.where:
            row.where.append(a.where)
    order = {o: i for i, o in enumerate(OBJECTS)}
    out = sorted(by.values(), key=lambda r: (order[r.obj], r.name))
    for r in out:
        r.how.sort(key=("read", "call", "write").index)
        r.where.sort()
    return out


_ROW = re.compile(r"^\| (?P<obj>\w+) \| `(?P<name>[^`]+)` \| [^|]* \| .* \| (?P<status>[^|]+) \|$")


def parse_statuses(text: str) -> dict[tuple[str, str], str]:
    """(object, name) -> the status column of a docs/torch-reads.md text."""
    out = {}
    for line in text.splitlines():
        m = _ROW.match(line)
        if m and m["obj"] in OBJECTS:
            out[(m["obj"], m["name"])] = m["status"].strip()
    return out


HEADER = """\
# What torch's DDP helpers read on DDP, its reducer and GradBucket

<!-- Generated by scripts/torch_reads.py: run `.venv/bin/python scripts/torch_reads.py
--write` after changing torch, Lightning or Accelerate. Only the last column
(gradring) is written by hand; --write keeps it. -->

torch's own helpers for DDP reach into the DDP object they are given: ZeRO's
overlap hooks read `ddp._has_rebuilt_buckets`, the mixed-precision and
optimizer-in-backward hooks call `ddp.reducer._run_allreduce_hook(bucket)`,
Lightning calls `model.reducer._rebuild_buckets()`, Accelerate calls
`model.reducer.prepare_for_backward([])`. gradring's DDP is handed to the same
helpers, so each name they touch must exist on it with torch's meaning. This page
is the list, made by parsing the sources below with `ast` (the rules are
[Note: how the walker tells a DDP, a reducer and a bucket apart] in
`scripts/torch_reads.py`). `tests/unit/test_torch_reads.py` fails when the
installed sources give another list (a new release touching a new name), and
`tests/ranks/test_torch_reads_present.py` checks every `ok` row on gradring's DDP,
reducer and `GradBucket`, and on torch's.

Access: `read` (an attribute read), `call` (a method called), `write` (assigned or
set with `setattr`). Where: the file under `site-packages` and the function.
gradring: `ok` (present with torch's meaning), `n/a: why`, `pending: why` (its
presence test is an expected failure until it lands).
"""


def render(accesses: Iterable[Access], statuses: dict[tuple[str, str], str],
           vers: dict[str, str]) -> str:
    """The text of docs/torch-reads.md."""
    lines = [HEADER]
    lines.append("Scanned: " + ", ".join(f"{p} {v}" for p, v in vers.items()) + ".")
    lines.append("")
    for package, pattern in SOURCES:
        lines.append(f"- `{package}/{pattern}`")
    lines.append("")
    lines.append("| Object | Name | Access | Where | gradring |")
    lines.append("|---|---|---|---|---|")
    for row in rows(accesses):
        status = statuses.get((row.obj, row.name), "ok")
        where = "<br>".join(row.where)
        lines.append(f"| {row.obj} | `{row.name}` | {', '.join(row.how)} | {where} | "
                     f"{status} |")
    return "\n".join(lines) + "\n"


def generate(doc_text: str | None = None) -> str:
    """docs/torch-reads.md from the installed sources, keeping the statuses of
    ``doc_text`` (default: the checked-in doc)."""
    if doc_text is None:
        doc_text = DOC.read_text(encoding="utf-8") if DOC.exists() else ""
    return render(scan(), parse_statuses(doc_text), versions())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="regenerate docs/torch-reads.md")
    mode.add_argument("--check", action="store_true", help="exit 1 if the doc is stale")
    args = parser.parse_args(argv)
    text = generate()
    if args.write:
        DOC.write_text(text, encoding="utf-8")
        print(f"wrote {DOC.relative_to(ROOT)}")
        return 0
    if args.check:
        current = DOC.read_text(encoding="utf-8") if DOC.exists() else ""
        if current != text:
            print(f"{DOC.relative_to(ROOT)} is stale: run "
                  f"`.venv/bin/python scripts/torch_reads.py --write`", file=sys.stderr)
            return 1
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
