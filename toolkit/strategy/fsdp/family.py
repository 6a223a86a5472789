"""FSDP2: each rank holds a shard of every parameter and of its Adam state (torch's fully_shard through Accelerate)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch
from accelerate.utils import DistributedType

from toolkit.config.errors import UserError
from toolkit.launch.environment import has_gpu
from toolkit.models import float8
from toolkit.models.parameters import parameter_names, plain_name
from toolkit.parallel_layout import ParallelLayout
from toolkit.strategy.family import DataParallel, PlannedBuffers, Strategy
from toolkit.strategy.fsdp import files
from toolkit.strategy.fsdp.launch import reduce_gradients_in_fp32, shard_on_cpu


class Fsdp(DataParallel):
    name = "fsdp"
    files = files

    def accelerator_kwargs(self, multi: bool, timeout) -> dict:
        """FSDP2 under a launcher (torchrun's MASTER_ADDR), even of one process: on a GPU Accelerate applies FSDP to
        one process too, and a checkpoint must move between FSDP2 at any world size."""
        return super().accelerator_kwargs(multi or self._on_cpu(multi), timeout)

    def configure_accelerator(self, accelerator, multi: bool) -> None:
        if accelerator.distributed_type == DistributedType.FSDP:
            reduce_gradients_in_fp32(accelerator.state.fsdp_plugin)
        if self._on_cpu(multi):
            shard_on_cpu(accelerator)

    @staticmethod
    def _on_cpu(multi: bool) -> bool:
        return not has_gpu() and (multi or "MASTER_ADDR" in os.environ)

    def launched_details(self, accelerator) -> dict:
        return {"fsdp_version": int(accelerator.state.fsdp_plugin.fsdp_version)}

    def replicated(self, layout: ParallelLayout) -> bool:
        return False

    def check_layers(self, strategy: Strategy, model) -> None:
        """An FSDP config naming a layer class the model does not have would fail deep inside prepare. `model`
        may be a function building it (the pretraining recipe builds a memory-free meta copy)."""
        if not isinstance(model, torch.nn.Module):
            model = model()
        named = strategy.accelerator.state.fsdp_plugin.transformer_cls_names_to_wrap or []
        present = {type(m).__name__ for m in model.modules()}
        missing = [n for n in named if n not in present]
        if missing:
            layers = getattr(model, "_no_split_modules", None) or sorted(present)
            raise UserError(
                f"the FSDP config wraps {', '.join(missing)}, which this {type(model).__name__} does not have; "
                f"its decoder layer class is {', '.join(layers)} (or leave fsdp_transformer_layer_cls_to_wrap out)"
            )

    def qlora_storage(self, precision: str) -> torch.dtype | None:
        """FSDP2 shards a 4-bit base's packed bytes like any weight when they are held in a float dtype (Accelerate
        leaves uint8 ones whole on every rank, "non-floating frozen Params4bit"), and casts every float weight to
        its compute dtype at the all-gather under mixed precision: held in that dtype, the bytes go through
        unchanged. Measured on 2 CPU processes: the same losses as one process, each rank holding half the bytes."""
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)

    def prepare(self, strategy: Strategy, *objects):
        """Accelerate's prepare, with each optimizer's parameters found again by name where its own mapping fails.
        Accelerate swaps them for FSDP2's sharded ones by data_ptr(), which torchao's float8 weight wrapper (the
        float8 all-gather's) answers 0 for every weight: all of them became the last one, stepped once per name
        while the others never moved, and had no Adam state to save. Names are what that mapping stands for."""
        names = _ambiguous_optimizer_names(objects) if strategy.layout.files == "fsdp2" else None
        prepared = super().prepare(strategy, *objects)
        if names is not None:
            model = next(o for o in prepared if isinstance(o, torch.nn.Module))
            sharded = {plain_name(n): p for n, p in model.named_parameters()}
            optimizers = [o for o in prepared if isinstance(o, torch.optim.Optimizer)]
            for optimizer, groups in zip(optimizers, names, strict=True):
                for group, group_names in zip(optimizer.param_groups, groups, strict=True):
                    group["params"] = [sharded[n] for n in group_names]
        return prepared

    def gathers_float8(self, layout: ParallelLayout) -> bool:
        """FSDP2 gathers torchao's float8 weights in float8 (half the bytes of bf16); FSDP1 cannot."""
        return layout.fsdp_version == 2

    def resumes_natively(self, layout: ParallelLayout, saved: ParallelLayout) -> bool:
        """torch.distributed.checkpoint reshards FSDP2's DCP files to any number of processes on load (FSDP1's
        only to the world that wrote them)."""
        return saved.files == layout.files and (layout.files == "fsdp2" or saved.world in (0, layout.world))

    def update(self, accelerator, model, optimizer, loss, max_grad_norm, skip_on_device, weight_cast):
        grad_norm, nonfinite = super().update(accelerator, model, optimizer, loss, max_grad_norm, skip_on_device,
                                              weight_cast)
        float8.precompute_scales(model)  # the float8 gather's scales, of the weights this step left
        return grad_norm, nonfinite


    def held_gradients(self, model, wrappers, masters) -> list:
        """The unsharded gradients FSDP2 keeps while gradient sync is off (accumulation micro-batches)."""
        from torch.distributed.fsdp import FSDPModule

        out = []
        for module in model.modules():
            if not isinstance(module, FSDPModule):
                continue
            group = getattr(module._get_fsdp_state(), "_fsdp_param_group", None)
            for fsdp_param in getattr(group, "fsdp_params", None) or []:
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                out += [g for g in (getattr(unsharded, "grad", None), getattr(fsdp_param, "unsharded_accumulated_grad",
                                                                              None)) if g is not None]
        return out

    # ------------------------------------------------------------------ the planner's
    def config_facts(self, path: Path, cfg: dict, hidden_size: int) -> tuple[dict, dict]:
        fsdp = cfg.get("fsdp_config") or {}
        if str(fsdp.get("fsdp_version", 1)) != "2":
            raise UserError(f"{path}: the planner models FSDP2 (fsdp_version: 2)")
        return {}, {"offload_params": bool(fsdp.get("fsdp_offload_params", False)),
                    "reshard_after_forward": bool(fsdp.get("fsdp_reshard_after_forward", True))}

    def casts_weights(self, layout: ParallelLayout) -> bool:
        """FSDP2's param_dtype (transformers' FSDP2 under tensor parallel keeps the weights' own)."""
        return layout.tp == 1

    def offloads_parameters(self, strategy: Strategy) -> bool:
        offload = getattr(strategy.accelerator.state.fsdp_plugin, "cpu_offload", None)
        return bool(getattr(offload, "offload_params", False))

    def state_on_host(self, facts) -> bool:
        """FSDP's CPU offload keeps the weights, gradients and optimizer state on the host."""
        return facts.offload_params

    def planned_state(self, run, tensors, groups, stored, grad_bytes, step_bytes) -> dict[str, int]:
        # tensor parallel: FSDP2 shards each rank's slice over the data-parallel groups (the 2-D mesh dp x tp);
        # context parallel: over every rank (Accelerate's FSDP2, as fsdp.yaml)
        tp = run.strategy.layout.tp
        dp = run.world // tp

        def shard(t) -> int:  # rank 0 holds the first ceil(dim0 / dp) rows of its slice
            shape = t.tp_slice(tp)
            rows = min(math.ceil(shape[0] / dp), shape[0]) if shape else 1
            return math.prod(shape) // max(1, shape[0]) * rows if shape else 1

        train = [t for g in groups for t in g]
        return {
            "params": int(sum(stored(t, shard(t)) for t in tensors)),
            "grads": sum(shard(t) for t in train) * grad_bytes,
            "optimizer": sum(8 * shard(t) + step_bytes for t in train),
            "master": 0,
        }

    def planned_buffers(self, run, shapes, tensors, head, stage, grads_held, dtype_bytes) -> PlannedBuffers:
        s, tp, compute_bytes = run.strategy, run.strategy.layout.tp, dtype_bytes[1]
        layer = shapes.layer_params // tp  # a rank's slice of a layer under tensor parallel (its norms whole: ~1e-4)
        if tp > 1 and run.world // tp == 1:
            # tensor parallel with one data-parallel group: toolkit.strategy.tensor_parallel wraps only the
            # root in FSDP2 over a mesh of one, which copies every parameter into its unsharded buffer (torch's
            # world-size-1 path) and, being the root, keeps it from the forward to the end of the backward;
            # there all the unsharded gradients are held at once, then copied into the reduce's input
            pb = torch.finfo(run.param_dtype).bits // 8
            local = sum(math.prod(t.tp_slice(tp)) for t in tensors)
            unsharded_grads = sum(math.prod(t.tp_slice(tp)) for t in tensors if t.trainable) * pb
            return PlannedBuffers(local * pb, local * pb, 0, {"grads": grads_held + unsharded_grads, "activations": 0,
                                                              "logits_loss": 0, "buffers": local * pb})
        # FSDP2 gathers in its param_dtype (the compute dtype); transformers' FSDP2 under tensor parallel
        # in the weights' own dtype, and it keeps the output head (and final norm) unsharded from the
        # forward to the backward (its _fsdp_plan: keep_full_weight)
        wb = compute_bytes if tp == 1 else torch.finfo(run.param_dtype).bits // 8
        gathered = (1 if s.reshard_after_forward else shapes.layers) * layer * wb + layer * wb  # this layer + the next
        if tp > 1 and head is not None:
            gathered += math.prod(head.tp_slice(tp)) * wb
        return PlannedBuffers(gathered, gathered + layer * (wb + 4))  # + unsharded gradients, their fp32 reduce input


def _ambiguous_optimizer_names(objects) -> list[list[list[str]]] | None:
    """The name of each optimizer's every parameter, group by group, before FSDP2 replaces them, where two of them
    answer the same data_ptr() (None otherwise, or without a model and an optimizer to prepare)."""
    model = next((o for o in objects if isinstance(o, torch.nn.Module)), None)
    optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
    params = [p for o in optimizers for g in o.param_groups for p in g["params"]]
    if model is None or len({p.data_ptr() for p in params}) == len(params):
        return None
    names = parameter_names(model)
    return [[[plain_name(names[id(p)][0]) for p in g["params"]] for g in o.param_groups] for o in optimizers]


FAMILY = Fsdp()
