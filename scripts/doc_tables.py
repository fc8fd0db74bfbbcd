"""What the generated doc tables share: finding their section and the ``--write`` command.

Used by ``scripts/supported_models.py`` (docs/models.md) and ``scripts/mepic_options.py``
(docs/options.md); ``tests/test_docs.py`` compares each script's ``render()`` with its section.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def section(text: str, begin: str, end: str) -> str:
    """The text between the markers ``begin`` and ``end`` (both excluded)."""
    start, stop = text.index(begin) + len(begin), text.index(end)
    return text[start:stop].strip("\n")


def main(render: Callable[[], str], begin: str, end: str, description: str, doc: Path) -> int:
    """Print the table, or with ``--write`` replace its section in ``doc``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--write", action="store_true", help=f"replace the section in {doc.name}")
    args = parser.parse_args()
    table = render()
    if not args.write:
        print(table)
        return 0
    text = doc.read_text(encoding="utf-8")
    start, stop = text.index(begin) + len(begin), text.index(end)
    doc.write_text(text[:start] + "\n" + table + "\n" + text[stop:], encoding="utf-8")
    return 0
