"""Which loaded modules hold torch's DDP class in a global, and what they do with it.

[Note: captured names]
``from torch.nn.parallel import DistributedDataParallel`` copies the class
object into the importing module's globals when it is imported. Replacing the
name on ``torch.nn.parallel`` later (``gradring.install()``) does not reach
that copy: Ray Train's ``prepare_model`` and Lightning Fabric's ``ddp``
strategy construct torch's wrapper from such a copy. So ``install()`` also
looks through ``sys.modules`` (outside ``torch.*`` and ``gradring``) for
globals that are torch's class, under any name, and reads each such module's
source to see what the name is used for:

- a module that may construct with it -- a call ``NAME(...)``, or any use that
  can hand the class on to a call: ``Wrapper = NAME``, ``partial(NAME)``, an
  argument, a return value, a class base -- gets the global pointed at
  gradring's class while installed (``uninstall()`` puts torch's back);
- a module that only checks with it -- the class argument of ``isinstance``
  or ``issubclass``, a comparison, an attribute read, an annotation -- is left
  alone: gradring's class subclasses torch's, so those checks accept both;
- a module whose source cannot be read or parsed cannot be told apart, and
  gets a warning (once per module) that names it and the routes that work.

Reading is by name only, at module level and in every function: a local that
shadows the global is counted as the global (erring towards rebinding).
"""

from __future__ import annotations

import ast
import inspect
import sys
from dataclasses import dataclass
from types import ModuleType

__all__ = ["Capture", "find_captures", "module_label"]


@dataclass(frozen=True)
class Capture:
    """One module holding torch's class under ``names``, and the verdict on it."""

    #: The module whose globals hold the class.
    module: ModuleType
    #: Every global name in it bound to the class (``DistributedDataParallel``, ``DDP``, ...).
    names: tuple[str, ...]
    #: "rebind" (may construct), "leave" (checks only) or "unreadable".
    verdict: str


def _skipped(name: str, skip: tuple[str, ...]) -> bool:
    return any(name == s or name.startswith(s + ".") for s in skip)


def find_captures(cls: type, skip: tuple[str, ...] = ("torch", "gradring")) -> list[Capture]:
    """Every loaded module (outside ``skip`` and its submodules) holding ``cls`` in a global."""
    found = []
    for modname, module in list(sys.modules.items()):
        if module is None or _skipped(modname, skip):
            continue
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict) or not isinstance(module, ModuleType):
            continue
        names = tuple(k for k, v in list(namespace.items()) if v is cls)
        if names:
            found.append(Capture(module, names, _verdict(module, names)))
    return found


def _verdict(module: ModuleType, names: tuple[str, ...]) -> str:
    try:
        tree = ast.parse(inspect.getsource(module))
    except (OSError, TypeError, SyntaxError, ValueError):
        return "unreadable"
    finder = _ConstructingUse(frozenset(names))
    finder.visit(tree)
    return "rebind" if finder.found else "leave"


class _ConstructingUse(ast.NodeVisitor):
    """Finds a load of one of ``names`` outside the check-only positions of the Note."""

    def __init__(self, names: frozenset[str]) -> None:
        # The global names bound to torch's class in the module being read.
        self._names = names
        # Whether a use that may construct was seen.
        self.found = False

    def _is_ours(self, node: ast.AST) -> bool:
        return isinstance(node, ast.Name) and node.id in self._names

    def visit_Name(self, node: ast.Name) -> None:
        if node.id in self._names and isinstance(node.ctx, ast.Load):
            self.found = True

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Name) and func.id in ("isinstance", "issubclass") \
                and len(node.args) == 2:
            self.visit(node.args[0])
            classes = node.args[1]
            elts = classes.elts if isinstance(classes, ast.Tuple) else [classes]
            for elt in elts:
                if not self._is_ours(elt):
                    self.visit(elt)
            return
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        for operand in (node.left, *node.comparators):
            if not self._is_ours(operand):
                self.visit(operand)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if not self._is_ours(node.value):
            self.visit(node.value)

    def visit_arg(self, node: ast.arg) -> None:
        return None  # an annotation only

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self.visit(node.target)
        if node.value is not None:
            self.visit(node.value)

    def _visit_function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        for part in (*node.decorator_list, *node.args.defaults,
                     *(d for d in node.args.kw_defaults if d is not None), *node.body):
            self.visit(part)

    visit_FunctionDef = _visit_function
    visit_AsyncFunctionDef = _visit_function


def module_label(module: ModuleType) -> str:
    """The module's name, and its file where it has one, for messages."""
    where = getattr(module, "__file__", None)
    return f"{module.__name__} ({where})" if where else module.__name__
