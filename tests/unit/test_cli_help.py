"""Every ``gradring`` command's --help is written for users: what it does, an example,
each option with its default, and no developer notes ("[Note: ...]") or internal
identifiers (a module's ALL_CAPS constants, or any ALL_CAPS name with an underscore
other than a GRADRING_* environment variable the user sets)."""

from __future__ import annotations

import argparse
import importlib
import re
import sys

import pytest

from gradring.tools import cli

ENV_VAR = re.compile(r"GRADRING_[A-Z0-9_]+")
UNDERSCORED = re.compile(r"\b[A-Z][A-Z0-9]*_[A-Z0-9_]+\b")


def _help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # argparse's --help
        code = exc.code
    assert code == 0, argv
    return capsys.readouterr().out


def _internal_names() -> set[str]:
    """ALL_CAPS module-level names of every gradring module loaded (the tools import
    the observers, the step model and the reducer's cap picker); the package's own
    names (``gradring.DDP``) are its public API, not internal."""
    names = set()
    for name, mod in list(sys.modules.items()):
        if name.startswith("gradring.") and mod is not None:
            names |= {k for k in vars(mod) if re.fullmatch(r"[A-Z][A-Z0-9_]{2,}", k)}
    return names


def _problems(text: str) -> list[str]:
    out = []
    if "[Note:" in text:
        out.append("a developer note")
    plain = ENV_VAR.sub("", text)
    out += [f"identifier {m}" for m in UNDERSCORED.findall(plain)]
    words = set(re.findall(r"\b[A-Z][A-Z0-9_]{2,}\b", plain))
    out += [f"internal name {w}" for w in sorted(words & _internal_names())]
    return out


@pytest.mark.parametrize("command", sorted(set(cli.COMMANDS) - {"bench"}))
def test_each_command_explains_itself(command, capsys) -> None:
    text = _help([command, "--help"], capsys)
    assert text.startswith(f"usage: gradring {command}"), text
    assert "\nexamples:\n  gradring " in text or "\nexamples:\n  GRADRING_" in text, text
    assert _problems(text) == [], text
    # every option states its default: argparse's "(default: X)", or in words where
    # there is no value to show
    ap = importlib.import_module(cli.COMMANDS[command][0]).parser()
    for action in ap._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        shown = ap.formatter_class("x")._get_help_string(action)
        assert "default" in shown, (command, action.option_strings, shown)


@pytest.mark.parametrize("argv", [["--help"], ["bench", "--help"]])
def test_the_command_lists_explain_themselves(argv, capsys) -> None:
    text = _help(argv, capsys)
    assert "\nexamples:\n  gradring " in text, text
    assert _problems(text) == [], text


def test_the_check_can_fail() -> None:
    # What the help of `gradring tune` and `gradring timeline` printed before.
    assert _problems("[Note: how the tuner decides]") == ["a developer note"]
    importlib.import_module("gradring.tools.timeline")
    found = _problems("Up to ``GANTT_MAX`` steps; one of ``PHASES`` (``step_segments``)")
    assert "identifier GANTT_MAX" in found and "internal name PHASES" in found, found
    assert _problems("GRADRING_FAST_PATHS=none and JSON, PNG") == []
