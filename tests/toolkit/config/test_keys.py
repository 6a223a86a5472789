"""The keys of a config tree (toolkit.config.keys)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from toolkit.config.keys import dotted_keys, key_lines, value_at
from toolkit.config.load import field


@dataclasses.dataclass
class Inner:
    mode: Literal["a", "b"] = field("a", help="which")
    size: int | None = field(None, help="how many")


@dataclasses.dataclass
class Outer:
    name: str = field("x", help="what")
    inner: Inner = field(default_factory=Inner, help="a section")


def test_a_tree_is_its_dotted_keys_a_section_is_none_and_a_missing_key_is_absent():
    assert dotted_keys(Outer) == {"name": str, "inner.mode": Literal["a", "b"], "inner.size": int | None}
    assert value_at(Outer(), "inner.mode") == "a" and value_at(Outer(), "inner.gone", absent="-") == "-"
    assert key_lines(Outer) == ["  name (str, default 'x'): what", "", "inner: a section",
                                "  inner.mode (a|b, default 'a'): which", "  inner.size (int | None, default None): how many"]


@dataclasses.dataclass
class Shipped:
    """A section whose default_factory sets a key: its default is the tree's, not the section class's."""

    inner: Inner = field(default_factory=lambda: Inner(size=3), help="a section")
    name: str = field("x", help="what")


def test_a_loaded_configs_lines_say_each_value_it_set_and_where_and_the_trees_own_default(tmp_path):
    from toolkit.config.load import load_config

    (tmp_path / "c.yaml").write_text("name: y\ninner:\n  size: 5\n")
    given: dict[str, str] = {}
    cfg = load_config(Shipped, tmp_path / "c.yaml", ["inner.size=7"], given=given)
    assert given == {"inner.size": "command line", "name": "config"}  # an override wins
    assert key_lines(Shipped, cfg, given)[-1] == "  name (str, 'y' from the config, default 'x'): what"

    assert key_lines(Shipped)[3] == "  inner.size (int | None, default 3): how many"  # not Inner's None
    given = {}
    cfg = load_config(Shipped, None, ["inner.size=7", "name=x"], given=given)
    assert given == {"inner.size": "command line", "name": "command line"}
    assert key_lines(Shipped, cfg, given) == [
        "", "inner: a section", "  inner.mode (a|b, default 'a'): which",
        "  inner.size (int | None, 7 from the command line, default 3): how many",
        "  name (str, 'x' from the command line (= default)): what"]
