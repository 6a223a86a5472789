"""The strategy families behind one Protocol (toolkit.strategy.backends): the table names a backend for every
family a launch can be, and each answers every question of the Protocol."""

from __future__ import annotations

import inspect

import pytest

from toolkit.checkpoint.formats import FORMATS
from toolkit.parallel_layout import ParallelLayout
from toolkit.strategy.backends.base import Backend, DataParallel
from toolkit.strategy.distributed import BACKENDS, family

LAYOUTS = {
    "single": ParallelLayout("single", 1), "ddp": ParallelLayout("ddp", 4), "fsdp": ParallelLayout("fsdp", 4),
    "deepspeed": ParallelLayout("deepspeed", 4, zero_stage=3), "pipeline": ParallelLayout("ddp", 4, pp=2),
}


def test_every_family_has_a_backend_that_answers_the_whole_protocol():
    asked = {name for name, _ in inspect.getmembers(Backend, inspect.isfunction)}
    assert asked  # the Protocol's questions
    assert set(BACKENDS) == set(LAYOUTS)
    for name, layout in LAYOUTS.items():
        backend = BACKENDS[family(layout)]
        assert backend.name == name and backend.format in FORMATS
        assert all(callable(getattr(backend, question)) for question in asked)


@pytest.mark.parametrize("name", LAYOUTS)
def test_the_replicated_families_are_those_whose_ranks_hold_the_whole_model(name):
    layout = LAYOUTS[name]
    assert BACKENDS[name].replicated(layout) == (name in ("single", "ddp"))
    assert BACKENDS["deepspeed"].replicated(ParallelLayout("deepspeed", 4, zero_stage=2))  # ZeRO-1/2: whole params


def test_a_checkpoint_resumes_natively_only_where_its_files_fit():
    fits = {
        ("ddp", ParallelLayout("ddp", 2)): True,  # DDP's files: any world size
        ("ddp", ParallelLayout("fsdp", 4)): False,
        ("fsdp", ParallelLayout("fsdp", 2)): True,  # DCP reshards
        ("fsdp", ParallelLayout("fsdp", 2, fsdp_version=1)): False,
        ("deepspeed", ParallelLayout("deepspeed", 2, zero_stage=3)): False,  # ZeRO: the same world only
        ("deepspeed", ParallelLayout("deepspeed", 4, zero_stage=3)): True,
        ("deepspeed", ParallelLayout("deepspeed", 4, zero_stage=2)): False,
        ("pipeline", ParallelLayout("ddp", 2, pp=2)): True,  # the same cut, any replicas
        ("pipeline", ParallelLayout("ddp", 4, pp=4)): False,
    }
    for (name, saved), expected in fits.items():
        assert BACKENDS[name].resumes_natively(LAYOUTS[name], saved) == expected, (name, saved)


def test_the_defaults_are_the_data_parallel_ones():
    assert isinstance(BACKENDS["fsdp"], DataParallel) and BACKENDS["fsdp"].optimizer_names(None) is None
