"""Activation (gradient) checkpointing: recompute layer activations in the backward pass.

Always non-reentrant: the reentrant variant breaks with ZeRO-3 and FSDP, which gather parameters in hooks that
it bypasses. "selective" keeps the outputs of matmuls, attention kernels and collectives and recomputes only
what lies between them; it wraps each layer's own `forward`, so that a compiled layer saves what it keeps.
Why, and what was measured: docs/internals.md, toolkit/models/gradient_checkpointing.py.
"""

from __future__ import annotations

import functools
import logging
import types

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from toolkit.config.errors import UserError
from toolkit.models.compilation import decoder_layers

MODES = ("none", "full", "every_k", "selective")


def _kept_operators() -> frozenset:
    aten, ops = torch.ops.aten, []
    names = ["mm", "addmm", "bmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu", "_grouped_mm"]
    ops += [getattr(aten, name).default for name in names if hasattr(aten, name)]
    for name in ("flex_attention",):  # a higher-order operator, kept whole
        if hasattr(torch.ops.higher_order, name):
            ops.append(getattr(torch.ops.higher_order, name))
    c10d = torch.ops._c10d_functional  # recomputing a collective would communicate again
    ops += [getattr(c10d, name).default for name in ("reduce_scatter_tensor", "all_gather_into_tensor", "all_to_all_single", "all_reduce")
            if hasattr(c10d, name)]
    return frozenset(ops)


KEPT = _kept_operators()
# Under torch.compile torch warns once that a region checkpointed with a policy must hold no in-place operator;
# test_compilation.py checks compiled selective layers against eager ones, the gradients included.
logging.getLogger("torch._higher_order_ops.wrap").addFilter(
    lambda record: "context_fn is passed to torch.utils.checkpoint under torch.compile" not in str(record.msg))


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    # flash-attn registers its kernels (flash_attn::_flash_attn_forward, ...) when imported, after this module
    kept = op in KEPT or getattr(op, "namespace", None) == "flash_attn"
    return CheckpointPolicy.MUST_SAVE if kept else CheckpointPolicy.PREFER_RECOMPUTE


_SELECTIVE = functools.partial(create_selective_checkpoint_contexts, _policy)


def _selective_forward(self, *args, **kwargs):
    forward = functools.partial(type(self).forward, self)
    if self.training and torch.is_grad_enabled():
        return checkpoint(forward, *args, use_reentrant=False, context_fn=_SELECTIVE, **kwargs)
    return forward(*args, **kwargs)


def apply_gradient_checkpointing(model: torch.nn.Module, mode: str, every_k: int = 2) -> None:
    """`mode`: "none", "full" (every decoder layer), "every_k" (every k-th layer) or "selective" (where it does not
    run, the launch refused it: toolkit.config.combinations)."""
    if mode == "none":
        return
    if mode not in MODES:
        raise ValueError(f"gradient checkpointing mode {mode!r}: use {', '.join(MODES)}")
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(model).__name__} does not support gradient checkpointing; set it to none")
    if mode == "selective":
        layers = decoder_layers(model)
        if not layers:
            raise UserError(f"model.gradient_checkpointing=selective: {type(model).__name__} names no decoder layer "
                            "class (transformers' _no_split_modules) to checkpoint per operator; "
                            "set model.gradient_checkpointing=full")
        for layer in layers:
            layer.forward = types.MethodType(_selective_forward, layer)  # a bound method: deepcopy rebinds it
        return
    every = every_k if mode == "every_k" else 1
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, every_n_layers=every)
    else:  # transformers < 5 names it differently and has no every_n_layers
        if every != 1:
            raise ValueError("every_k gradient checkpointing needs transformers >= 5")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
