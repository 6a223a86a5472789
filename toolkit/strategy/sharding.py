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
from torch.distributed.tensor import DTensor

from toolkit.strategy.families import family_of
from toolkit.strategy.family import Family
from toolkit.strategy.parallelism import parallel_layout


def held_bytes(
    accelerator: Accelerator, model: torch.nn.Module, optimizer: Any, meter: GradientMeter | None = None
) -> dict[str, int]:
    """This rank's bytes of params, grads, grads_peak, optimizer state and master weights.

    `model` and `optimizer` are what `accelerator.prepare` returned. Call it after an optimizer
    step (Adam's state is created by the first one). Gradients come from `meter`, which must
    have been around that step; without one they are measured now (right only between the
    last backward and the step of DDP/FSDP2).
    """
    params = _param_tensors(model, _family(accelerator))
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
        engine = _family(acc).steps_in_backward(acc)
        backward = acc.backward

        def measured_backward(loss, **kwargs):
            sync = acc.sync_gradients
            backward(loss, **kwargs)
            if not (engine is not None and sync):  # the engine has stepped already: measured in its step
                self.measure(at_boundary=sync)

        self._patch(acc, "backward", measured_backward)
        if engine is not None:
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
def _family(accelerator: Accelerator) -> Family:
    """The family whose tensors are counted (a pipeline's stages hold DDP's)."""
    return family_of(parallel_layout(accelerator.distributed_type, {}))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t  # this rank's shard (FSDP2, tensor parallel)


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


def _param_tensors(model: torch.nn.Module, family: Family) -> list[torch.Tensor]:
    return [t for p in model.parameters() for t in (_local(p), *family.partitions(p))]


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


def _grad_bytes(accelerator: Accelerator, model: torch.nn.Module, optimizer: Any) -> int:
    family = _family(accelerator)
    params = _param_tensors(model, family)
    grads = []
    for p in model.parameters():
        grads += [g for g in (p.grad, getattr(p, "grad_accum", None)) if g is not None]
    grads += list(_tensors(family.held_gradients(model, _optimizer_chain(optimizer)[1:-1], _master_tensors(optimizer))))
    return _nbytes(params, grads) - _nbytes(params)
