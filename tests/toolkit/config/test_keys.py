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
