"""Help text for the ``gradring`` commands: written for users, with defaults and examples.

Every command builds its parser with ``command_parser``: a one-paragraph
description of what the command does, examples (the command line and what it
does), and each option's default after its help, as argparse's
``ArgumentDefaultsHelpFormatter`` adds it. An option whose default is None
says in its own help what happens when it is not given.
"""

from __future__ import annotations

import argparse
import textwrap
from collections.abc import Sequence


class HelpFormatter(argparse.RawDescriptionHelpFormatter,
                    argparse.ArgumentDefaultsHelpFormatter):
    """The description and examples as written; "(default: X)" after each option's help
    (flags read "off"/"on"); nothing added where the default is None (the help says it)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or action.default is None \
                or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        if isinstance(action.default, bool):
            return f"{text} (default: {'on' if action.default else 'off'})"
        return text + " (default: %(default)s)"


def command_parser(prog: str, description: str, examples: Sequence[tuple[str, str]],
                   more: str = "") -> argparse.ArgumentParser:
    """A parser whose help reads: usage, ``description``, the options, then
    ``examples`` (command, what it does) and ``more`` (where to read further)."""
    lines = ["examples:"]
    for command, what in examples:
        lines += [f"  {command}", f"      {what}"]
    epilog = "\n".join(lines) + (f"\n\n{textwrap.fill(more, 79)}" if more else "")
    return argparse.ArgumentParser(prog=prog, description=textwrap.fill(description, 79),
                                   epilog=epilog, formatter_class=HelpFormatter)
