"""One place that turns an `accelerate launch` into a correctly configured Accelerator.

Accelerate's quirks on CPU-only machines are handled here, each with the reason:
- Without `cpu=True`, Accelerate on a CPU machine treats a multi-process launch as a single
  process: the model is not wrapped in DDP and ranks silently train apart (measured: losses
  diverge between ranks). So with no GPU we force `cpu=True` and the gloo backend, and the
  same `accelerate_configs/ddp.yaml` runs NCCL on GPUs and gloo on CPU.
- `cpu=True` alone picks MPI when torch was built with it; gloo is named explicitly.
"""

from __future__ import annotations

import hashlib
import os

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, InitProcessGroupKwargs

from toolkit.config import UserError

DATA_PARALLEL = {
    DistributedType.NO: "single process",
    DistributedType.MULTI_CPU: "DDP",
    DistributedType.MULTI_GPU: "DDP",
}


def has_gpu() -> bool:
    return torch.cuda.is_available()


def resolve_mixed_precision(choice: str) -> str:
    if choice != "auto":
        if choice != "no" and not has_gpu():
            raise UserError(
                f"train.mixed_precision={choice} needs a GPU; this machine has none (use auto or no, which train in fp32)"
            )
        return choice
    if has_gpu() and torch.cuda.is_bf16_supported():
        return "bf16"
    return "no"


def build_accelerator(
    mixed_precision: str, accumulation_steps: int, project_dir: str, trackers: list[str] | None = None
) -> Accelerator:
    kwargs = {}
    if not has_gpu():
        kwargs["cpu"] = True
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # single process: no process group at all
            kwargs["kwargs_handlers"] = [InitProcessGroupKwargs(backend="gloo")]
    return Accelerator(
        mixed_precision=resolve_mixed_precision(mixed_precision),
        gradient_accumulation_steps=accumulation_steps,
        log_with=trackers or None,
        project_dir=project_dir,
        **kwargs,
    )


def strategy_name(accelerator: Accelerator) -> str:
    return DATA_PARALLEL.get(accelerator.distributed_type, str(accelerator.distributed_type).split(".")[-1])


def describe(accelerator: Accelerator) -> str:
    """The line every run logs first: what is actually in force, not what was asked for."""
    backend = accelerator.state.backend or "none"
    precision = {"no": "fp32"}.get(str(accelerator.mixed_precision), str(accelerator.mixed_precision))
    return (
        f"strategy={strategy_name(accelerator)} world_size={accelerator.num_processes} backend={backend} "
        f"precision={precision} device={accelerator.device} "
        f"grad_accum={accelerator.gradient_accumulation_steps}"
    )


def parameter_digest(model: torch.nn.Module) -> str:
    """Exact fingerprint of the parameters held by this rank (bit-level)."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        h.update(name.encode())
        h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def check_replicas_in_sync(accelerator: Accelerator, model: torch.nn.Module) -> list[str]:
    """Gather every rank's parameter digest; data-parallel replicas must be bit-identical."""
    from accelerate.utils import gather_object

    digests = gather_object([parameter_digest(accelerator.unwrap_model(model))])
    if accelerator.distributed_type in DATA_PARALLEL and len(set(digests)) > 1:
        raise RuntimeError(
            f"data-parallel ranks ended with different weights ({digests}); gradients were not "
            "synchronised. Report this with the launch command and accelerate config."
        )
    return digests
