"""toolkit/config/user_paths.py: paths as users write them (~, $VAR, ${VAR}), expanded one way; what a shell would make
empty refused in one line. Every path key of the recipes' configs: tests/toolkit/training/test_recipe_config.py."""

from __future__ import annotations

import pytest

from toolkit.config.user_paths import UnusablePath, expand_path, from_here


def test_paths_expand_as_a_shell_would_and_refuse_what_it_would_make_empty(monkeypatch):
    monkeypatch.setenv("HOME", "/home/u")
    monkeypatch.setenv("DATA", "/data")
    monkeypatch.delenv("LLM_TOOLKIT_TEST_UNSET", raising=False)
    assert expand_path("~/x$DATA${DATA}", "data.path") == "/home/u/x/data/data"
    assert expand_path("runs/x", "output_dir") == "runs/x" and expand_path("a$", "output_dir") == "a$"
    assert expand_path("{% for m in messages %}$x{% endfor %}", "data.chat_template").startswith("{%")  # text
    with pytest.raises(UnusablePath, match=r"^--output \$LLM_TOOLKIT_TEST_UNSET names the environment variable"):
        expand_path("$LLM_TOOLKIT_TEST_UNSET", "--output")
    with pytest.raises(UnusablePath, match=r"^data.path=~nobody_here/x: there is no user 'nobody_here'"):
        expand_path("~nobody_here/x", "data.path")


def test_a_hint_names_a_path_that_works_from_where_the_command_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert from_here(tmp_path / "a" / "b.yaml") == "a/b.yaml"
    assert from_here(tmp_path.parent / "c.yaml") == str(tmp_path.parent / "c.yaml")  # not ../c.yaml: absolute
