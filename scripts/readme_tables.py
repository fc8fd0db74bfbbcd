"""What the README's generated tables share: finding their section and the ``--write`` command.

Used by ``scripts/supported_models.py`` and ``scripts/mepic_options.py``; ``tests/test_docs.py``
compares each script's ``render()`` with its section of README.md.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def section(text: str, begin: str, end: str) -> str:
    """The text between the markers ``begin`` and ``end`` (both excluded)."""
    start, stop = text.index(begin) + len(begin), text.index(end)
    return text[start:stop].strip("\n")


def main(render: Callable[[], str], begin: str, end: str, description: str) -> int:
    """Print the table, or with ``--write`` replace its section in README.md."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--write", action="store_true", help="replace the section in README.md")
    args = parser.parse_args()
    table = render()
    if not args.write:
        print(table)
        return 0
    text = README.read_text(encoding="utf-8")
    start, stop = text.index(begin) + len(begin), text.index(end)
    README.write_text(text[:start] + "\n" + table + "\n" + text[stop:], encoding="utf-8")
    return 0
