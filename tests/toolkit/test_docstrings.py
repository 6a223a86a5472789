"""Module docstrings stay a few lines: what the module does and the one thing to know first; the reasoning
behind it lives in docs/internals.md, under a section headed with the module's path (issue 62)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 8
# The modules whose docstring may stay longer, each with its reason (one that is short again fails the first test
# until its entry goes).
LONG_DOCSTRINGS = {
    "toolkit/run/faults.py": "the environment variables' syntax and the kill points, the list of points built at import",
}


def module_docstrings() -> dict[str, str | None]:
    """Each toolkit module's docstring (None where it has none), by its path; an empty file (a package marker)
    has nothing to describe and is left out."""
    found = {}
    for path in sorted((ROOT / "toolkit").rglob("*.py")):
        tree = ast.parse(path.read_text())
        if tree.body:
            found[path.relative_to(ROOT).as_posix()] = ast.get_docstring(tree)
    return found


def test_every_module_docstring_is_at_most_eight_lines():
    """A module says what it does in a few lines; the essays go to docs/internals.md."""
    long = {path: "no docstring" if doc is None else f"{len(doc.splitlines())} lines"
            for path, doc in module_docstrings().items()
            if path not in LONG_DOCSTRINGS and (doc is None or len(doc.splitlines()) > MAX_LINES)}
    assert not long, long
    still_long = {path for path, doc in module_docstrings().items() if doc and len(doc.splitlines()) > MAX_LINES}
    assert set(LONG_DOCSTRINGS) <= still_long, f"exempt but short now: {set(LONG_DOCSTRINGS) - still_long}"


def test_every_module_that_points_at_docs_internals_has_its_section_there():
    """A docstring naming docs/internals.md finds a section headed with its module's path."""
    headings = set(re.findall(r"^## (\S+)\s*$", (ROOT / "docs" / "internals.md").read_text(), re.M))
    missing = [path for path, doc in module_docstrings().items()
               if doc and "docs/internals.md" in doc and path not in headings]
    assert not missing, missing
