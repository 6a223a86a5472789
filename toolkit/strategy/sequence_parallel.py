"""Sequence parallelism (DeepSpeed Ulysses): every sequence split over `sp` ranks, attention by heads.

Each of a group's sp ranks holds 1/sp of every sequence; in attention an all-to-all trades the sequence split
for a head split, and a second trades back. The engine is DeepSpeed's `UlyssesSPAttentionHF`; what the toolkit
adds is the core attention it wraps, which builds packing's block-causal mask from the gathered position ids
and runs sdpa, so packed documents stay apart without flash-attention's varlen path.
Its costs against context parallel, and why: docs/internals.md, toolkit/strategy/sequence_parallel.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from toolkit.config.errors import UserError
from toolkit.data.packing import block_causal_mask
from toolkit.models.loss import targets_of
from toolkit.parallel_layout import ParallelLayout
from toolkit.strategy.context_parallel import sequence_split_problems
from toolkit.strategy.parallelism import device_mesh

ATTENTION = "toolkit_sequence_parallel"  # the name it is registered under in transformers' AttentionInterface
SUPPORTED_ATTENTION = ("sdpa",)  # the kind whose block-causal mask the core attention rebuilds


def sequence_problem(sp: int, seq_len: int) -> str | None:
    """Why blocks of `seq_len` tokens cannot be split evenly over sp ranks (None when they can)."""
    if seq_len % sp == 0:
        return None
    return (f"data.seq_len={seq_len} is not divisible by parallelism_config_sp_size={sp}: each rank holds an equal "
            f"part of every sequence; use a multiple of {sp}")


def problems(config, sp: int, seq_len: int, attn_implementation: str) -> list[str]:
    """Why a model with `config`, trained on blocks of `seq_len` tokens, cannot be split over sp ranks."""
    if sp <= 1:
        return []
    found = [problem] if (problem := sequence_problem(sp, seq_len)) else []
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if heads % sp:
        found.append(f"{config.model_type} has {heads} attention heads, not divisible by parallelism_config_sp_size="
                     f"{sp}: each rank attends with heads/sp of them; use an sp that divides {heads}")
    elif kv_heads % sp and sp % kv_heads:
        found.append(f"{config.model_type} has {kv_heads} key/value heads: parallelism_config_sp_size={sp} must divide "
                     "them or be a multiple of them")
    if attn_implementation not in SUPPORTED_ATTENTION:
        found.append(f"model.attn_implementation={attn_implementation} cannot run sequence parallel here; use sdpa "
                     "(the whole sequence's attention runs under packing's block-causal mask)")
    found += sequence_split_problems(config, "sequence parallel")
    if getattr(text, "model_type", "") == "gpt2" or not hasattr(text, "num_key_value_heads"):
        found.append(f"{config.model_type} does not pass position ids to its attention, which Ulysses needs to "
                     "rebuild the mask; use a LLaMA-style model (LLaMA, Qwen2/3, Mistral)")
    return found


def block_causal_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Core attention over the whole sequence (query, key, value: batch x heads/sp x L x head_dim),
    under packing's block-causal mask of the whole sequence (`sequence_mask`, SequenceParallel.mask),
    or one rebuilt from the gathered position ids."""
    mask = kwargs.get("sequence_mask")
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=block_causal_mask(kwargs["position_ids"]) if mask is None else mask,
        dropout_p=dropout if module.training else 0.0, scale=scaling, enable_gqa=query.shape[1] != key.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def no_mask(*args, **kwargs):
    """transformers' mask for this attention: none (each layer rebuilds the whole sequence's)."""
    return None


def skip_shared_memory_kernel() -> None:
    """DeepSpeed's process group on CPU builds and loads a shared-memory all-reduce kernel and prints
    "DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully" on every rank. Only its
    inference all-reduce (DeepSpeed-Inference, AutoTP) calls the kernel, and falls back to the process
    group's all_reduce without it; training never does. Marked incompatible (DeepSpeed's own table of
    the ops this machine can build), it is neither built nor loaded."""
    import deepspeed.ops
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    compatible = deepspeed.ops.__compatible_ops__
    if isinstance(compatible, dict):
        compatible[ShareMemCommBuilder.NAME] = False


class SequenceParallel:
    """A launch's sequence-parallel groups: ranks [g*sp, (g+1)*sp) split group g's sequences.

    Collective to build (every rank creates the device mesh)."""

    def __init__(self, sp: int, device: torch.device, mesh=None):
        """`mesh`: the launch's (toolkit.strategy.parallelism.device_mesh), else one is built for sp alone."""
        import deepspeed

        if device.type == "cpu":  # Ulysses starts DeepSpeed's comm, under FSDP2 too
            skip_shared_memory_kernel()
        if not deepspeed.comm.is_initialized():  # the engine's collectives go through DeepSpeed's comm,
            # which wraps the process group Accelerate made (under DDP or FSDP nothing else starts it)
            deepspeed.init_distributed(dist_backend=torch.distributed.get_backend(), auto_mpi_discovery=False)
        if mesh is None:
            mesh = device_mesh(ParallelLayout("fsdp", torch.distributed.get_world_size(), sp=sp), device.type)
        self.sp = sp
        self.mesh = mesh["sp"]
        self.group = self.mesh.get_group()
        self.sp_rank = self.mesh.get_local_rank()
        self.device = device
        self._engines: dict[int, torch.nn.Module] = {}  # DeepSpeed's wrapper fixes the batch size it reshapes to
        self._mask: tuple[torch.Tensor, torch.Tensor] | None = None  # (local position ids, the mask made from them)

    def mask(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The whole sequence's block-causal mask, additive in the attention's dtype, made once per
        forward: every layer is given the same local position ids, and sdpa keeps a mask of the query's
        dtype as it is, so the layers share one (a bool mask is converted, and the copy kept, per layer:
        L x L bytes x 2 in each of them, what bounded the sequence)."""
        if self._mask is None or self._mask[0] is not positions or self._mask[1].dtype != dtype:
            parts = [torch.empty_like(positions) for _ in range(self.sp)]
            torch.distributed.all_gather(parts, positions.contiguous(), group=self.group)
            allowed = block_causal_mask(torch.cat(parts, dim=1))
            additive = torch.zeros(allowed.shape, dtype=dtype, device=positions.device)
            self._mask = (positions, additive.masked_fill_(~allowed, float("-inf")))
        return self._mask[1]

    def split(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A collated batch (input_ids, position_ids, labels: B x L) -> this rank's contiguous part: its
        tokens, their positions and their next-token targets (shifted before the split: a part's last
        token predicts the first token of the next part)."""
        length = batch["input_ids"].shape[1]
        if length % self.sp:
            raise UserError(f"a batch of {length} tokens per sequence cannot be split over sp={self.sp} ranks; "
                            f"use a data.seq_len divisible by {self.sp}")
        part = slice(self.sp_rank * length // self.sp, (self.sp_rank + 1) * length // self.sp)
        targets = targets_of(batch)
        return {
            "input_ids": batch["input_ids"][:, part].to(self.device),
            "position_ids": batch["position_ids"][:, part].to(self.device),
            "shift_labels": targets[:, part].to(self.device),
        }

    def apply(self, model: torch.nn.Module) -> None:
        """Route `model`'s attention through DeepSpeed's Ulysses all-to-alls over this rank's group."""
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
        from transformers import AttentionInterface, AttentionMaskInterface

        text = model.config.get_text_config()
        heads = text.num_attention_heads
        shapes = {
            "attn_head_count": heads,
            "attn_head_size": getattr(text, "head_dim", None) or text.hidden_size // heads,
            "kv_head_count": getattr(text, "num_key_value_heads", None) or heads,
            "num_hidden_layers": text.num_hidden_layers,
        }

        def attention(module, query, key, value, attention_mask, *args, **kwargs):
            batch = query.shape[0]
            if batch not in self._engines:  # evaluation may batch differently from training
                self._engines[batch] = UlyssesSPAttentionHF(
                    block_causal_attention, batch_size=batch, process_group=self.group, seq_length_is_variable=True,
                    **shapes,
                )
            kwargs["sequence_mask"] = self.mask(kwargs["position_ids"], query.dtype)
            return self._engines[batch](module, query, key, value, None, *args, **kwargs)

        AttentionInterface.register(ATTENTION, attention)
        AttentionMaskInterface.register(ATTENTION, no_mask)
        model.set_attn_implementation(ATTENTION)
