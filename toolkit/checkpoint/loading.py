"""A converted checkpoint (toolkit.checkpoint.by_name) into a prepared model and optimizer, on
every rank after `prepare`, with each strategy's own setters:

- DDP / one process: load_state_dict on the model; the optimizer's state dict built by name.
- FSDP2: torch.distributed.checkpoint.state_dict.set_model_state_dict / set_optimizer_state_dict
  with full_state_dict=True (each rank keeps its shard).
- DeepSpeed ZeRO-1/2/3: deepspeed.utils.safe_set_full_fp32_param / safe_set_full_optimizer_state
  (ZeRO-3: their local forms, see _set_master) into the fp32 masters and their Adam state, which
  DeepSpeed creates only at the first step, so it is created first, holding the step; then the
  module's own copy (16-bit in mixed precision, a partition under ZeRO-3) from the same values, as
  a step leaves it, and the engine's step counters.

Every parameter this run trains must find its Adam state there, or its moments would restart
silently: that, and a weight the state lacks, is refused in one line.
"""

from __future__ import annotations

import torch

from toolkit.checkpoint.by_name import MOMENTS, ConsolidatedState, plain_name
from toolkit.config import UserError
from toolkit.models.parameters import parameter_names


def _check_moments(state: ConsolidatedState, module: torch.nn.Module, names: dict[int, list[str]]) -> None:
    """Every parameter this run trains must find its Adam state, or the moments would silently restart."""
    missing = [names[id(p)][0] for p in module.parameters()
               if p.requires_grad and all(state.moments(n) is None for n in names[id(p)])]
    if missing and state.trained:
        raise UserError(
            f"the converted checkpoint {state.folder} has no Adam state for {missing[0]} (and {len(missing) - 1} more), "
            "which this run trains: it was saved with other trainable parameters (another adapter?)"
        )


def load_into_ddp(module: torch.nn.Module, optimizer: torch.optim.Optimizer, state: ConsolidatedState) -> None:
    """DDP or one process: the whole model and the optimizer state dict, on every rank."""
    names = parameter_names(module)
    _check_moments(state, module, names)
    _load_by_name(list(module.parameters()), names, optimizer, state)


def _load_by_name(params: list[torch.nn.Parameter], names: dict[int, list[str]], optimizer: torch.optim.Optimizer,
                  state: ConsolidatedState) -> None:
    """Whole weights in place, and the optimizer's state dict built by name (a parameter's Adam state
    under whichever of its names the saving strategy used)."""
    with torch.no_grad():
        for param in params:
            param.copy_(state.weight(names[id(param)]))
    current = optimizer.state_dict()
    adam, index = {}, 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            name = next((n for n in names[id(param)] if state.moments(n) is not None), None)
            if name is not None:
                adam[index] = {"step": torch.tensor(state.step(name), dtype=torch.float32), **state.moments(name)}
            index += 1
    optimizer.load_state_dict({"state": adam, "param_groups": current["param_groups"]})


def load_into_fsdp(module: torch.nn.Module, optimizer: torch.optim.Optimizer, state: ConsolidatedState) -> None:
    """FSDP2: full tensors in, each rank keeps its shard (torch.distributed.checkpoint's setters)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    names = parameter_names(module)
    _check_moments(state, module, names)
    weights = {}
    for param in module.parameters():
        value = state.weight(names[id(param)])
        weights.update({plain_name(name): value for name in names[id(param)]})
    set_model_state_dict(module, weights, options=StateDictOptions(full_state_dict=True, strict=False))
    adam, groups = {}, []
    for group in optimizer.param_groups:
        group_names = [plain_name(names[id(p)][0]) for p in group["params"]]
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": group_names})
        for name in group_names:
            found = state.moments(name)
            if found is not None:
                adam[name] = {"step": torch.tensor(state.step(name), dtype=torch.float32), **found}
    set_optimizer_state_dict(module, optimizer, {"state": adam, "param_groups": groups},
                             options=StateDictOptions(full_state_dict=True))


def load_into_deepspeed(engine, state: ConsolidatedState) -> None:
    """DeepSpeed ZeRO-1/2/3: fp32 masters and their Adam state through DeepSpeed's setters, and the
    module's copy from the same values; the engine's step counters where the checkpoint left them."""
    import deepspeed

    module = engine.module
    names = parameter_names(module)
    _check_moments(state, module, names)
    steps = [state.step(names[id(p)][0]) for p in module.parameters() if state.moments(names[id(p)][0]) is not None]
    _create_adam_state(engine.optimizer, max(steps, default=0.0))
    for param in module.parameters():
        name = names[id(param)][0]
        value = state.weight(names[id(param)])
        found = state.moments(name) if param.requires_grad else None
        if found is not None:
            _set_master(param, value)
            for key in MOMENTS:
                _set_master(param, found[key], key)
        # the module's own copy: whole under ZeRO-1/2 (16-bit in mixed precision), a partition under
        # ZeRO-3, rebuilt from rank 0's values on leaving the context
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0, enabled=hasattr(param, "ds_id")):
            with torch.no_grad():
                param.data.copy_(value.to(param.dtype).view_as(param.data))
    step = int(max(steps, default=0.0))
    engine.global_steps = step
    engine.global_samples = step * engine.train_batch_size()
    engine.micro_steps = step * engine.gradient_accumulation_steps()


def _set_master(param, value: torch.Tensor, key: str | None = None) -> None:
    """This rank's part of a parameter's fp32 master (`key` None) or of its Adam state `key`.

    ZeRO-3 through the local setter, with this rank's slice: DeepSpeed 0.19.8's full setter
    (safe_set_full_fp32_param / safe_set_full_optimizer_state) reads past the end of a parameter
    whose size the world size does not divide, where the last rank's partition is padded (measured:
    a 512 x 64 embedding on 3 ranks). The slice is padded with zeros as DeepSpeed pads it."""
    from deepspeed import comm
    from deepspeed.utils import (
        safe_set_full_fp32_param,
        safe_set_full_optimizer_state,
        safe_set_local_fp32_param,
        safe_set_local_optimizer_state,
    )

    if not hasattr(param, "ds_id"):  # ZeRO-1/2
        if key is None:
            safe_set_full_fp32_param(param, value)
        else:
            safe_set_full_optimizer_state(param, value, key)
        return
    size = param.ds_tensor.numel()
    start = comm.get_rank(group=param.ds_process_group) * size
    piece = value.flatten()[start:start + size]
    local = torch.zeros(size, dtype=torch.float32)
    local[:piece.numel()] = piece
    if key is None:
        safe_set_local_fp32_param(param, local)
    else:
        safe_set_local_optimizer_state(param, local, key)


def _create_adam_state(zero, step: float) -> None:
    """DeepSpeed's ZeRO optimizers create the torch optimizer's state on their first step, and only
    then link each parameter to its slice of it: made here, zero-filled, holding the step."""
    inner = zero.optimizer
    flats = getattr(zero, "fp32_partitioned_groups_flat", None)  # ZeRO-3: outside step, its groups are empty
    if flats is None:
        flats = [p for group in inner.param_groups for p in group["params"]]
    cpu_adam = type(inner).__name__ == "DeepSpeedCPUAdam"  # counts its step in a plain int
    for flat in flats:
        inner.state[flat] = {
            "step": int(step) if cpu_adam else torch.tensor(step, dtype=torch.float32),
            "exp_avg": torch.zeros_like(flat),
            "exp_avg_sq": torch.zeros_like(flat),
        }
    link = getattr(zero, "_lazy_init_hp_params_optimizer_state", None)  # ZeRO-1/2: fragments of that state
    if link is not None:
        link()


def load_into_pipeline(pipeline, optimizer: torch.optim.Optimizer, state: ConsolidatedState) -> None:
    """A pipeline stage (toolkit.strategy.pipeline_parallel): its weights and their Adam state, found
    by their names in the whole model (a tied head's copy by the embedding's name where the saving
    strategy kept only that one)."""
    names = {id(p): pipeline.aliases.get(n, [n]) for n, p in pipeline.named_parameters()}
    _check_moments(state, pipeline.module, names)
    _load_by_name(list(pipeline.parameters()), names, optimizer, state)
