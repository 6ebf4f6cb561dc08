"""The package's files import each other without circles.

Every ``import`` statement counts: at module level, inside functions and under
``TYPE_CHECKING``. A circle hidden in a function is still a circle: the two
files cannot be understood, tested or moved one without the other. A type two
files both need belongs in a third, lower one.

``from pkg import name`` is an edge to ``pkg/name.py`` when that is a module
and to ``pkg/__init__.py`` otherwise; importing ``pkg.sub`` is an edge to
``pkg/sub.py`` only (a package's ``__init__`` that re-exports its submodules is
not a circle with them).
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import gradring

ROOT = Path(gradring.__file__).parent


def _modules(root: Path) -> dict[str, Path]:
    mods = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    stem = ".".join(base + ([node.module] if node.module else []))
                else:
                    stem = node.module or ""
                targets = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in mods else stem
                           for a in node.names]
            else:
                continue
            for name in targets:
                while name and name not in mods:
                    name = name.rpartition(".")[0]
                if name and name != mod:
                    edges[mod].add(name)
    return edges


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one file (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(edges[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        comp.append(top)
                        if top == node:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


def test_no_import_circles():
    circles = _circles(_edges(_modules(ROOT)))
    assert not circles, "import circles between files:\n" + "\n".join(
        " <-> ".join(c) for c in circles)


def test_the_walker_finds_a_circle(tmp_path):
    pkg = tmp_path / "pkgx"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkgx.a import A\n")
    (pkg / "a.py").write_text("A = 1\ndef f():\n    from pkgx.sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .. import a\n")
    (pkg / "c.py").write_text("import os\nfrom pkgx import a\n")
    circles = _circles(_edges(_modules(pkg)))
    assert circles == [["pkgx.a", "pkgx.sub.b"]], circles
    assert os.path.exists(pkg / "c.py")
