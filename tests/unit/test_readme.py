"""The README against the code: its module table covers the live package, and the
figures it states about the code are computed here, not typed by hand.

Figures about the code (counts, defaults, the unsupported arguments) are each
checked below against the package. Measured times and ratios are not code
figures: each one cites a file in ``benchmarks/results/`` (checked to exist)
with its date and command.
"""

from __future__ import annotations

import ast
import inspect
import re
import shlex
from pathlib import Path

import pytest
import torch
from torch import nn

import gradring
from gradring.buckets import assign

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
PACKAGE = ROOT / "gradring"


def _section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end if end >= 0 else len(README)]


# ------------------------------------------------------------------ "What is where"


def table_entries(text: str) -> list[tuple[str, str]]:
    """``(base folder, name)`` for every backticked name in the first cell of the
    tables under a bold header naming ``gradring/...`` folders. Names are relative
    to the header's folder, or to the folders' common parent where it names several."""
    out: list[tuple[str, str]] = []
    base = ""
    for line in text.splitlines():
        if line.startswith("**"):
            folders = re.findall(r"`(gradring/[^`]*)`", line)
            if folders:
                parents = {str(Path(f)) for f in folders}
                base = parents.pop() if len(parents) == 1 else str(
                    Path(*Path(folders[0]).parts[:1]))
            continue
        if base and line.startswith("| `"):
            first = line.split("|")[1]
            for name in re.findall(r"`([^`]+)`", first):
                out.append((base, name))
    return out


def package_modules() -> set[str]:
    return {str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py")
            if "__pycache__" not in p.parts}


def test_table_parser_reads_bases_and_cells() -> None:
    text = ("**A, `gradring/x/`**\n\n| module | what |\n|---|---|\n"
            "| `a.py`, `b/` | z |\n\n**B, `gradring/p/` and `gradring/q/`**\n\n"
            "| `p/c.py` | w |\n")
    assert table_entries(text) == [("gradring/x", "a.py"), ("gradring/x", "b/"),
                                   ("gradring", "p/c.py")]


def test_what_is_where_lists_every_module() -> None:
    entries = table_entries(_section("What is where"))
    named = {str(Path(base) / name) + ("/" if name.endswith("/") else "")
             for base, name in entries}
    stale = sorted(n for n in named if not (ROOT / n).exists())
    assert stale == [], f"the README's table names paths that do not exist: {stale}"
    folders = [n for n in named if n.endswith("/")]
    missing = sorted(m for m in package_modules()
                     if m not in named and not any(m.startswith(f) for f in folders))
    assert missing == [], f"modules missing from the README's 'What is where': {missing}"


# ------------------------------------------------------------------ figures about the code


def test_torch_internal_method_count() -> None:
    ours = gradring.DistributedDataParallel
    stubs = [name for name, value in vars(ours).items()
             if callable(value) and "gradring has no counterpart" in (value.__doc__ or "")]
    assert len(stubs) > 0
    for name in stubs:  # each really raises, naming itself
        with pytest.raises(NotImplementedError, match=name):
            getattr(ours, name)(object())
    said = re.findall(r"for (\d+) torch-internal methods", README)
    assert said == [str(len(stubs))], (said, sorted(stubs))


def _unsupported_in_code() -> list[str]:
    """The keyword names DDP's ``__init__`` passes to ``_check_supported``, read
    from the source."""
    source = inspect.getsource(gradring.DistributedDataParallel.__init__)
    tree = ast.parse(source.strip().replace("\n    ", "\n") if source.startswith("    ")
                     else source)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id == "_check_supported"):
            return [k.arg for k in node.keywords if k.arg is not None]
    raise AssertionError("no `_check_supported(...)` call in DistributedDataParallel.__init__")


def test_unsupported_arguments_match_the_code() -> None:
    migration = _section("Migrating from torch DDP")
    listed = re.search(r"arguments gradring does not support yet \(([^)]*)\)", migration)
    assert listed, "the migration section lists no unsupported arguments"
    said = re.findall(r"`(\w+)`", listed.group(1))
    code = _unsupported_in_code()
    assert sorted(said) == sorted(code), (said, code)
    for name in code:
        value = True if name == "batched_grad_copy" else [("w", nn.Parameter(torch.ones(1)))]
        with pytest.raises(NotImplementedError, match=name):
            gradring.DistributedDataParallel(nn.Linear(2, 2), **{name: value})
    # device_mesh is accepted (1-D); the README must not call it unsupported.
    assert "device_mesh" not in code and "`device_mesh` is accepted when it is 1-D" in migration


def test_default_bucket_sizes() -> None:
    migration = _section("Migrating from torch DDP")
    assert f"({assign.DEFAULT_BUCKET_CAP_MB} MiB\nbuckets" in migration or \
        f"({assign.DEFAULT_BUCKET_CAP_MB} MiB buckets" in migration
    first = assign.DEFAULT_FIRST_BUCKET_BYTES / assign.MIB
    assert f"capped at {first:g} MiB when `bucket_cap_mb` is left at its default" in README


def test_torch_version() -> None:
    major_minor = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    assert f"torch {major_minor}'s" in README
    assert re.findall(r"torch==([\d.]+)", README) and all(
        v.startswith(major_minor) for v in re.findall(r"torch==([\d.]+)", README))


def test_demo_process_count() -> None:
    from gradring.tools import demo

    source = inspect.getsource(demo)
    default = re.search(r'"--nproc", type=int, default=(\d+)', source)
    assert default, "the demo's --nproc default was not found"
    assert f"({default.group(1)} local processes train" in README


def test_measured_figures_cite_existing_logs() -> None:
    cited = set(re.findall(r"benchmarks/results/[\w.-]+\.md", README))
    assert cited, "the README cites no measurement log"
    for path in sorted(cited):
        assert (ROOT / path).exists(), path
    for doc in sorted((ROOT / "docs").glob("*.md")):
        for path in re.findall(r"benchmarks/results/[\w.-]+\.md", doc.read_text()):
            assert (ROOT / path).exists(), (doc.name, path)


def test_no_stale_claims() -> None:
    assert "`pytest` runs everything" not in README
    assert "device_mesh`, `batched_grad_copy`) raise" not in README


# ------------------------------------------------------------------ the two commands and CI


def _bash_blocks_after(phrase: str) -> str:
    at = README.index(phrase)
    m = re.search(r"```bash\n(.*?)\n```", README[at:], re.S)
    assert m, phrase
    return m.group(1)


def _steps(command: str) -> list[list[str]]:
    """A command line as its ``&&`` steps, each split into words, without pip's -q."""
    return [[w for w in shlex.split(step) if w != "-q"] for step in command.split("&&")]


def test_ci_runs_the_readme_test_command() -> None:
    """.ci/run's steps are the README's test command's, in order (pytest may add
    reporting options)."""
    readme = _steps(_bash_blocks_after("Set up and run the tests"))
    ci_lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
                if line.startswith((".venv/bin/", "python3 -m venv"))]
    ci = [[w for w in shlex.split(line) if w != "-q"] for line in ci_lines]
    for step in readme:
        match = [c for c in ci if c[:len(step)] == step]
        assert match, f"the README's step {' '.join(step)!r} is not in .ci/run"


def test_both_commands_come_first() -> None:
    """The first screen: what and for whom, the optional CPU step, the two commands,
    then the one-import switch, before any measured figure."""
    head = README[:README.index("\n---\n")]
    assert head.index("Set up and run the demo") < head.index("Set up and run the tests") \
        < head.index("+from gradring import DistributedDataParallel as DDP")
    assert "--index-url https://download.pytorch.org/whl/cpu" in head
    assert not re.search(r"\d+(\.\d+)?×", head), "measured ratios belong below the first screen"
