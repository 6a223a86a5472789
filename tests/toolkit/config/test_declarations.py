"""What a key declares on its field, and the walk that gathers it (toolkit.config.declarations)."""

from __future__ import annotations

import dataclasses
from typing import Literal

import pytest

from toolkit.config.declarations import (
    ALWAYS,
    SCHEDULE,
    CheckedBy,
    Need,
    Resume,
    declarations,
    declared,
    free,
    refused,
    undeclared,
)
from toolkit.config.load import field


@dataclasses.dataclass
class Item:
    path: str | None = field(None, help="a file", path="read", used_when=ALWAYS)
    weight: float = field(1.0, help="its share", used_when=ALWAYS)


@dataclasses.dataclass
class Hurried:
    size: int = field(1, help="an entry's key added in a hurry")


@dataclasses.dataclass
class Inner:
    mode: Literal["a", "b"] = field("a", help="which", resume=refused("it decides the tokens"), used_when=ALWAYS)
    size: int = field(2, help="how many", resume=SCHEDULE, used_when=Need("inner.mode", ("b",), "b's"),
                      accepts={"0": "none"})


@dataclasses.dataclass
class Outer:
    name: str = field("x", help="what", resume=free("a label"), used_when=ALWAYS, path=None)
    tags: list[str] = field(default_factory=list, help="labels", resume=free("labels"),
                            used_when=CheckedBy("Outer.validate"), path=None, unique=True)
    items: list[Item] = field(default_factory=list, help="files", resume=refused("the data"), used_when=ALWAYS,
                              unique=False)
    inner: Inner = field(default_factory=Inner, help="a section")


def test_each_key_is_found_by_its_dotted_name_with_what_its_field_declares():
    keys = declarations(Outer)
    assert list(keys) == ["name", "tags", "items", "items[].path", "items[].weight", "inner.mode", "inner.size"]
    assert declared(Outer, "path") == {"name": None, "tags": None, "items[].path": "read"}
    assert declared(Outer, "resume")["inner.size"] == SCHEDULE and declared(Outer, "unique") == {"tags": True,
                                                                                                 "items": False}
    assert declared(Outer, "accepts") == {"inner.size": {"0": "none"}}
    assert undeclared(Outer) == []


def test_a_field_added_without_its_declarations_is_named_once_for_each_it_leaves_out():
    @dataclasses.dataclass
    class Newer(Outer):
        colour: str | None = field(None, help="a key added in a hurry")
        sizes: list[int] = field(default_factory=list, help="another", resume=free("labels"), used_when=ALWAYS)
        entries: list[Hurried] = field(default_factory=list, help="a list of sections", resume=free("labels"),
                                       used_when=ALWAYS, unique=False)

    assert undeclared(Newer) == [
        "colour declares no resume=: say it on its field (toolkit.config.declarations)",
        "colour declares no used_when=: say it on its field (toolkit.config.declarations)",
        "colour declares no path=: say it on its field (toolkit.config.declarations)",
        "sizes declares no unique=: say it on its field (toolkit.config.declarations)",
        # a key of a list's entries: when it has an effect, each entry's alike (issue 63: a source's text_column)
        "entries[].size declares no used_when=: say it on its field (toolkit.config.declarations)",
    ]
    assert "colour" not in declared(Newer, "resume")  # so a table walked over every key misses it too


def test_a_declaration_the_key_cannot_take_or_of_no_known_kind_is_named():
    @dataclasses.dataclass
    class Wrong:
        count: int = field(1, help="n", resume=Resume("maybe"), used_when="sometimes", unique=True, path="read")

    assert undeclared(Wrong) == [
        "count declares path=, which a key of type int does not take: drop it",
        "count declares unique=, which a key of type int does not take: drop it",
        "count declares resume=Resume(kind='maybe', why=''), not a Resume of refused, free, own check, schedule, from "
        "the next step, kept by the optimizer",
        "count declares used_when='sometimes', not ALWAYS, a Need, a CheckedBy or a callable(cfg)",
    ]


def test_an_override_of_a_field_keeps_what_it_does_not_say():
    @dataclasses.dataclass
    class Elsewhere(Outer):
        name: str = field("y", help="what, elsewhere")

    assert declarations(Elsewhere)["name"] == declarations(Outer)["name"] and undeclared(Elsewhere) == []


def test_trees_that_declare_a_key_they_share_differently_are_refused():
    @dataclasses.dataclass
    class Other:
        name: str = field("x", help="what", resume=refused("it decides the tokens"), used_when=ALWAYS, path=None)

    assert declared((Outer, Outer), "resume")["name"] == free("a label")
    with pytest.raises(TypeError, match="name declares resume as .* and as .*: declare it alike"):
        declared((Outer, Other), "resume")


def test_a_section_declares_nothing_of_its_own():
    @dataclasses.dataclass
    class Loose:
        inner: Inner = field(default_factory=Inner, help="a section", resume=free("?"))

    with pytest.raises(TypeError, match="the section inner declares resume: a section has no value of its own; declare them on its keys' fields"):
        declarations(Loose)
