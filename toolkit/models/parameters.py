"""The names a model's parameters go by: a tied embedding and output head are one parameter with two."""

from __future__ import annotations

import torch


def parameter_names(module: torch.nn.Module) -> dict[int, list[str]]:
    """id(parameter) -> every name it goes by, in the module's order."""
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return names
