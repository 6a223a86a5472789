"""docs/faults.md promises a behaviour for each bad input and names the test that checks it:
every named test must exist, and the table must not shrink into placeholders."""

from __future__ import annotations

import functools
import importlib.util
import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"
LINK = re.compile(r"^\[(?P<name>test_\w+)(?:\[(?P<param>[^\]]+)\])?\]\((?P<path>\.\./tests/[\w/]+\.py)\)$")
MIN_ROWS = 40
MAX_TODO = 6  # the rows other work is still building; more and the page turns into a wish list


def table_rows(text: str) -> list[list[str]]:
    """The cells of each row of the page's table, without its header, separator and section rows."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    rows = [[cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip()[1:-1])] for line in lines[2:]]  # \| is a pipe in a cell
    return [cells for cells in rows if any(cells[1:])]  # a section row has only its bold title


def problems(text: str, docs: Path) -> list[str]:
    """Everything wrong with the page: too few rows, too many TODO rows, a test that is not there."""
    rows = table_rows(text)
    found = [] if len(rows) >= MIN_ROWS else [f"{len(rows)} rows; the page promises at least {MIN_ROWS}"]
    todo = [cells[0] for cells in rows if "TODO" in cells[0]]
    if len(todo) > MAX_TODO:
        found.append(f"{len(todo)} TODO rows (at most {MAX_TODO}): {todo}")
    for cells in rows:
        if "TODO" in cells[0]:
            continue
        if len(cells) != 4:
            found.append(f"a row needs input, what you see, exit code and test: {cells}")
            continue
        # 1: plain accelerate launch, whatever failed; 128 + n: ended at once by signal n (130 a second Ctrl-C, 137 SIGKILL)
        if cells[2] not in {"0", "1", "2", "3", "4", "5", "130", "137", "143"}:
            found.append(f"exit code {cells[2]!r} is not one the recipes use: {cells[0]}")
        link = LINK.match(cells[3])
        if link is None:
            found.append(f"the test cell is not [test_name](../tests/path.py): {cells[3]}")
            continue
        test_file = docs / link["path"]
        if not test_file.is_file():
            found.append(f"{link['path']} does not exist (row: {cells[0]})")
            continue
        source = test_file.read_text()
        if not re.search(rf"^def {link['name']}\(", source, re.MULTILINE):
            found.append(f"{link['path']} has no {link['name']}")
        # a parameter id is written out in the file, or is its values joined by '-'
        param = link["param"]
        if param and param not in source and not all(part in source for part in param.split("-")) and (
                f"{link['name']}[{param}]" not in collected(test_file)):  # ids made from a table the file imports
            found.append(f"{link['path']} has no case {param!r} of {link['name']}")
    return found


@functools.cache
def collected(test_file: Path) -> frozenset[str]:
    """name[id] of every case the file's tests list by explicit ids (built from a table the file imports)."""
    spec = importlib.util.spec_from_file_location(f"docs_faults_{test_file.stem}", test_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return frozenset(f"{name}[{case}]" for name, test in vars(module).items() if name.startswith("test_")
                     for mark in getattr(test, "pytestmark", []) if mark.name == "parametrize"
                     for case in mark.kwargs.get("ids") or [] if isinstance(case, str))


def test_every_row_names_a_test_that_exists():
    assert problems((DOCS / "faults.md").read_text(), DOCS) == []


def test_the_check_finds_a_missing_test_a_missing_file_and_too_many_todo_rows():
    page = (DOCS / "faults.md").read_text()
    broken = page.replace("[test_empty_corpus]", "[test_no_such_test]").replace(
        "(../tests/recipes/test_export.py)", "(../tests/recipes/test_exports.py)", 1)
    found = problems(broken, DOCS)
    assert "../tests/recipes/test_pretrain_errors.py has no test_no_such_test" in found
    assert any(p.startswith("../tests/recipes/test_exports.py does not exist") for p in found)
    placeholders = "\n".join(f"| TODO: case {i} | TODO | TODO | TODO |" for i in range(MAX_TODO + 1))
    already = sum("TODO" in cells[0] for cells in table_rows(page))
    assert any(p.startswith(f"{MAX_TODO + 1 + already} TODO rows") for p in problems(page + placeholders + "\n", DOCS))
    assert problems("| input | what | exit | test |\n|---|---|---|---|\n", DOCS) == [
        f"0 rows; the page promises at least {MIN_ROWS}"
    ]
