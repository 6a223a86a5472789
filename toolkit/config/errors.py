"""The one kind of error a user's mistake raises: recipes print it as one line, with no traceback."""

from __future__ import annotations


class UserError(Exception):
    """A mistake in what the user asked for; recipes print it as one line, with no traceback."""


def first_line(exc: BaseException) -> str:
    """What an exception says, as a clause of a one-line error: its first line (at most 300 characters), or its
    type if it says nothing."""
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]


class ConfigError(UserError):
    def __init__(self, problems: list[str]):
        self.problems = problems
        if len(problems) == 1:
            super().__init__(problems[0])
        else:
            super().__init__(f"{len(problems)} problems in the config:\n  - " + "\n  - ".join(problems))
