"""A line budget for each top-level folder of ``gradring/``.

[Note: the line budget]
Code grows one reasonable commit at a time; a budget makes the growth a
decision instead of a drift. Each top-level folder of the package (and the
package's own top-level files, as ``"."``) has a budget in lines of Python,
counted as ``wc -l`` counts them. A change that takes a folder over its budget
fails this test. Raising a budget is allowed only in a commit whose message
says why that folder needs the lines (a new concept, not a longer copy of an
old one); lowering it after a deletion is always welcome.

The budgets below were taken on 2026-12-07, after issue 56 deleted the
at-the-end policy. ``comm/`` then shrank from 9157 lines to under 8300: the
small synchronous path goes through the engine's one synchronous entry
(``Engine.run_now``) instead of its own, test-only code (the threaded
transport, the closed-form oracles) moved to tests/support/, exits.py joined
peers.py, dead state went, and Notes that docs/*.md tell at length keep only
their reasoning. It is expected to shrink, not grow.
"""

from __future__ import annotations

from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "gradring"

#: folder -> the most lines of Python it may hold ("." is the package's own files).
BUDGET = {
    ".": 2750,
    "buckets": 1020,
    "comm": 8300,
    "compile": 540,
    "ddp": 1985,
    "hooks": 1070,
    "nn": 370,
    "observe": 830,
    "reducer": 1950,
    "tools": 6860,
}


def _lines(files: list[Path]) -> int:
    return sum(f.read_bytes().count(b"\n") for f in files)


def sizes() -> dict[str, int]:
    """Lines of Python per top-level folder of the package, as BUDGET keys them."""
    out = {".": _lines(sorted(PACKAGE.glob("*.py")))}
    for folder in sorted(p for p in PACKAGE.iterdir() if p.is_dir()):
        files = sorted(folder.rglob("*.py"))
        if files:
            out[folder.name] = _lines(files)
    return out


def test_every_folder_has_a_budget() -> None:
    unbudgeted = sorted(set(sizes()) - set(BUDGET))
    assert not unbudgeted, (f"folders of gradring/ without a line budget: {unbudgeted}; "
                            "add one in tests/unit/test_line_budget.py ([Note: the line budget])")
    gone = sorted(set(BUDGET) - set(sizes()))
    assert not gone, f"budgets for folders that no longer exist: {gone}"


@pytest.mark.parametrize("folder", sorted(BUDGET))
def test_folder_within_its_budget(folder: str) -> None:
    have = sizes().get(folder, 0)
    assert have <= BUDGET[folder], (
        f"gradring/{folder if folder != '.' else ''} holds {have} lines of Python, over its "
        f"budget of {BUDGET[folder]}: shrink it, or raise the budget in a commit that says why "
        "([Note: the line budget] in tests/unit/test_line_budget.py)")


def test_the_count_is_wc_l() -> None:
    """The counter agrees with a plain line count on a file of known length."""
    here = Path(__file__)
    assert _lines([here]) == len(here.read_text().splitlines())
