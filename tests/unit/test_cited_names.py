"""Every name the docs and comments cite still exists.

Scanned: README.md, docs/*.md (outside their code blocks, which
tests/jobs/test_docs.py runs) and the comments and docstrings of
gradring/**/*.py. Cited, in backquotes:

- files (``gradring/x/y.py``, ``tests/...::test_name``, ``split.py``, or a
  path under ``torch/``): they exist, in the repository (at that path, under
  the citing file's folders, or as the one file of that name) or in the
  installed torch; a cited test function is defined in its file;
- settings (``GRADRING_*``): ``gradring/config.py`` knows them;
- python names (``gradring.x.Y``, ``module.Class.method``, ``Class.attr``,
  ``ClassName``): gradring defines them. Names are resolved on the sources'
  syntax trees, not by import: importing every module (Lightning, Ray and
  Dynamo included) takes seconds, this takes a fraction of one. A first part
  that is one of gradring's modules is looked up there, then as a variable
  named after a gradring class (``bucket.buffer()``: ``Bucket``,
  ``GradBucket``). A first part that is neither (a variable such as
  ``optimizer.step()``, torch, the standard library, a framework; the few
  that share a gradring module's name are in ``FOREIGN_HEADS``) is not
  checked, but a CamelCase one is: against gradring's classes and module
  level names, the builtins and the short allow-list below;
- notes (``[Note: ...]``, with or without backquotes): some .py or .md file
  of the repository defines the note (a line that is just the note's title).
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib.util
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "gradring"

#: Cited names that resolve nowhere here on purpose: whose they are, and why.
ALLOWED = {
    # torch's, not gradring's (classes, autograd nodes, its test suite, Dynamo)
    "AccumulateGrad": "torch's autograd node that accumulates a parameter's gradient",
    "DDPOptimizer": "torch._dynamo.backends.distributed.DDPOptimizer",
    "DistBackendError": "torch.distributed.DistBackendError",
    "GradBucket": "torch.distributed.GradBucket",
    "GradBucket.gradients()": "torch.distributed.GradBucket.gradients",
    "GradScaler": "torch.amp.GradScaler",
    "Join": "torch.distributed.algorithms.join.Join",
    "Logger": "torch.distributed.Logger",
    "MultiProcessTestCase": "torch.testing._internal.common_distributed",
    "DistributedTest._DistTestBase": "torch's distributed_test.py",
    "PackedSequence": "torch.nn.utils.rnn.PackedSequence",
    "ReduceOp": "torch.distributed.ReduceOp",
    "TorchFunctionMode": "torch.overrides.TorchFunctionMode",
    "Work": "torch.distributed.Work",
    "Future.then": "torch.futures.Future.then",
    "Optimizer.zero_grad": "torch.optim.Optimizer.zero_grad",
    "Tensor.copy_": "torch.Tensor.copy_",
    "Tensor.register_hook": "torch.Tensor.register_hook",
    "DDP.forward": "torch's DistributedDataParallel.forward, under its usual alias",
    "BatchNorm2d": "torch.nn.BatchNorm2d",
    "test/distributed/test_distributed_spawn.py": "torch's source tree, not in its wheel",
    # event names in torch.profiler traces (docs/explain.md, tools/read_profiler.py) and
    # the kernel kinds HTA sorts them into (tools/gpu_trace.py)
    "ProfilerStep": "torch.profiler's step span, ProfilerStep#N",
    "Memcpy": "a CUDA memory-copy kernel's name in a profiler trace (HTA's memory kind)",
    "Memset": "a CUDA memset kernel's name in a profiler trace (HTA's memory kind)",
    "Sync": "a CUDA synchronisation event's name in a profiler trace",
    # the frameworks' (docs/integrations.md)
    "Trainer": "Lightning's and transformers' Trainer",
    "TorchTrainer": "ray.train.torch.TorchTrainer",
    "LightningModule.load_from_checkpoint": "Lightning's",
    "DistributedDataParallelKwargs": "Accelerate's",
    "GPT2Config": "transformers'",
    "PreTrainedModel": "transformers'",
    "BatchNormAct2d": "timm's",
    "SplitBatchNorm2d": "timm's",
    "NativeDDP": "the name timm's train.py gives torch's DDP",
    # the user's and the system's
    "train.py": "the user's training script (README's Quickstart)",
    "SYS_futex": "the Linux system call number",
    "ArgumentDefaultsHelpFormatter": "argparse's",
    "GRADRING_MH_SUBNET": "the multi-host test harness's own (tests/multihost/netns_harness.py)",
}

#: first parts that name something else than gradring's module of that name
FOREIGN_HEADS = {
    "nn": "torch.nn",
    "lightning": "the lightning package (gradring.lightning adapts it)",
    "ray": "the ray package (gradring.ray adapts it)",
    "store": "a torch.distributed.Store the text is about (TCPStore, FileStore)",
}

_BACKQUOTED = re.compile(r"``([^`\n]+?)``|(?<!`)`([^`\n]+?)`(?!`)")
_NOTE = re.compile(r"\[Note:\s+([^\]]+?)\]")
_SETTING = re.compile(r"\bGRADRING_[A-Z0-9_]*[A-Z0-9]\b")
_FILE = re.compile(r"\.?[\w./-]+\.(?:py|md|toml|sh)(?::\d+)?(?:::[\w\[\]-]+)?")
_TOP_DIRS = ("gradring/", "tests/", "docs/", "scripts/", "benchmarks/", "examples/", ".ci/")
_DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+(?:\(\))?")
_CAMEL = re.compile(r"[A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*")
#: dotted names that are files a tool writes or reads (``timeline.png``), not python
_DATA_SUFFIX = (".png", ".pt", ".json", ".txt", ".html", ".csv", ".log")


# ------------------------------------------------------------------ what is cited


@dataclass(frozen=True)
class Citation:
    where: str  # "path:line"
    source: Path
    text: str  # inside the backquotes, or the note's title


def _markdown_texts() -> Iterator[tuple[Path, int, str]]:
    """README.md and docs/*.md, their fenced code blocks blanked (line numbers kept)."""
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        lines, fenced = [], False
        for line in path.read_text().splitlines():
            if line.lstrip().startswith("```"):
                fenced = not fenced
                lines.append("")
                continue
            lines.append("" if fenced else line)
        yield path, 1, "\n".join(lines)


@functools.cache
def _parsed(path: Path) -> tuple[str, ast.Module]:
    source = path.read_text()
    return source, ast.parse(source)


_COMMENT = re.compile(r"""^(?:[^#'"]|'[^'\n]*'|"[^"\n]*")*(#.*)$""")


_COMPOUND = (ast.If, ast.Try, ast.With, ast.For, ast.While)


def _docstrings(body: list[ast.stmt]) -> Iterator[tuple[int, str]]:
    """The docstrings of the classes and functions in ``body``, nested ones too."""
    for node in body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                yield node.body[0].lineno, doc
            yield from _docstrings(node.body)
        elif isinstance(node, _COMPOUND):  # a def inside an if, a try, a with
            for block in ("body", "orelse", "finalbody"):
                yield from _docstrings(getattr(node, block, []))
            for handler in getattr(node, "handlers", []):
                yield from _docstrings(handler.body)


def _python_texts() -> Iterator[tuple[Path, int, str]]:
    """The comments and docstrings of gradring's modules. A comment is what
    follows a ``#`` outside a one-line string literal (a ``#`` inside a
    multi-line string makes a false comment, harmless here)."""
    for path in sorted(PACKAGE.rglob("*.py")):
        source, tree = _parsed(path)
        for number, line in enumerate(source.splitlines(), 1):
            if "#" in line and (m := _COMMENT.match(line)):
                yield path, number, m.group(1)
        doc = ast.get_docstring(tree, clean=False)
        if doc is not None:
            yield path, tree.body[0].lineno, doc
        yield from ((path, line, text) for line, text in _docstrings(tree.body))


def citations() -> tuple[list[Citation], list[Citation]]:
    """(backquoted texts, note titles) cited in the scanned texts."""
    quoted, notes = [], []
    for path, first, text in [*_markdown_texts(), *_python_texts()]:
        rel = path.relative_to(ROOT)
        for m in _BACKQUOTED.finditer(text):
            line = first + text.count("\n", 0, m.start())
            quoted.append(Citation(f"{rel}:{line}", path, (m.group(1) or m.group(2)).strip()))
        for m in _NOTE.finditer(text):
            line = first + text.count("\n", 0, m.start())
            title = " ".join(m.group(1).replace("#", " ").split())
            if title != "...":
                notes.append(Citation(f"{rel}:{line}", path, title))
    return quoted, notes


# ------------------------------------------------------------------ what exists


@dataclass
class _Class:
    members: set[str] = field(default_factory=set)
    nested: dict[str, _Class] = field(default_factory=dict)
    bases: list[str] = field(default_factory=list)  # the last part of each base's name


@dataclass
class _Module:
    names: set[str] = field(default_factory=set)
    classes: dict[str, _Class] = field(default_factory=dict)
    #: name -> (gradring module, name there) for ``from gradring.x import name``
    imported: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: names imported from outside gradring (torch's, the standard library's)
    foreign: set[str] = field(default_factory=set)


_SELF_ATTR = re.compile(r"\bself\.(\w+)\s*(?::[^=\n]+)?[-+*/|&]?=(?!=)")


def _class_of(node: ast.ClassDef, lines: list[str]) -> _Class:
    cls = _Class(bases=[ast.unparse(b).split(".")[-1] for b in node.bases])
    for item in node.body:
        if isinstance(item, ast.ClassDef):
            cls.nested[item.name] = _class_of(item, lines)
            cls.members.add(item.name)
        elif isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            cls.members.add(item.name)
        elif isinstance(item, ast.Assign):
            cls.members.update(t.id for t in item.targets if isinstance(t, ast.Name))
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            cls.members.add(item.target.id)
    # self.x = ... in its methods, read off the source lines
    cls.members.update(_SELF_ATTR.findall("\n".join(lines[node.lineno - 1:node.end_lineno])))
    return cls


def _module_of(tree: ast.Module, name: str, is_package: bool, lines: list[str]) -> _Module:
    mod = _Module()
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            mod.classes[node.name] = _class_of(node, lines)
            mod.names.add(node.name)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            mod.names.add(node.name)
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                mod.names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            mod.names.add(node.target.id)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package this module is in
                parts = name.split(".")[:len(name.split(".")) - node.level + is_package]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                mod.names.add(alias.asname or alias.name)
                if base.split(".")[0] == "gradring":
                    mod.imported[alias.asname or alias.name] = (base, alias.name)
                else:
                    mod.foreign.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                mod.names.add(alias.asname or alias.name.split(".")[0])
                mod.foreign.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, (ast.If, ast.Try)):  # TYPE_CHECKING and fallbacks
            inner = _module_of(ast.Module(body=list(ast.iter_child_nodes(node)),
                                          type_ignores=[]), name, is_package, lines)
            mod.names |= inner.names
            mod.classes.update(inner.classes)
            mod.imported.update(inner.imported)
            mod.foreign |= inner.foreign
    return mod


#: bases from the standard library, and the members they give a subclass
_CLOSED_BASES = {
    "NamedTuple": {"_replace", "_asdict", "_fields", "count", "index"},
    "Enum": {"name", "value"}, "IntEnum": {"name", "value"}, "Flag": {"name", "value"},
    "Protocol": set(), "Generic": set(), "ABC": set(),
}


class Index:
    """gradring's modules, their names and classes, read from the sources."""

    def __init__(self) -> None:
        self.modules: dict[str, _Module] = {}
        for path in sorted(PACKAGE.rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            package = parts[-1] == "__init__"
            if package:
                parts.pop()
            name = ".".join(parts)
            source, tree = _parsed(path)
            self.modules[name] = _module_of(tree, name, package, source.splitlines())
        self.classes: dict[str, list[_Class]] = {}
        for mod in self.modules.values():
            for cname, cls in mod.classes.items():
                self.classes.setdefault(cname, []).append(cls)
                for nname, nested in cls.nested.items():
                    self.classes.setdefault(nname, []).append(nested)
        self.names = {n for mod in self.modules.values() for n in mod.names}
        self.by_short: dict[str, list[str]] = {}
        for name in self.modules:
            parts = name.split(".")
            for k in range(1, len(parts)):
                self.by_short.setdefault(".".join(parts[k:]), []).append(name)

    def in_module(self, module: str, parts: list[str], depth: int = 0) -> bool:
        if not parts:
            return True
        head, rest = parts[0], parts[1:]
        if f"{module}.{head}" in self.modules:
            return self.in_module(f"{module}.{head}", rest, depth)
        mod = self.modules[module]
        if head in mod.classes:
            return self.in_class(mod.classes[head], rest)
        if head in mod.imported and depth < 8:
            source, name = mod.imported[head]
            if source in self.modules:
                return self.in_module(source, [name, *rest], depth + 1)
        return head in mod.names  # a function, a constant, or something torch's

    def in_class(self, cls: _Class, parts: list[str], depth: int = 0) -> bool:
        if not parts:
            return True
        head, rest = parts[0], parts[1:]
        if head in cls.nested:
            return self.in_class(cls.nested[head], rest, depth)
        if head in cls.members:
            return True
        for base in cls.bases:
            if base in self.classes and depth < 8:
                if any(self.in_class(b, parts, depth + 1) for b in self.classes[base]):
                    return True
            elif hasattr(builtins, base):  # object, Exception, ValueError, dict, ...
                if hasattr(getattr(builtins, base), head):
                    return True
            elif base in _CLOSED_BASES:
                if head in _CLOSED_BASES[base]:
                    return True
            else:
                return True  # a subclass of torch's (nn.Module, its DDP): not checked here
        return False


_INDEX = Index()
#: variables the docs name by their usual name, and the class of what they hold
_VARIABLES = {"ddp": "DistributedDataParallel", "state": "PowerSGDState"}


def _classes_for(head: str) -> tuple[str, list[_Class]]:
    """The gradring classes ``head`` names: itself, the class of a usual variable
    name, or the classes a variable is named after (``bucket``: ``Bucket``,
    ``GradBucket``; ``transport``: ``Transport``, ``ShmTransport``, ...)."""
    name = _VARIABLES.get(head, head)
    if name in _INDEX.classes:
        return name, _INDEX.classes[name]
    camel = "".join(word.capitalize() for word in head.split("_"))
    found = [c for cname, cs in _INDEX.classes.items() if cname.endswith(camel)
             for c in cs] if head.islower() else []
    return name, found


def resolve_name(text: str) -> str | None:
    """None when ``text`` names something that exists (or is not gradring's to
    check), else what is missing."""
    if text in ALLOWED or text.endswith(_DATA_SUFFIX):
        return None
    parts = text.removesuffix("()").split(".")
    head = parts[0]
    if head in FOREIGN_HEADS:
        return None
    if head == "gradring":
        return None if _INDEX.in_module("gradring", parts[1:]) else "not in gradring"
    modules: list[str] = []
    for k in range(len(parts) - 1, 0, -1):  # comm.agree.X, then comm.X
        modules = _INDEX.by_short.get(".".join(parts[:k]), [])
        if modules:
            if any(_INDEX.in_module(m, parts[k:]) for m in modules):
                return None
            break
    cname, classes = _classes_for(head)
    if any(_INDEX.in_class(c, parts[1:]) for c in classes):
        return None
    if classes and not head.islower():
        return f"no {'.'.join(parts[1:])} in gradring's class {cname}"
    if modules:
        return f"not in gradring's module(s) {', '.join(modules)}"
    if len(parts) == 1 and head in _INDEX.names:
        return None  # a module-level name: an alias, a constant
    # A variable of a type not named after it (``optimizer.step()``), or a
    # name from outside gradring (``torch.compile``, ``os.environ``): not
    # gradring's to check. A class name is.
    if head[0].isupper() and _CAMEL.fullmatch(head) and not hasattr(builtins, head):
        return f"no class {head} in gradring (nor a builtin, nor in ALLOWED)"
    return None


# ------------------------------------------------------------------ the resolvers


def _repo_files() -> dict[str, list[Path]]:
    found: dict[str, list[Path]] = {}
    for top in ("gradring", "tests", "scripts", "benchmarks", "examples", "docs"):
        for path in (ROOT / top).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts:
                found.setdefault(path.name, []).append(path)
    for path in ROOT.iterdir():
        if path.is_file():
            found.setdefault(path.name, []).append(path)
    return found


_FILES = _repo_files()


def _torch_root() -> Path | None:
    spec = importlib.util.find_spec("torch")  # finds it without importing it
    return Path(spec.origin).parent.parent if spec and spec.origin else None


def resolve_file(text: str, cited_in: Path) -> str | None:
    """None when the file ``text`` cites exists (and its ``::test`` is defined)."""
    if text in ALLOWED:
        return None
    path, _, test = text.partition("::")
    path = re.sub(r":\d+$", "", path).removeprefix("./")
    if path.startswith("torch/"):
        root = _torch_root()
        return None if root is None or (root / path).exists() else "not in the installed torch"
    places = [ROOT, PACKAGE, *(d for d in cited_in.parents if d == ROOT or ROOT in d.parents)]
    if path.endswith("/"):
        return None if any((p / path).is_dir() for p in places) else "no such folder"
    hit = next((p / path for p in places if (p / path).is_file()), None)
    if hit is None:  # a file of that name (and that folder) anywhere in the repository
        hit = next((p for p in _FILES.get(Path(path).name, [])
                    if p.as_posix().endswith("/" + path)), None)
    if hit is None:
        return "no such file"
    if test:
        name = re.split(r"[\[:]", test)[0]
        if not re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{re.escape(name)}\b",
                         hit.read_text(), re.M):
            return f"{name} is not defined in {hit.relative_to(ROOT)}"
    return None


def _settings() -> set[str]:
    return set(re.findall(r'"(GRADRING_[A-Z0-9_]+)"', (PACKAGE / "config.py").read_text()))


_NOTE_TITLE = re.compile(r'^\s*(?:#\s*|"""|r""")?\[Note:\s+([^\]]+)\]\s*$', re.M)


def _defined_notes() -> set[str]:
    titles = set()
    for top in ("gradring", "tests", "scripts", "benchmarks", "examples", "docs"):
        for path in (ROOT / top).rglob("*"):
            if path.suffix in (".py", ".md") and path.is_file():
                titles.update(" ".join(t.split()) for t in _NOTE_TITLE.findall(path.read_text()))
    return titles


def _is_file(text: str) -> bool:
    """Whether ``text`` cites a file or folder of the repository (or torch's):
    not a store key such as ``gradring/board/<gen>/<rank>``."""
    if any(c in text for c in " <*"):
        return False
    return bool(_FILE.fullmatch(text)) or text.startswith(_TOP_DIRS) and \
        (text.endswith("/") or text.startswith(".ci/"))


# ------------------------------------------------------------------ the tests

QUOTED, NOTES = citations()


def _report(problems: list[str]) -> str:
    return f"{len(problems)} cited name(s) that no longer exist:\n  " + "\n  ".join(problems)


def test_cited_files_exist():
    problems = [f"{c.where}: `{c.text}`: {why}" for c in QUOTED
                if _is_file(c.text)
                and (why := resolve_file(c.text, c.source))]
    assert not problems, _report(problems)


def test_cited_settings_are_gradrings():
    known = _settings() | set(ALLOWED)
    problems = [f"{c.where}: `{c.text}`: {name} is not in gradring/config.py"
                for c in QUOTED for name in _SETTING.findall(c.text) if name not in known]
    assert not problems, _report(problems)


def test_cited_python_names_resolve():
    problems = []
    for c in QUOTED:
        if _is_file(c.text) or not (_DOTTED.fullmatch(c.text) or _CAMEL.fullmatch(c.text)):
            continue
        why = resolve_name(c.text)
        if why:
            problems.append(f"{c.where}: `{c.text}`: {why}")
    assert not problems, _report(problems)


def test_cited_notes_are_defined():
    defined = _defined_notes()
    problems = [f"{c.where}: [Note: {c.text}] is defined nowhere" for c in NOTES
                if c.text not in defined]
    assert not problems, _report(problems)


@pytest.mark.parametrize("text", [
    "gradring.reducer.NoSuchThing", "TorchSurface._inside_ddp_forward", "Reducer.no_such_member",
    "autocap.no_such_function", "NoSuchClass"])
def test_a_missing_name_is_reported(text):
    # the resolvers can fail: names that never existed
    assert resolve_name(text) is not None


def test_missing_files_settings_and_notes_are_reported():
    assert resolve_file("gradring/reducer.py", PACKAGE / "ddp" / "module.py") == "no such file"
    assert resolve_file("tests/ranks/test_compile.py::test_no_such_test", ROOT / "README.md")
    assert resolve_file("torch/no_such_module.py", ROOT / "README.md")
    assert "GRADRING_JOIN_MB" not in _settings() and "GRADRING_FAST_PATHS" in _settings()
    assert "no such note" not in _defined_notes() and "the rebuild" in _defined_notes()
    # and the ones that exist resolve
    assert resolve_name("gradring.compile.splits") is None
    assert resolve_name("BucketSplit.partition") is None
    assert resolve_file("compile/split.py", ROOT / "docs" / "compile.md") is None
