"""The three Protocols of a family (toolkit.strategy.family), split by who asks, and the defaults DataParallel holds."""

from __future__ import annotations

import inspect

from toolkit.strategy.families import FAMILIES, FILES
from toolkit.strategy.family import DataParallel, Family, Files, Plan, Runtime

from .test_families import LAYOUTS


def test_every_family_answers_each_protocol_and_its_files_are_a_family_s():
    asked = {protocol: {name for name, _ in inspect.getmembers(protocol, inspect.isfunction)}
             for protocol in (Runtime, Files, Plan)}
    assert all(asked.values())
    assert set().union(*asked.values()) == {name for name, _ in inspect.getmembers(Family, inspect.isfunction)}
    assert set(FAMILIES) == set(LAYOUTS)
    for name, layout in LAYOUTS.items():
        family = FAMILIES[layout.family]
        assert family.name == name and family.files in FILES.values()
        assert all(callable(getattr(family, question)) for questions in asked.values() for question in questions)
    assert FAMILIES["single"].files is FAMILIES["ddp"].files


def test_the_defaults_are_the_data_parallel_ones():
    assert isinstance(FAMILIES["fsdp"], DataParallel) and FAMILIES["fsdp"].optimizer_names(None) is None
