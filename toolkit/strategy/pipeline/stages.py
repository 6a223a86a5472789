"""Pipeline parallelism: a causal LM's decoder layers cut into consecutive stages, one rank each.

Each rank holds its stage's layers (the first also the embedding, the last the final norm and the head); the
engine is torch.distributed.pipelining's `PipelineStage` under its 1F1B schedule, over the recipe's own
micro-batches. Position ids travel with the hidden states, so packed documents stay apart on every stage;
tied embeddings are a copy on the first and the last stage, their gradients summed. A model whose forward
changes its input embeddings (GPT-2, Gemma), or with fewer layers than stages, is refused (`problems`).
What it costs, and why not torch's tracer: docs/internals.md, toolkit/strategy/pipeline/stages.py.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from toolkit.data.packing import IGNORE_INDEX, MASKED_ATTENTION, packed_mask
from toolkit.models.loss import target_loss_sum, targets_of
from toolkit.models.parameters import parameter_names
from toolkit.models.router import expert_count
from toolkit.parallel_layout import ParallelLayout
from toolkit.strategy.parallelism import device_mesh

# decoders whose forward is embedding -> layers -> norm and nothing else (checked in transformers 5.23)
SPLITTABLE = ("llama", "mistral", "qwen2", "qwen3")


def problems(model: nn.Module, stages: int) -> list[str]:
    """Why `model` cannot be cut into `stages` pipeline stages (empty when it can)."""
    if stages < 1:
        return [f"pipeline stages={stages} must be at least 1"]
    if stages == 1:
        return []
    config = model.config
    found = []
    if expert_count(config):
        found.append(f"pipeline parallel does not train a mixture of experts ({config.model_type}) yet: its router "
                     "loss spans the stages; use fsdp_tp.yaml or the zero configs")
    elif config.model_type not in SPLITTABLE:
        found.append(
            f"model_type={config.model_type} cannot be cut into pipeline stages (its forward changes the input "
            f"embeddings, which every stage would repeat); use one of {', '.join(SPLITTABLE)}, or FSDP2/ZeRO-3 "
            "to shard it"
        )
    layers = config.num_hidden_layers
    if layers < stages:
        found.append(f"model.config.num_hidden_layers={layers} cannot fill {stages} pipeline stages; use at most "
                     f"{layers} stages")
    return found


def layer_ranges(layers: int, stages: int) -> list[range]:
    """The decoder layers of each stage: consecutive, as even as they divide (the first stages take the
    remainder: the last one also runs the head, the costliest single matrix of a small model)."""
    base, extra = divmod(layers, stages)
    ranges, start = [], 0
    for stage in range(stages):
        end = start + base + (stage < extra)
        ranges.append(range(start, end))
        start = end
    return ranges


class StageModel(nn.Module):
    """Stage `index` of `stages` of a causal LM: forward(input ids or hidden states, position ids) ->
    (hidden states, position ids), or the logits on the last stage."""

    def __init__(self, model: nn.Module, index: int, stages: int, attn_implementation: str):
        super().__init__()
        self.first, self.last = index == 0, index == stages - 1
        self.masked = attn_implementation in MASKED_ATTENTION
        self.attn_implementation = attn_implementation
        decoder = model.get_decoder()
        self.owned = owned = layer_ranges(len(decoder.layers), stages)[index]
        self.layers_prefix = next(n for n, m in model.named_modules() if m is decoder.layers) + "."
        decoder.layers = nn.ModuleList(decoder.layers[i] for i in owned)
        # the decoder reads its layer count and per-layer attention kinds from its config
        config = copy.copy(decoder.config)
        config.num_hidden_layers = len(owned)
        if getattr(config, "layer_types", None):
            config.layer_types = [config.layer_types[i] for i in owned]
        decoder.config = config
        if not self.first:
            decoder.embed_tokens = None
        if not self.last:
            decoder.norm = nn.Identity()
            model.lm_head = None
        self.model = model

    @property
    def config(self):
        """The whole model's config (what final/ and checkpoints' model_files describe)."""
        return self.model.config

    @property
    def generation_config(self):
        return getattr(self.model, "generation_config", None)

    def whole_name(self, name: str) -> str:
        """A parameter's name here -> its name in the whole model (layer indices are the stage's own)."""
        name = name.removeprefix("model.")
        if name.startswith(self.layers_prefix):
            index, rest = name[len(self.layers_prefix):].split(".", 1)
            name = f"{self.layers_prefix}{self.owned[int(index)]}.{rest}"
        return name

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor):
        inputs = {"input_ids" if self.first else "inputs_embeds": tokens, "position_ids": position_ids,
                  "use_cache": False}
        if self.masked:
            inputs["attention_mask"] = packed_mask(position_ids, self.attn_implementation)
        if self.last:
            return self.model(**inputs).logits
        return self.model.get_decoder()(**inputs).last_hidden_state, position_ids


class Pipeline:
    """This rank's stage of a model cut into `stages`, trained by a 1F1B schedule over `micro_batches`
    micro-batches per step. Collective: every rank builds it, from the same model (the same seed or
    the same files), with the process group started; ranks are laid out replica-major (rank =
    replica x stages + stage)."""

    def __init__(self, model: nn.Module, stages: int, micro_batches: int, attn_implementation: str,
                 device: torch.device, autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 mesh=None):
        """`mesh`: the launch's (toolkit.strategy.parallelism.device_mesh), else one is built for the stages alone."""
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        world = dist.get_world_size()
        if mesh is None:
            mesh = device_mesh(ParallelLayout("ddp", world, pp=stages), device.type)
        self.stages, self.index = stages, mesh.get_local_rank("pp")
        self.replica = mesh.get_local_rank("dp")
        self.replicas = mesh.get_group("dp") if world > stages else None
        self.pp_group = mesh.get_group("pp")
        output = model.get_output_embeddings()
        tied = output is not None and output.weight is model.get_input_embeddings().weight
        # every name a weight goes by in the whole model (a tied embedding and head: both), to find
        # it in a checkpoint by name whichever of them the saving strategy used
        self.aliases = {n: names for names in parameter_names(model).values() for n in names}
        self.module = StageModel(model, self.index, stages, attn_implementation).to(device)
        if tied:
            # the first stage's embedding and the last stage's head: two copies from here on, kept one
            # weight by summing their gradients (a group of the two ends of each pipeline)
            ends = [[r * stages, r * stages + stages - 1] for r in range(world // stages)]
            groups = [dist.new_group(pair) for pair in ends]
            self.tied_group = groups[self.replica] if self.index in (0, stages - 1) else None
            self.tied = (self.module.model.get_input_embeddings().weight if self.index == 0
                         else self.module.model.get_output_embeddings().weight if self.index == stages - 1 else None)
        else:
            self.tied_group = self.tied = None
        self.stage = PipelineStage(self.module, self.index, stages, device, group=self.pp_group)
        self.micro_batches = micro_batches
        # mixed precision: the forwards run under the launch's autocast, as a prepared model's would
        self.autocast = autocast
        self._scale, self._sums = 1.0, []
        # the stage's optimizer, saved with its weights by each stage: known once the strategy prepares it
        self.optimizer: torch.optim.Optimizer | None = None
        # gradients are the global per-token mean exactly: each micro-batch's token loss sum x scale
        self.schedule = Schedule1F1B(self.stage, micro_batches, loss_fn=self._loss, scale_grads=False)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.stages - 1

    def parameters(self):
        return self.module.parameters()

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        token_sum = target_loss_sum(logits, targets)
        self._sums.append(token_sum.detach().double())
        return token_sum * self._scale

    def _inputs(self, micro_batches: Sequence[dict[str, torch.Tensor]], device: torch.device):
        """The micro-batches as one batch each input of which the schedule cuts back into them."""
        joined = {key: torch.cat([b[key] for b in micro_batches]).to(device) for key in ("input_ids", "position_ids")}
        targets = torch.cat([targets_of(b) for b in micro_batches]).to(device)
        return joined, targets

    def _run(self, run, micro_batches, device) -> torch.Tensor:
        inputs, targets = self._inputs(micro_batches, device)
        self._sums = []
        args = (inputs["input_ids"], inputs["position_ids"]) if self.is_first else ()
        with self.autocast():
            run(*args, target=targets if self.is_last else None)
        loss = torch.zeros((), dtype=torch.float64, device=device)
        # the last micro_batches calls: the schedule's first step also calls the loss once on its own,
        # to infer the shapes of the backward
        return loss + sum(self._sums[-self.micro_batches:]) if self._sums else loss

    def step(self, micro_batches: Sequence[dict[str, torch.Tensor]], scale: float) -> torch.Tensor:
        """Forward and backward of this rank's micro-batches through the pipeline; gradients of each
        micro-batch's token loss sum x `scale` accumulate in this stage's weights, summed with the
        tied copy's and over the replicas. Returns the token loss sum on the last stage (0 elsewhere:
        a sum over the pipeline counts every token once)."""
        if len(micro_batches) != self.micro_batches:
            raise ValueError(f"the pipeline was built for {self.micro_batches} micro-batches, got {len(micro_batches)}")
        self._scale = scale
        device = next(self.module.parameters()).device
        loss = self._run(self.schedule.step, micro_batches, device)
        if self.tied_group is not None and self.tied.grad is not None:
            dist.all_reduce(self.tied.grad, group=self.tied_group)
        if self.replicas is not None:
            for p in self.module.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=self.replicas)
        return loss

    def loss_sum(self, micro_batches: Sequence[dict[str, torch.Tensor]]) -> torch.Tensor:
        """Forward only: the token loss sum of the micro-batches on the last stage (0 elsewhere)."""
        device = next(self.module.parameters()).device
        with torch.no_grad():
            return self._run(self.schedule.eval, micro_batches, device)

    def held_out(self) -> HeldOut:
        """The held-out loss through this pipeline's schedule (toolkit.training.evaluation.evaluate)."""
        return HeldOut(self)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The norm of the whole model's gradient (the tied weight counted once), the same on every
        rank; the gradients scaled down to `max_norm` when it is larger (torch's clipping rule)."""
        params = [p for p in self.module.parameters() if p.grad is not None]
        counted = [p.grad for p in params if not (self.is_last and p is self.tied)]
        device = next(self.module.parameters()).device
        local = torch.nn.utils.get_total_norm(counted) if counted else torch.zeros((), device=device)
        total = local.float().pow(2)
        dist.all_reduce(total, group=self.pp_group)
        norm = total.sqrt()
        if max_norm and max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm

    def named_parameters(self):
        """(the name the parameter has in the whole model, parameter) for this stage's weights."""
        for name, p in self.module.named_parameters():
            yield self.module.whole_name(name), p

    # ------------------------------------------------------------ final/
    def gathered_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Collective: the whole model's weights (fp32, on the CPU) on rank 0, None elsewhere; a tied
        head is left to the embedding it is tied to."""
        mine = {} if self.replica != 0 else {
            n: p.detach().float().cpu() for n, p in self.named_parameters()
            if not (self.is_last and self.tied is not None and p is self.tied)}
        held = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, held, dst=0)
        if held is None:
            return None
        return {name: value for part in held for name, value in part.items()}

    def whole_model(self, state_dict: dict[str, torch.Tensor]) -> nn.Module:
        """The whole model (on the meta device, its weights `state_dict`'s), for saving in one folder."""
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            whole = AutoModelForCausalLM.from_config(self.module.config)
        whole.load_state_dict(state_dict, assign=True, strict=self.tied is None)
        if self.tied is not None:
            whole.tie_weights()
        return whole


class HeldOut:
    """The held-out loss through a pipeline: micro-batches of `micro_batch` rows queued until a run of the schedule is
    full (its shapes are fixed), the rows and runs that fill them with no targets; the loss is the last stage's."""

    fixed_rows = True

    def __init__(self, pipeline: Pipeline):
        self.pipeline, self.queued = pipeline, []

    def add(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor | float, torch.Tensor | int]:
        """(the loss sum of the run it completes, or 0; its targets, on the last stage)."""
        counted = (targets_of(batch) != IGNORE_INDEX).sum() if self.pipeline.is_last else 0
        self.queued.append(batch)
        if len(self.queued) < self.pipeline.micro_batches:
            return 0.0, counted
        loss, self.queued = self.pipeline.loss_sum(self.queued), []
        return loss, counted

    def flush(self) -> torch.Tensor | float:
        """The last run, filled with micro-batches of no targets."""
        if not self.queued:
            return 0.0
        empty = {k: v.clone() for k, v in self.queued[0].items()}
        empty["labels"][:] = IGNORE_INDEX
        loss = self.pipeline.loss_sum(self.queued + [empty] * (self.pipeline.micro_batches - len(self.queued)))
        self.queued = []
        return loss
