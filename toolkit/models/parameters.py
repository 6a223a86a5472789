"""The names a model's parameters go by: a tied embedding and output head are one parameter with two."""

from __future__ import annotations

import torch


def parameter_names(module: torch.nn.Module) -> dict[int, list[str]]:
    """id(parameter) -> every name it goes by, in the module's order."""
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return names


# wrappers that torch.distributed.checkpoint leaves out of a parameter's name (torch.compile,
# activation checkpointing, FSDP1): the names are compared without them
_WRAPPERS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def plain_name(name: str) -> str:
    """A parameter's name without the wrappers torch.distributed.checkpoint leaves out of it."""
    for wrapper in _WRAPPERS:
        name = name.replace(wrapper, "")
    return name
