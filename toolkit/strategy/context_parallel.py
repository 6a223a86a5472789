"""Context parallelism: every sequence split over `cp` ranks, packed documents kept apart.

Each of a group's cp ranks holds 1/cp of every sequence (head-tail balanced), so activations per rank fall by
cp. In attention each rank all-gathers the whole sequence's keys and values and attends its own queries to
them under its rows of packing's block-causal mask (the form Llama 3 was trained with for document masks);
the backward reduce-scatters their gradients, and the data-parallel wrapper reduces over cp as over the rest.
Its costs, and why not torch's ring attention: docs/internals.md, toolkit/strategy/context_parallel.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from toolkit.config.errors import UserError
from toolkit.data.packing import document_ids
from toolkit.models.loss import targets_of
from toolkit.models.router import expert_count
from toolkit.parallel_layout import ParallelLayout
from toolkit.strategy.parallelism import device_mesh

ATTENTION = "toolkit_context_parallel"  # the name it is registered under in transformers' AttentionInterface
SUPPORTED_ATTENTION = ("sdpa", "eager")  # the kinds that take packing's block-causal mask


def sequence_problem(cp: int, seq_len: int) -> str | None:
    """Why blocks of `seq_len` tokens cannot be split evenly over cp ranks (None when they can)."""
    if seq_len % (2 * cp) == 0:
        return None
    return (f"data.seq_len={seq_len} is not divisible by 2 x parallelism_config_cp_size = {2 * cp}: each rank holds "
            f"two equal chunks of every sequence; use a multiple of {2 * cp}")


def problems(config, cp: int, seq_len: int, attn_implementation: str) -> list[str]:
    """Why a model with `config`, trained on blocks of `seq_len` tokens, cannot be split over cp ranks."""
    if cp <= 1:
        return []
    found = [problem] if (problem := sequence_problem(cp, seq_len)) else []
    if attn_implementation not in SUPPORTED_ATTENTION:
        found.append(
            f"model.attn_implementation={attn_implementation} cannot run context parallel here; use sdpa (the "
            "gathered keys and values are attended under packing's block-causal mask)"
        )
    return found + sequence_split_problems(config, "context parallel")


def sequence_split_problems(config, kind: str) -> list[str]:
    """What no split of the sequence (context or sequence parallel: `kind`) can train here."""
    found = []
    if expert_count(config):
        found.append(
            f"{kind} with a mixture of experts ({config.model_type}) is not supported: the router loss would be "
            "computed per part of the sequence; train it with fsdp.yaml, fsdp_tp.yaml or the zero configs"
        )
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True):
        found.append(
            f"{kind} with sliding-window attention ({config.model_type}, sliding_window={text.sliding_window}) "
            "is not supported: the mask here is block-causal only"
        )
    return found


@dataclass
class SequenceShard:
    """Which positions of a sequence of `length` tokens this rank holds, in load-balanced order."""

    length: int
    cp: int
    cp_rank: int
    device: torch.device

    def __post_init__(self):
        from torch.distributed.tensor.experimental._attention import _HeadTailLoadBalancer

        order = _HeadTailLoadBalancer(self.length, self.cp, self.device)._generate_indices(restore=False)[0]
        self.order = order.to(self.device)  # the whole sequence as the cp ranks hold it, rank after rank
        local = self.length // self.cp
        self.mine = self.order[self.cp_rank * local : (self.cp_rank + 1) * local]

    def split(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A collated batch (input_ids, position_ids, labels: B x L) -> this rank's share: its tokens,
        their positions, their next-token targets (shifted before the split: a shard's last token
        predicts the first token of another shard) and its rows of the block-causal mask over the
        whole sequence in the ranks' order (what the gathered keys are in)."""
        ids, positions, targets = batch["input_ids"], batch["position_ids"], targets_of(batch)
        document = document_ids(positions)
        doc_rows, doc_cols = document[:, self.mine], document[:, self.order]
        same = doc_rows[:, :, None] == doc_cols[:, None, :]
        causal = self.mine[:, None] >= self.order[None, :]
        return {
            "input_ids": ids[:, self.mine],
            "position_ids": positions[:, self.mine],
            "shift_labels": targets[:, self.mine],
            "attention_mask": (same & causal)[:, None],
        }


class ContextParallel:
    """A launch's context-parallel groups: ranks [g*cp, (g+1)*cp) split group g's sequences.

    Collective to build (every rank creates the device mesh)."""

    def __init__(self, cp: int, device: torch.device, mesh=None):
        """`mesh`: the launch's (toolkit.strategy.parallelism.device_mesh), else one is built for cp alone."""
        if mesh is None:
            mesh = device_mesh(ParallelLayout("fsdp", torch.distributed.get_world_size(), cp=cp), device.type)
        self.cp = cp
        self.mesh = mesh["cp"]
        self.group = self.mesh.get_group()
        self.cp_rank = self.mesh.get_local_rank()
        self.device = device
        self._shards: dict[int, SequenceShard] = {}

    def split(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        length = batch["input_ids"].shape[1]
        if length not in self._shards:
            if length % (2 * self.cp):
                raise UserError(f"a batch of {length} tokens per sequence cannot be split over cp={self.cp} ranks; "
                                f"use a data.seq_len divisible by {2 * self.cp}")
            self._shards[length] = SequenceShard(length, self.cp, self.cp_rank, self.device)
        return self._shards[length].split({k: v.to(self.device) for k, v in batch.items()})

    def apply(self, model: torch.nn.Module) -> None:
        """Route `model`'s attention through the gathered keys and values of this rank's group."""
        import torch.distributed._functional_collectives as funcol
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask

        group = self.group
        # renamed in torch 2.13 (the old name warns there; 2.11, on the GPU image, has only it)
        gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd

        def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **_):
            key = gather(key.contiguous(), gather_dim=2, group=group)
            value = gather(value.contiguous(), gather_dim=2, group=group)
            out = F.scaled_dot_product_attention(
                query, key, value, attn_mask=attention_mask, dropout_p=dropout if module.training else 0.0,
                scale=scaling, enable_gqa=query.shape[1] != key.shape[1],
            )
            return out.transpose(1, 2).contiguous(), None

        AttentionInterface.register(ATTENTION, attention)
        AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # unused: split() passes the mask rows
        model.set_attn_implementation(ATTENTION)
