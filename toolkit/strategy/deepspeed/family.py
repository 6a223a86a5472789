"""DeepSpeed ZeRO-0/1/2/3: the engine holds the fp32 masters and Adam state, partitioned from stage 1 on, the
16-bit parameters from stage 3 on; its optimizer may be offloaded to the CPU."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from pathlib import Path

import torch
from accelerate.utils import InitProcessGroupKwargs

from toolkit.config.errors import UserError
from toolkit.config.files import read_json
from toolkit.launch.environment import has_gpu
from toolkit.parallel_layout import ParallelLayout
from toolkit.strategy.deepspeed import files
from toolkit.strategy.deepspeed.engine import engine_backward, engine_of, engine_step_unless_nonfinite
from toolkit.strategy.deepspeed.launch import (
    check_deepspeed_config,
    configure_deepspeed,
    count_cpu_devices_once,
)
from toolkit.strategy.family import DataParallel, PlannedBuffers, Strategy, any_nonfinite

# Attributes of DeepSpeed's ZeRO optimizers that hold gradients (stage_1_and_2.py, stage3.py).
ZERO_GRAD_ATTRS = (
    "averaged_gradients",
    "all_grad_tensors",
    "grad_partitions_flat_buffer",
    "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition",
    "accumulated_grads_in_cpu",
)


def offloaded(zero: dict) -> tuple[str, ...]:
    """What a zero_optimization section offloads ("optimizer", "param") to DeepSpeed's offload devices."""
    return tuple(key.split("_")[1] for key in ("offload_optimizer", "offload_param")
                 if (zero.get(key) or {}).get("device", "none") in ("cpu", "nvme"))


class DeepSpeed(DataParallel):
    name = "deepspeed"
    files = files
    host_decides = "DeepSpeed's optimizer steps on the host's decision"

    def check_launch(self) -> None:
        check_deepspeed_config()

    def accelerator_kwargs(self, multi: bool, timeout) -> dict:
        """On a CPU machine DeepSpeed's own CPU accelerator over gloo (Accelerate's CPU mode would drop DeepSpeed)."""
        if has_gpu():
            return super().accelerator_kwargs(multi, timeout)
        count_cpu_devices_once()
        return {"kwargs_handlers": [InitProcessGroupKwargs(backend="gloo", timeout=timeout)]}

    def launched_details(self, accelerator) -> dict:
        plugin = accelerator.state.deepspeed_plugin
        return {"zero_stage": int(plugin.zero_stage),
                "offload": offloaded(plugin.deepspeed_config.get("zero_optimization", {}))}

    def configure(self, accelerator, micro_batch: int, max_grad_norm: float) -> list[str]:
        return configure_deepspeed(accelerator, micro_batch, max_grad_norm)

    @contextlib.contextmanager
    def set_aside(self, accelerator):
        """Accelerate registers its DeepSpeed config with transformers even with zero3_init_flag off: under ZeRO-3 a
        model built while it is set is partitioned, and its generate syncs with the other ranks."""
        from transformers.integrations import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
        try:
            yield
        finally:
            accelerator.state.deepspeed_plugin.set_deepspeed_weakref()

    def backward(self, accelerator, loss: torch.Tensor) -> None:
        """accelerator.backward would run engine.step() too, before anything could be checked."""
        engine_backward(engine_of(accelerator), loss, accelerator.sync_gradients)

    def update(self, accelerator, model, optimizer, loss: torch.Tensor, max_grad_norm: float, skip_on_device: bool,
               weight_cast) -> tuple[torch.Tensor | None, str | None]:
        """The engine's step, its update dropped unless every rank's loss and the gradients are finite
        (toolkit.strategy.deepspeed.engine); the engine clears its gradients itself."""
        (loss_bad,) = any_nonfinite(accelerator, loss)
        nonfinite = engine_step_unless_nonfinite(engine_of(accelerator), loss_bad)
        if nonfinite is None:
            # Accelerate's DeepSpeed optimizer does nothing here (the engine stepped), but a schedule built on it
            # learns that the optimizer stepped before it is stepped
            optimizer.step()
        return accelerator.clip_grad_norm_(model.parameters(), max_grad_norm or float("inf")), nonfinite

    def replicated(self, layout: ParallelLayout) -> bool:
        return layout.zero_stage < 3

    def offloads_optimizer(self, strategy: Strategy) -> bool:
        """Optimizer offload on a GPU machine (on a CPU machine there is nothing to offload)."""
        return "optimizer" in strategy.layout.offload and has_gpu()

    def adamw(self, strategy: Strategy) -> Callable[..., torch.optim.Optimizer]:
        """DeepSpeed refuses a torch optimizer for state it offloads to the CPU (it would be slow) and brings its
        own CPU AdamW, the same update."""
        if not self.offloads_optimizer(strategy):
            return torch.optim.AdamW
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return lambda groups, **kw: DeepSpeedCPUAdam(groups, adamw_mode=True, **kw)

    def master_weights(self, strategy: Strategy, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """Collective. DeepSpeed's bf16/fp16 modes turn the parameters into 16-bit copies and keep the fp32 masters
        partitioned in its optimizer (Accelerate's get_state_dict returns the 16-bit copies): each trained
        parameter's master is assembled (`safe_get_full_fp32_param`), and a frozen one (a LoRA's base), which has no
        master, is gathered as it is."""
        import deepspeed
        from deepspeed.utils import safe_get_full_fp32_param

        acc = strategy.accelerator
        module = acc.unwrap_model(model)
        params = dict(module.named_parameters(remove_duplicate=False))  # tied names map to one parameter
        out = {}
        for name, value in module.state_dict().items():  # under ZeRO-3 the values are empty partitions
            param = params.get(name)
            if param is None:  # a buffer: whole on every rank
                full = value
            else:
                full = safe_get_full_fp32_param(param) if param.requires_grad else None
                if full is None:
                    with deepspeed.zero.GatheredParameters([param], enabled=hasattr(param, "ds_id")):
                        full = param.detach().clone()
            if acc.is_main_process:
                out[name] = full.float().cpu() if full.is_floating_point() else full.cpu()
        return out if acc.is_main_process else None

    def resumes_natively(self, layout: ParallelLayout, saved: ParallelLayout) -> bool:
        """ZeRO's partitions fit only the stage and world size that wrote them."""
        return saved.files == layout.files and saved.world in (0, layout.world)

    def optimization_owned(self, strategy: Strategy) -> tuple[str, ...]:
        """A user's DeepSpeed JSON may define its optimizer and scheduler blocks; DeepSpeed then builds them."""
        return strategy.ds_owned

    def conversion_refused(self, strategy: Strategy) -> str | None:
        if owned := self.optimization_owned(strategy):
            return f"this launch's DeepSpeed JSON defines its own {' and '.join(owned)}, whose state the conversion cannot fill"
        return None

    # ------------------------------------------------------------------ what the memory meter counts
    def steps_in_backward(self, accelerator):
        return accelerator.deepspeed_engine_wrapped.engine

    def partitions(self, param: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """ZeRO-3's partition; the parameter itself is empty unless persisted."""
        part = getattr(param, "ds_tensor", None)
        return () if part is None else (part,)

    def held_gradients(self, model, wrappers, masters) -> list:
        """What the ZeRO optimizer holds gradients in, and the fp32 gradient partitions of its masters."""
        return [getattr(zero, name, None) for zero in wrappers for name in ZERO_GRAD_ATTRS] + [
            m.grad for m in masters if m.grad is not None]

    # ------------------------------------------------------------------ the planner's
    foreach_temporaries = False  # the engine steps its own flat partitions

    def config_facts(self, path: Path, cfg: dict, hidden_size: int) -> tuple[dict, dict]:
        """Its DeepSpeed JSON's stage, offload and bucket sizes; "auto" sizes as Accelerate fills them."""
        file = (cfg.get("deepspeed_config") or {}).get("deepspeed_config_file")
        if not file:
            raise UserError(f"{path}: the planner needs a deepspeed_config_file")
        json_path = Path(file) if Path(file).is_absolute() else path.parent.parent / file
        zero = read_json(json_path, "a DeepSpeed config").get("zero_optimization", {})
        if not isinstance(zero, dict):
            raise UserError(f"{json_path}: zero_optimization must be an object ({{\"stage\": 2, ...}}), found {zero!r:.60}")
        h2 = hidden_size * hidden_size

        def size(key: str, auto: float, default: float) -> int:
            """A DeepSpeed size: Accelerate's fill for "auto", DeepSpeed's default when absent."""
            value = zero.get(key, default)
            return int(auto if value == "auto" else value)

        offload = offloaded(zero)  # recorded in the layout as a launch records it (launched_details)
        return {"zero_stage": int(zero.get("stage", 0)), "offload": offload}, {
            "offload_optimizer": "optimizer" in offload, "offload_params": "param" in offload,
            "reduce_bucket": size("reduce_bucket_size", h2, 5e8),
            "prefetch_bucket": size("stage3_prefetch_bucket_size", 0.9 * h2, 5e7),
            "persistence_threshold": size("stage3_param_persistence_threshold", 10 * hidden_size, 1e5),
            "overlap_comm": bool(zero.get("overlap_comm", False)),
        }

    def casts_weights(self, layout: ParallelLayout) -> bool:
        """Its bf16/fp16 mode turns the module's weights to 16 bits."""
        return True

    def offloads_parameters(self, strategy: Strategy) -> bool:
        return "param" in strategy.layout.offload  # as the launch recorded it

    def planned_parameter_bytes(self, run, bytes_per_weight: int) -> int:
        return bytes_per_weight if run.precision == "fp32" else 2  # 16-bit weights, fp32 masters apart

    def planned_state(self, run, tensors, groups, stored, grad_bytes, step_bytes) -> dict[str, int]:
        s, w = run.strategy, run.world
        if s.layout.zero_stage == 0:
            return super().planned_state(run, tensors, groups, stored, grad_bytes, step_bytes)
        if s.layout.zero_stage in (1, 2):
            # stage_1_and_2.py: each group flattened, padded to a multiple of 2 x world, cut in world parts
            parts = [math.ceil(sum(t.numel for t in g) / (2 * w)) * 2 for g in groups]
            part = sum(parts)
            full_grads = sum(t.numel for g in groups for t in g) * grad_bytes
            return {
                "params": int(sum(stored(t) for t in tensors)),
                "grads": part * grad_bytes,  # measured at the boundary: ZeRO-1 has reduced them into its partition too
                "optimizer": 0 if s.offload_optimizer else 8 * part + step_bytes * len(parts),
                "master": 0 if s.offload_optimizer else 4 * part,
                "grads_peak": full_grads if s.layout.zero_stage == 1 else part * grad_bytes,
            }

        # ZeRO-3: every parameter partitioned; the small ones (persistence threshold) also whole. A 4-bit weight is
        # its packed uint8 bytes (2 weights a byte), partitioned like any parameter; its quant state, whole on
        # every rank, is in its partition's share (stored)
        def part3(t) -> int:
            return math.ceil(t.numel / w)

        train = [t for g in groups for t in g]
        persisted = sum(t.numel * 0.5 if t.quantized else stored(t) for t in tensors
                        if (t.numel // 2 if t.quantized else t.numel) <= s.persistence_threshold)
        partitions = sum(stored(t, part3(t)) for t in tensors)
        master = sum(part3(t) for t in train)
        return {
            "params": 0 if s.offload_params else int(partitions + persisted),
            "grads": master * grad_bytes,
            "optimizer": 0 if s.offload_optimizer else 8 * master + step_bytes * len(groups),
            "master": 0 if s.offload_optimizer else 4 * master,
        }

    def planned_buffers(self, run, shapes, tensors, head, stage, grads_held, dtype_bytes) -> PlannedBuffers:
        s, compute_bytes = run.strategy, dtype_bytes[1]
        bucket = s.reduce_bucket * compute_bytes * (2 if s.overlap_comm else 1)
        if s.layout.zero_stage != 3:
            return PlannedBuffers(0, bucket)
        gathered = shapes.layer_params // s.layout.tp * compute_bytes + s.prefetch_bucket * compute_bytes
        return PlannedBuffers(gathered, bucket + gathered)

    def step_gradients(self, held: dict[str, int]) -> int:
        return held["grads"] + held["master"]  # + the fp32 gradient partition


FAMILY = DeepSpeed()
