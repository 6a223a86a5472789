"""How many bytes of model state this rank really holds, measured from the live tensors.

    meter = GradientMeter(accelerator, model, optimizer)
    with meter: ...                  # around one whole optimizer step (all its micro-batches)
    held = held_bytes(accelerator, model, optimizer, meter)  # after it: params, master, optimizer, grads, grads_peak

Tensors are counted once (the union of the address ranges they cover); communication buffers not at all.
What each part holds under each strategy, and why: docs/internals.md, toolkit/strategy/sharding.py.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType


def held_bytes(
    accelerator: Accelerator, model: torch.nn.Module, optimizer: Any, meter: GradientMeter | None = None
) -> dict[str, int]:
    """This rank's bytes of params, grads, grads_peak, optimizer state and master weights.

    `model` and `optimizer` are what `accelerator.prepare` returned. Call it after an optimizer
    step (Adam's state is created by the first one). Gradients come from `meter`, which must
    have been around that step; without one they are measured now (right only between the
    last backward and the step of DDP/FSDP2).
    """
    params = _param_tensors(model)
    base = _optimizer_chain(optimizer)[-1]
    masters = _master_tensors(optimizer)
    state = [v for s in base.state.values() for v in _tensors(s)]
    p = _nbytes(params)
    pm = _nbytes(params, masters)
    if meter is None:
        grads = peak = _grad_bytes(accelerator, model, optimizer)
    elif meter.boundary is None:
        raise RuntimeError("GradientMeter saw no optimizer step; use it around a whole optimizer step")
    else:
        grads, peak = meter.boundary, meter.peak
    return {
        "params": p,
        "grads": grads,
        "grads_peak": max(peak, grads),
        "optimizer": _nbytes(params, masters, state) - pm,
        "master": pm - p,
    }


class GradientMeter:
    """Records gradient bytes after each backward and just before the optimizer step.

    A context manager to put around one optimizer step. While open it wraps
    `accelerator.backward` (and, under DeepSpeed, `engine.step`) on these instances only; both
    are restored on exit. `boundary` and `peak` hold the results (bytes; None before a step).
    """

    def __init__(self, accelerator: Accelerator, model: torch.nn.Module, optimizer: Any):
        self.accelerator, self.model, self.optimizer = accelerator, model, optimizer
        self.boundary: int | None = None
        self.peak = 0
        self._patched: list[tuple[object, str, bool, Any]] = []

    def measure(self, at_boundary: bool) -> None:
        held = _grad_bytes(self.accelerator, self.model, self.optimizer)
        self.peak = max(self.peak, held)
        if at_boundary:
            self.boundary = held

    def __enter__(self) -> GradientMeter:
        acc = self.accelerator
        deepspeed = acc.distributed_type == DistributedType.DEEPSPEED
        backward = acc.backward

        def measured_backward(loss, **kwargs):
            sync = acc.sync_gradients
            backward(loss, **kwargs)
            if not (deepspeed and sync):  # DeepSpeed has stepped already: measured in engine.step
                self.measure(at_boundary=sync)

        self._patch(acc, "backward", measured_backward)
        if deepspeed:
            engine = acc.deepspeed_engine_wrapped.engine
            step = engine.step

            def measured_step(*args, **kwargs):
                self.measure(at_boundary=True)
                return step(*args, **kwargs)

            self._patch(engine, "step", measured_step)
        return self

    def __exit__(self, *exc) -> None:
        for obj, name, had, old in reversed(self._patched):
            if had:
                setattr(obj, name, old)
            else:
                delattr(obj, name)
        self._patched.clear()

    def _patch(self, obj: object, name: str, fn: Any) -> None:
        had = name in vars(obj)
        self._patched.append((obj, name, had, vars(obj).get(name)))
        setattr(obj, name, fn)


# ----------------------------------------------------------------------------- internals
def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # DTensor -> this rank's shard


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in nested lists/tuples/dicts (values), as local tensors."""
    if isinstance(obj, torch.Tensor):
        yield _local(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _nbytes(*groups: Iterable[torch.Tensor]) -> int:
    """Bytes covered by the union of the tensors' memory ranges (each counted once)."""
    ranges: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for group in groups:
        for t in _tensors(list(group)):
            if t.numel() == 0 or t.device.type == "meta":
                continue
            span = 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride(), strict=True))
            start = t.data_ptr()
            ranges[str(t.device)].append((start, start + span * t.element_size()))
    total = 0
    for spans in ranges.values():
        end = -1
        for lo, hi in sorted(spans):
            if hi > end:
                total += hi - max(lo, end)
                end = hi
    return total


def _param_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    out = []
    for p in model.parameters():
        out.append(_local(p))
        if getattr(p, "ds_tensor", None) is not None:  # ZeRO-3 partition; p itself is empty unless persisted
            out.append(p.ds_tensor)
    return out


def _optimizer_chain(optimizer: Any) -> list[Any]:
    """[AcceleratedOptimizer, (ZeRO optimizer,) torch optimizer]: each wraps the next as `.optimizer`."""
    chain = [optimizer]
    while getattr(chain[-1], "optimizer", None) is not None:
        chain.append(chain[-1].optimizer)
    return chain


# Attributes of DeepSpeed's ZeRO optimizers that hold the fp32 master weights (ZeRO-3 hands them
# to the torch optimizer only inside its step; its param_groups are empty otherwise).
ZERO_MASTER_ATTRS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")


def _master_tensors(optimizer: Any) -> list[torch.Tensor]:
    """Whatever the optimizer updates: the base optimizer's params plus ZeRO's fp32 partitions."""
    chain = _optimizer_chain(optimizer)
    out = [_local(p) for group in chain[-1].param_groups for p in group["params"]]
    for opt in chain[1:-1]:
        for name in ZERO_MASTER_ATTRS:
            out += list(_tensors(getattr(opt, name, None)))
    return out


# Attributes of DeepSpeed's ZeRO optimizers that hold gradients (stage_1_and_2.py, stage3.py).
ZERO_GRAD_ATTRS = (
    "averaged_gradients",
    "all_grad_tensors",
    "grad_partitions_flat_buffer",
    "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition",
    "accumulated_grads_in_cpu",
)


def _grad_bytes(accelerator: Accelerator, model: torch.nn.Module, optimizer: Any) -> int:
    params = _param_tensors(model)
    grads = []
    for p in model.parameters():
        grads += [g for g in (p.grad, getattr(p, "grad_accum", None)) if g is not None]
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        for opt in _optimizer_chain(optimizer)[1:-1]:  # the ZeRO optimizer
            for name in ZERO_GRAD_ATTRS:
                grads += list(_tensors(getattr(opt, name, None)))
        grads += [m.grad for m in _master_tensors(optimizer) if m.grad is not None]
    if accelerator.distributed_type == DistributedType.FSDP:
        grads += _fsdp2_unsharded_grads(model)
    return _nbytes(params, grads) - _nbytes(params)


def _fsdp2_unsharded_grads(model: torch.nn.Module) -> list[torch.Tensor]:
    """Unsharded gradients FSDP2 keeps while gradient sync is off (accumulation micro-batches)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return []
    out = []
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = getattr(module._get_fsdp_state(), "_fsdp_param_group", None)
        for fsdp_param in getattr(group, "fsdp_params", None) or []:
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            for g in (getattr(unsharded, "grad", None), getattr(fsdp_param, "unsharded_accumulated_grad", None)):
                if g is not None:
                    out.append(_local(g))
    return out
