"""The README, tests/README.md and docs/ hold current facts for the people who use and carry on the project: no path
of a developer's machine, no diary of work periods, docs/benchmarks.md within 700 lines, and every page of docs/
opening with a paragraph that says what a reader finds there (issue 62). How a figure was reached belongs in commit
messages and issue notes."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS_MAX_LINES = 700

# An absolute path on someone's machine. System files a doc names on purpose (/proc/stat, /usr/bin/time, /dev/zero)
# are not in the list; a bare /tmp is a word, /tmp/NAME a run folder.
MACHINE_PATH = re.compile(
    r"""(?<![\w.~/\\-])(?:
        /(?:work|root|scratch|mnt|media|srv|data|workspaces?|lustre|gpfs|nfs|shared|private|var/folders)(?![\w.-])
      | /home/[^/\s`'")\],]+
      | /Users/[^/\s`'")\],]+
      | /tmp/[\w.@+-]+
      | [A-Za-z]:\\(?:Users|home|Documents)\\
      | \\\\wsl
    )[^\s`'")\],;]*""",
    re.X,
)
# A relative path that climbs out of the repository, outside a markdown link's target: commands run from the root.
OUTSIDE_THE_REPOSITORY = re.compile(r"(?<![\w(/.])(?:\.\./)+[\w.-][\w./-]*")
LINK_TARGET = re.compile(r"\]\(([^)\s]+)\)")
# What a user's own machine prints: an `error:` line quoted in a doc may name the user's home folder.
QUOTED_ERROR = re.compile(r"`error:[^`]*`")

# The narrative of work periods, each pattern as wide as its class: a new diary line in any page fails.
DIARY = {
    r"\bsessions? \d+\b": "a numbered work session",
    r"\b(?:this|that|last|next|previous|same|later|earlier|GPU|device|work)\s+sessions?\b(?![- ](?:fixture|scope))":
        "a work session",
    r"\b(?:a|the|this|each|one)\s+session's\b": "a work session's",
    r"\blent\b": "what was lent or not lent",
    r"\bdevice (?:calls?|time)\b": "a lent machine's calls or time",
    r"\b(?:this|that|same|slow|slower|fast|faster|calm|quiet|noisy|middling|good|bad|next) hour\b":
        "the hour a figure was taken in",
    r"\br\d{1,3}(?:[a-z]|base)?\b": "a run id",
    r"\bissues? \d+\b": "an issue's number (a page says what is, not which issue made it)",
    r"\bthe landing(?:'s)?\b|\blanding commit\b": "the landing of a work period",
    r"\b(?:the )?review(?:'s|er's)? (?:mends?|fixes)\b": "a review's mends as history",
    r"\b(?:yesterday|the day before|this morning|tonight)\b": "a day as history",
    r"\bdevelopers?'s? (?:machine|box|laptop|environment|venv)\b|\bthe developers'(?!\w)": "a developer's machine",
    r"\b(?:my|our) (?:machine|laptop|own|test runs?|runs?)\b|\bI (?:ran|measured|tried|found|saw)\b":
        "a first-person account",
    r"\bnot (?:yet )?(?:lent|drawn)\b|\bno GPU (?:this|that) \w+": "what the work period lacked",
}


def pages() -> list[Path]:
    """Every page this test reads: the README, tests/README.md and each page of docs/."""
    return [ROOT / "README.md", ROOT / "tests" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def where(page: Path, number: int) -> str:
    return f"{page.relative_to(ROOT)}:{number}"


def machine_paths(page: Path, text: str) -> list[str]:
    """Each absolute path of a machine, and each path that leaves the repository, as 'file:line: path'."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        line = QUOTED_ERROR.sub("", line)
        for target in LINK_TARGET.findall(line):
            if target.startswith("../") and not (page.parent / target.split("#")[0]).resolve().is_relative_to(ROOT):
                found.append(f"{where(page, number)}: {target} (a link out of the repository)")
        prose = LINK_TARGET.sub("]()", line)
        found += [f"{where(page, number)}: {m.group(0)}" for m in MACHINE_PATH.finditer(prose)]
        found += [f"{where(page, number)}: {m.group(0)} (a path out of the repository)"
                  for m in OUTSIDE_THE_REPOSITORY.finditer(prose)]
    return found


def diary_lines(page: Path, text: str) -> list[str]:
    """Each line that tells a work period's story, as 'file:line: what (the words)'."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for pattern, what in DIARY.items():
            for m in re.finditer(pattern, line, re.I):
                found.append(f"{where(page, number)}: {what} ({m.group(0)!r})")
    return found


def missing_first_paragraph(page: Path, text: str) -> list[str]:
    """The page's title, then a paragraph of prose that says what the page is for; a table, a list, a code block or
    another heading in its place is named with its line."""
    lines = text.splitlines()
    if not lines or not lines[0].startswith("# "):
        return [f"{where(page, 1)}: the page does not start with a '# ' title"]
    for number, line in enumerate(lines[1:], 2):
        if not line.strip():
            continue
        opener = re.match(r"(#+ |\||```|~~~|    |\t|[-*+] |\d+\. |>|<)", line)
        if opener:
            return [f"{where(page, number)}: the title is followed by {opener.group(1).strip() or 'indented code'!r}, "
                    f"not a paragraph that says what the page is for"]
        rest = lines[number - 1:]
        words = " ".join(rest[: next((i for i, x in enumerate(rest) if not x.strip()), len(rest))]).split()
        if len(words) < 8:
            return [f"{where(page, number)}: the first paragraph is {len(words)} words; say what the page is for"]
        return []
    return [f"{where(page, 1)}: the page has a title and nothing under it"]


def test_no_page_names_a_path_of_a_developers_machine():
    found = [p for page in pages() for p in machine_paths(page, page.read_text())]
    assert not found, "paths of a machine (use a path in the repository, such as runs/NAME):\n" + "\n".join(found)


def test_no_page_tells_the_story_of_a_work_period():
    found = [d for page in pages() for d in diary_lines(page, page.read_text())]
    assert not found, ("a diary line (how a figure was reached belongs in commit messages and issue notes):\n"
                       + "\n".join(found))


def test_the_benchmarks_page_is_at_most_700_lines():
    page = ROOT / "docs" / "benchmarks.md"
    count = len(page.read_text().splitlines())
    assert count <= BENCHMARKS_MAX_LINES, (
        f"{where(page, count)}: {count} lines, over {BENCHMARKS_MAX_LINES}: keep each topic's latest figures only")


def test_every_page_of_docs_opens_with_what_a_reader_finds_there():
    found = [m for page in sorted((ROOT / "docs").glob("*.md")) for m in missing_first_paragraph(page, page.read_text())]
    assert not found, "\n".join(found)


def test_each_check_finds_what_it_is_for():
    """A planted violation of each class is found, with its file and line; the pages' legitimate paths are not."""
    page = ROOT / "docs" / "example.md"
    planted = {
        "/work/fresh/run_fresh.sh r35e": machine_paths,
        "see ../shared/gpu/README.md": machine_paths,
        "[the log](../../shared/gpu/runs/x.log)": machine_paths,
        "`--workdir /tmp/bench-export`": machine_paths,
        "in /home/alice/llm and C:\\Users\\bob\\runs": machine_paths,
        "/root/out/quick.json": machine_paths,
    }
    for line, check in planted.items():
        assert check(page, f"# T\n\n{line}\n"), line
        assert all(f.startswith("docs/example.md:3: ") for f in check(page, f"# T\n\n{line}\n")), line
    for fine in ("`/proc/stat`", "`/usr/bin/time -v`", "`/dev/zero`", "a bare /tmp folder", "`runs/parity-before.json`",
                 "[the test](../tests/test_docs.py)", "`~/.cache/llm-toolkit`", "https://example.org/home/x/work",
                 "`error: data.path=a.txt is not in /home/u, where relative paths start`"):
        assert machine_paths(page, f"# T\n\n{fine}\n") == [], fine
    for line in ("measured in session 12", "this session's cold runs", "No GPU was lent, so", "in a slow hour",
                 "r35e at f9ef7f7", "issue 42 point 11 was", "the landing's cold run", "after the review's mends",
                 "two device calls", "on the developer's machine", "I measured it twice", "yesterday's run",
                 "## Probed for issue 26: export", "(issue 65)"):
        assert diary_lines(page, f"{line}\n") and diary_lines(page, f"{line}\n")[0].startswith("docs/example.md:1: "), line
    for fine in ("runs once per session and shared", "the same session fixture's runs", "silently", "LoRA r 16",
                 "speed moves from hour to hour", "one H200, 2026-11-28, 4ec0495", "the issues a user files"):
        assert diary_lines(page, f"{fine}\n") == [], fine
    for text in ("# T\n\n| a | b |\n", "# T\n## Section\n\nText.\n", "# T\n\n```bash\nx\n```\n", "# T\n\n    code\n",
                 "Text first.\n", "# T\n\nToo short.\n"):
        assert missing_first_paragraph(page, text), text
    assert missing_first_paragraph(page, "# T\n\nWhat this page is for, in one sentence of prose.\n\n| a |\n") == []
