"""The user's mistake as one line: ConfigError gathers every problem, first_line shortens what a library raised."""

from __future__ import annotations

from toolkit.config.errors import ConfigError, UserError, first_line


def test_config_error_is_a_user_error():
    assert issubclass(ConfigError, UserError)
    assert str(ConfigError(["only one"])) == "only one"
    assert str(ConfigError(["a", "b"])) == "2 problems in the config:\n  - a\n  - b"


def test_first_line_is_the_first_line_or_the_type_of_a_silent_exception():
    assert first_line(OSError("disk full\nsecond line")) == "disk full"
    assert first_line(KeyError()) == "KeyError"
    assert first_line(ValueError("x" * 400)) == "x" * 300
