"""A pipeline of stages (train.pipeline_stages under DDP's launch): each rank trains its stage, unwrapped, with
its own optimizer; the replicas of a stage average their gradients themselves (toolkit.strategy.pipeline.stages)."""

from __future__ import annotations

import torch

from toolkit.config.errors import UserError
from toolkit.parallel_layout import ParallelLayout
from toolkit.strategy.family import DataParallel, PlannedBuffers, Strategy, parameter_digest
from toolkit.strategy.pipeline import files
from toolkit.strategy.pipeline.stages import Pipeline, problems


class Stages(DataParallel):
    name = "pipeline"
    files = files
    host_decides = "a pipeline's schedule decides on the host"

    def replicated(self, layout: ParallelLayout) -> bool:
        return False

    def cut(self, strategy: Strategy, model: torch.nn.Module, attn_implementation: str) -> torch.nn.Module:
        """This rank's stage of `model`; what cannot be cut refused in one line."""
        found = problems(model, strategy.layout.pp)
        if found:
            raise UserError(found[0])
        strategy.pipeline = Pipeline(model, strategy.layout.pp, strategy.accumulation, attn_implementation,
                                     strategy.device, strategy.accelerator.autocast, strategy.mesh)
        return strategy.pipeline.module

    def described(self, strategy: Strategy) -> str:
        return f" pipeline_stages={strategy.layout.pp} (data_parallel={strategy.data_ranks[0]})"

    def prepare(self, strategy: Strategy, *objects):
        """A stage is not wrapped (DDP would average it with the other stages); its optimizer is kept to save with
        the stage."""
        strategy.pipeline.optimizer = next((o for o in objects if isinstance(o, torch.optim.Optimizer)), None)
        return objects if len(objects) > 1 else objects[0]

    def backward_scale(self, strategy: Strategy, global_targets: int) -> float:
        """The schedule sums its micro-batches' and replicas' gradients as they are."""
        return 1.0 / max(1, global_targets)

    def master_weights(self, strategy: Strategy, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        return strategy.pipeline.gathered_state_dict()

    def model_to_save(self, strategy: Strategy, model: torch.nn.Module, state_dict: dict) -> torch.nn.Module:
        return strategy.pipeline.whole_model(state_dict)

    def check_replicas(self, strategy: Strategy, model: torch.nn.Module) -> list[str]:
        """Collective: the replicas of each stage must be bit-identical."""
        from accelerate.utils import gather_object

        digests = gather_object([parameter_digest(model)])
        for stage in range(strategy.layout.pp):
            if len(set(digests[stage::strategy.layout.pp])) > 1:
                raise RuntimeError(f"the replicas of pipeline stage {stage} ended with different weights ({digests}); "
                                   "gradients were not synchronised. Report this with the launch command")
        return digests

    def resumes_natively(self, layout: ParallelLayout, saved: ParallelLayout) -> bool:
        """A pipeline's stage files fit only the same cut."""
        return saved.files == layout.files and saved.pp == layout.pp


    def planned_buffers(self, run, shapes, tensors, head, stage, grads_held, dtype_bytes) -> PlannedBuffers:
        """A stage is not wrapped in DDP (Pipeline all-reduces its replicas' gradients itself). Its receive buffers:
        torch.distributed.pipelining allocates, for every micro-batch of the step (not only those in flight), one
        for the hidden states and position ids it receives (all but the first stage) and one for the gradient coming
        back (all but the last), and keeps them."""
        tokens = run.micro_batch * run.local_seq
        rb = dtype_bytes[0]  # the residual stream's
        received = (0 if stage.first else rb * shapes.hidden + 8) + (0 if stage.last else rb * shapes.hidden)
        return PlannedBuffers(static=run.accumulation * tokens * received)


FAMILY = Stages()
