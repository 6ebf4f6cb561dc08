"""Every code block in README.md and docs/*.md runs, as written.

A fenced block tagged ``python`` or ``bash`` is code; untagged, ``text`` and
``diff`` blocks are output or illustration and are not run. Each file's blocks
run in order in one temporary folder, so a later block can use an earlier one's
files (a trace written in Python, then ``gradring explain`` on it).

- A python block that calls ``init_process_group`` is a whole script: it runs
  under ``torchrun --standalone --nproc-per-node=2``.
- Any other python block is a fragment: it runs on both ranks of a world-2 gloo
  group, in one namespace per file (a later block sees an earlier one's names),
  after ``PRELUDE`` below, which defines the names the docs use for
  "your" things (``model``, ``ddp``, ``x``, ``y``, ``data``, ``loss_fn``,
  ``opt``, ``steps``, ``train_step``, ``rank``, ``world``, ``MyModel``).
- A bash block runs line by line (``\\`` continues a line) with ``.venv/bin/``
  meaning this interpreter's folder and ``gradring`` the console script.

A block that cannot run here says so on the line before it, in a comment the
rendered page does not show, and the test checks that the reason is there:
``<!-- doctest: skip: <why> -->`` or ``<!-- doctest: covered-by tests/FILE.py::TEST -->``
(the named test must exist).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BIN = Path(sys.executable).parent

pytestmark = pytest.mark.slow

PRELUDE = """
import torch, torch.distributed as dist
import gradring
from torch import nn
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
torch.set_num_threads(1)

class MyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    def forward(self, x):
        return self.net(x)

model = MyModel()
x, y = torch.randn(8, 16), torch.randn(8, 4)
data = [(torch.randn(8, 16), torch.randn(8, 4)) for _ in range(3)]
loss_fn = nn.functional.mse_loss
steps = 3
ddp = gradring.DistributedDataParallel(MyModel())
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)

def train_step():
    opt.zero_grad()
    loss_fn(ddp(x), y).backward()
    opt.step()
"""


class Block(NamedTuple):
    path: Path
    line: int        # 1-based line of the opening fence
    lang: str
    code: str
    marker: str      # the doctest comment on the line before, or ""


_FENCE = re.compile(r"^```(\S*)\s*$")
_MARKER = re.compile(r"^<!--\s*doctest:\s*(.*?)\s*-->\s*$")


def blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1).lower()
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        prev = lines[start - 1] if start else ""
        mk = _MARKER.match(prev)
        out.append(Block(path, start + 1, lang, "\n".join(lines[start + 1:j]) + "\n",
                         mk.group(1) if mk else ""))
        i = j + 1
    return out


def _commands(code: str) -> list[str]:
    cmds, cur = [], ""
    for raw in code.splitlines():
        line = raw.split("  #")[0].rstrip() if not raw.lstrip().startswith("#") else ""
        if line.endswith("\\"):
            cur += line[:-1] + " "
            continue
        cur += line
        if cur.strip():
            cmds.append(" ".join(cur.split()))
        cur = ""
    return cmds


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"]
                                     if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _run_bash(block: Block, cwd: Path) -> None:
    for cmd in _commands(block.code):
        cmd = cmd.replace(".venv/bin/", f"{BIN}/")
        cmd = re.sub(r"(^|\s)(examples|benchmarks|scripts)/", rf"\1{ROOT}/\2/", cmd)
        proc = subprocess.run(cmd, shell=True, cwd=cwd, env=_env(), capture_output=True,
                              text=True, timeout=600, executable="/bin/bash")
        assert proc.returncode == 0, (f"{block.path.name}:{block.line}: `{cmd}` exited "
                                      f"{proc.returncode}\n{proc.stdout[-3000:]}\n"
                                      f"{proc.stderr[-3000:]}")


def _run_script(block: Block, cwd: Path) -> None:
    script = cwd / f"block_{block.line}.py"
    script.write_text(block.code)
    proc = subprocess.run(
        [str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2", str(script)],
        cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (f"{block.path.name}:{block.line} under torchrun exited "
                                  f"{proc.returncode}\n{proc.stdout[-3000:]}\n"
                                  f"{proc.stderr[-3000:]}")


#: On a pooled rank: one namespace per docs file, so that a file's later blocks
#: see what its earlier ones imported and built, as a reader following the page would.
_NAMESPACES: dict[str, dict] = {}


def exec_fragment(rank: int, world_size: int, code: str, cwd: str) -> None:
    """On a pooled rank: the prelude (once per file), then the block, in the file's folder."""
    here = os.getcwd()
    os.chdir(cwd)
    try:
        ns = _NAMESPACES.get(cwd)
        if ns is None:
            _NAMESPACES.clear()  # one file at a time: drop the previous file's models
            ns = _NAMESPACES[cwd] = {"__name__": "__doc_block__"}
            exec(compile(PRELUDE, "<prelude>", "exec"), ns)
        exec(compile(code, "<doc block>", "exec"), ns)
    finally:
        os.chdir(here)


def _check_marker(block: Block) -> str | None:
    """The reason a block does not run here, checked; None when it runs."""
    if not block.marker:
        return None
    kind, _, rest = block.marker.partition(" ")
    if kind == "skip:":
        assert rest.strip(), f"{block.path.name}:{block.line}: a skip needs a reason"
        return rest
    if kind == "covered-by":
        file, _, name = rest.strip().partition("::")
        text = (ROOT / file).read_text()
        assert re.search(rf"^def {re.escape(name)}\(", text, re.M), \
            f"{block.path.name}:{block.line}: {rest} does not exist"
        return rest
    raise AssertionError(f"{block.path.name}:{block.line}: unknown doctest marker "
                         f"{block.marker!r}")


@pytest.mark.parametrize("doc", DOCS, ids=[p.name for p in DOCS])
def test_code_blocks_run_as_written(doc: Path, pools, tmp_path: Path) -> None:
    ran = 0
    for block in blocks(doc):
        if block.lang not in ("python", "bash", "sh", "console"):
            continue
        if _check_marker(block) is not None:
            continue
        if block.lang == "python":
            if "init_process_group" in block.code:
                _run_script(block, tmp_path)
            else:
                compile(block.code, f"{doc.name}:{block.line}", "exec")
                pools.run(2, exec_fragment, textwrap.dedent(block.code), str(tmp_path),
                          timeout=300)
        else:
            _run_bash(block, tmp_path)
        ran += 1
    if not ran:
        pytest.skip(f"{doc.name} has no block that runs here")


def test_blocks_and_markers_are_parsed(tmp_path: Path) -> None:
    doc = tmp_path / "d.md"
    doc.write_text("x\n<!-- doctest: skip: needs two hosts -->\n```bash\nssh a \\\n  b\n```\n"
                   "```python\nprint(1)\n```\n```\noutput\n```\n")
    got = blocks(doc)
    assert [(b.line, b.lang, b.marker) for b in got] == [
        (3, "bash", "skip: needs two hosts"), (7, "python", ""), (10, "", "")]
    assert _check_marker(got[0]) == "needs two hosts" and _check_marker(got[1]) is None
    assert _commands(got[0].code) == ["ssh a b"]
    assert _commands("a  # note\n# comment\nc\n") == ["a", "c"]
