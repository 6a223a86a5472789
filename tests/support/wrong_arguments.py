"""Every option of a command line x the wrong values a user gives it (issue 44): the table the CLI tests walk.

Each test file classifies every option of its command by kind (`{option: kind}`, checked complete against the
command's own parser); WRONG lists what each kind can be given wrongly. Every (option, wrong value) must be refused
with exactly one `error:` line naming the option (and the value, where one was given), exit code 2, nothing on
stdout. A new option fails `unclassified` until it has a kind; a new kind fails until it has its wrong values.
"""

from __future__ import annotations

UNSET = "LLM_TOOLKIT_TEST_UNSET"  # an environment variable the tests never set

# kind -> {case: the value (None: the option given without one; "=V": glued to a switch, --json=V)}
WRONG: dict[str, dict[str, str | None]] = {
    "count": {"missing": None, "not a number": "x", "zero": "0", "negative": "-1", "empty": ""},
    "count or zero": {"missing": None, "not a number": "x", "negative": "-1", "empty": ""},
    "amount": {"missing": None, "not a number": "x", "zero": "0", "negative": "-1", "nan": "nan", "empty": ""},
    "amount or zero": {"missing": None, "not a number": "x", "negative": "-1", "nan": "nan", "empty": ""},
    "names": {"missing": None, "unknown": "nope_9", "empty": "", "no name": ","},
    "fraction": {"missing": None, "not a number": "x", "negative": "-0.1", "out of range": "1.5", "nan": "nan",
                 "empty": ""},
    "size": {"missing": None, "not a size": "lots", "zero": "0GB", "negative": "-5GB", "empty": ""},
    "sizes": {"missing": None, "zero": "0", "not a number": "0,a", "negative": "-1", "empty": ""},
    "choice": {"missing": None, "unknown choice": "nope", "empty": ""},
    "name": {"missing": None, "unknown": "nope_9", "empty": ""},
    "text": {"missing": None, "empty": ""},
    "file": {"missing": None, "nonexistent": "{tmp}/nowhere.txt", "a folder": "{tmp}", "empty": "",
             "unset variable": f"${UNSET}/x"},
    "folder": {"missing": None, "nonexistent": "{tmp}/nowhere", "a file": "{file}", "empty": "",
               "unset variable": f"${UNSET}/x"},
    "output": {"missing": None, "under a file": "{file}/out", "empty": "", "unset variable": f"${UNSET}/x"},
    "switch": {"given a value": "=yes"},
    "overrides": {"not key=value": "oops", "unknown key": "nope=1", "no key": "=1", "an empty key part": "train..lr=1",
                  "unknown option": "--nope"},
    "help": {},  # prints the help, exit 0: nothing a user can give it wrongly
}


def cases(kinds: dict[str, str]) -> list[tuple[str, str]]:
    """(option, case) for every option of `kinds` and every wrong value of its kind, for pytest.mark.parametrize."""
    return [(option, case) for option, kind in kinds.items() for case in WRONG[kind]]


def argv_of(option: str, kind: str, case: str, fill: dict[str, str]) -> tuple[list[str], str | None]:
    """(the arguments that give `option` its wrong value, the value as the line must name it)."""
    value = WRONG[kind][case]
    if value is not None:
        value = value.format(**fill)
    if kind == "overrides":  # positional: the value is the argument
        return [value], value
    if value is None:
        return [option], None
    if value.startswith("="):
        return [option + value], value[1:]
    return [option, value], value


def assert_one_line(code, out: str, err: str, option: str, value: str | None) -> str:
    """The refusal: one `error:` line naming the option and its value, exit code 2, nothing else said."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, err)
    assert not out.strip(), out
    line = lines[0]
    if option == "overrides":  # an override is named by its key
        assert value.split("=")[0] in line, line
        return line
    assert option in line, line
    if value == "":
        assert "''" in line, line
    elif value is not None:
        assert value in line, line
    return line
