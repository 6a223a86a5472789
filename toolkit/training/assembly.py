"""A model assembled for training, in one order a reader sees at once (`assemble`): fp8's layers, recomputation, the
adapter, compilation, then the strategy's model parallelism and its wrap (Trainer.prepare). Why the split comes after
the compile (the tensor-parallel split shards too): docs/architecture.md, "One assembly"."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from toolkit.models import float8
from toolkit.models.adapter import AdapterConfig, apply_adapter
from toolkit.models.compilation import compile_model
from toolkit.models.gradient_checkpointing import apply_gradient_checkpointing
from toolkit.models.loss import loss_on_targets
from toolkit.training.metrics import model_size


@dataclass(frozen=True)
class Assembled:
    """What a recipe goes on with: the counts its log and model card say, whether the run resumed, whether it has
    held-out data, and whether its objective compares with the model before training (DPO's reference)."""

    n_params: int  # of the whole model, before an adapter (its frozen base counted)
    flops_token: float
    resumed: bool
    held_out: bool
    needs_reference: bool


def assemble(trainer, model: torch.nn.Module, tokenizer, adapter: AdapterConfig | None = None,
             model_files: dict[str, dict] | None = None) -> Assembled:
    """`model`, built whole on every rank, made the run's: each step in its order, then prepared by the trainer's
    strategy (toolkit.training.trainer.Trainer.prepare: model parallel, optimizer, wrap, resume)."""
    cfg, strategy = trainer.cfg, trainer.strategy
    if cfg.train.mixed_precision == "fp8":  # first: the adapter and the compile see the Float8Linear layers
        trainer.print(float8.convert(model, cfg.train.fp8_recipe, cfg.train.fp8_layers,
                                     fsdp2=strategy.family.gathers_float8(strategy.layout)).said())
    apply_gradient_checkpointing(model, cfg.model.gradient_checkpointing, cfg.model.gradient_checkpointing_k)
    n_params, flops_token = model_size(model, cfg.data.seq_len)
    trainer.print(f"model: {model.config.model_type}, {n_params:,} parameters, gradient checkpointing "
                  f"{cfg.model.gradient_checkpointing}")
    if adapter is not None:  # seeded, so that every rank starts from the same adapter
        torch.manual_seed(cfg.seed)
        model, note = apply_adapter(model, adapter)
        trainer.print(note)
    compile_model(model, cfg.model.compile)  # after the adapter, so that what is compiled holds its modules
    if cfg.model.loss_positions == "targets":
        loss_on_targets(model)
    trainer.prepare(model, tokenizer, n_params, flops_token, model_files)
    objective = trainer.objective
    return Assembled(n_params, flops_token, trainer.resumed, trainer.feed.val is not None,
                     objective is not None and objective.needs_reference)
