"""A format's reader run on a checkpoint an earlier commit saved (tests/fixtures/checkpoints), and its
result compared with what that run's optimizer held when it saved (the fixture's saved.pt)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file
from saved_checkpoints import FIXTURES

from toolkit.checkpoint.formats import saved_by
from toolkit.models.parameters import plain_name
from toolkit.strategy.by_name import MOMENTS
from toolkit.strategy.families import FILES
from toolkit.strategy.unpickling import numbers_only_torch_load


def read_back(kind: str, fixture: str, tmp_path: Path) -> tuple[dict, dict, dict]:
    """(full weights, Adam moments, steps) by parameter name, as format `kind` reads fixture `fixture`'s step-3."""
    folder = shutil.copytree(FIXTURES / fixture / "step-3", tmp_path / "step-3")
    assert saved_by(folder) == kind and [k for k, f in FILES.items() if f.is_mine(folder)][0] == kind
    into, scratch = tmp_path / "weights", tmp_path / "scratch"
    into.mkdir()
    scratch.mkdir()
    with numbers_only_torch_load():  # as the conversion reads them: DeepSpeed's tools pass weights_only=False
        FILES[kind].full_weights(folder, into)
        moments, steps = FILES[kind].moments(folder, scratch)
    weights = {}
    for f in sorted(into.iterdir()):
        if f.suffix == ".safetensors":
            weights.update(load_file(f))
        elif f.suffix == ".bin":
            weights.update(torch.load(f, weights_only=True))
    return {plain_name(k): v for k, v in weights.items()}, moments, steps


def assert_as_saved(kind: str, fixture: str, tmp_path: Path) -> None:
    """Every trained parameter's fp32 master, Adam moments and step, as the saving run's optimizer held them."""
    weights, moments, steps = read_back(kind, fixture, tmp_path)
    saved = torch.load(FIXTURES / fixture / "saved.pt", weights_only=True)
    assert saved["masters"] and sorted(map(plain_name, saved["moments"])) == sorted(moments)
    for name, master in saved["masters"].items():
        if plain_name(name) in weights:
            assert torch.equal(weights[plain_name(name)].float(), master), name
        else:  # a tied head, saved once under the embedding's name
            assert any(torch.equal(w.float(), master) for w in weights.values()), name
    for name, held in saved["moments"].items():
        for key in MOMENTS:
            assert torch.equal(moments[plain_name(name)][key].reshape(held[key].shape), held[key]), (name, key)
        assert steps[plain_name(name)] == saved["steps"][name] == 3.0, name
