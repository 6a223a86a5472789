"""How any model trains, whether built from scratch or loaded pretrained: the attention kernel
and activation recomputation. Both recipes' `model` sections share these fields."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Literal

from toolkit.config.declarations import ALWAYS, Need, free
from toolkit.config.load import field
from toolkit.config.values import name_problems
from toolkit.data.packing import MASKED_ATTENTION, POSITION_ATTENTION, VARLEN_ATTENTION

RECOMPUTATION = free("recomputation (test_gradient_checkpointing)")
ATTENTION = MASKED_ATTENTION | POSITION_ATTENTION | VARLEN_ATTENTION | {"auto"}  # auto: toolkit.training.switches


@dataclass
class ComputeConfig:
    attn_implementation: str = field(
        "sdpa",
        help="sdpa (CPU/GPU), eager (the scores materialised: what Gemma 2 has on CPU), flex_attention (a compiled "
        "document BlockMask; fastest with model.compile on GPUs), flash_attention_2 (GPU, when installed) or auto "
        "(flex_attention on a GPU without model parallel, sdpa elsewhere)",
        resume=free("the same attention (test_attention's equivalence)"), used_when=ALWAYS, path=None,
    )
    gradient_checkpointing: Literal["none", "full", "every_k", "selective"] = field(
        "none", help="recompute activations in the backward: none, full (every layer), every_k, or selective (every "
                     "layer, keeping its matmuls' and attention's outputs: recomputes only the cheap operators)",
        resume=RECOMPUTATION, used_when=ALWAYS,
    )
    gradient_checkpointing_k: int = field(
        2, help="with every_k: checkpoint every k-th decoder layer", resume=RECOMPUTATION,
        used_when=Need("model.gradient_checkpointing", ("every_k",), "every_k recomputation's"),
        accepts={"2**31": "at most one layer is recomputed: harmless, if of little use"},
    )
    compile: Literal["none", "layers", "model", "auto"] = field(
        "none", help="torch.compile in place: none; layers (each decoder layer: one graph all of them reuse); model "
                     "(the whole forward with its loss, one graph; needs loss=full); auto = layers on a GPU without "
                     "model parallel, none elsewhere; the first steps compile",
        resume=free("the same forward, compiled"), used_when=ALWAYS,
    )
    cast_weights: Literal["auto", "per_forward", "per_step"] = field(
        "auto", help="when bf16/fp16 training makes its low-precision copy of the matmul weights: per_forward "
        "(autocast, at every forward and recomputation) or per_step (once per optimizer step, the same arithmetic; "
        "one process and DDP); auto = per_step where it applies",
        resume=free("the same casts (test_weight_cast)"),
        used_when=ALWAYS,  # per_step where it cannot apply: toolkit.models.weight_cast
    )
    loss: Literal["full", "chunked"] = field(
        "full",
        help="full: fp32 logits of the whole micro-batch at once; chunked: the output projection and "
        "cross-entropy loss_chunk_tokens at a time, never holding the (tokens x vocab) logits",
        resume=free("the chunked loss equals the full one (test_loss)"), used_when=ALWAYS,
    )
    loss_positions: Literal["all", "targets", "auto"] = field(
        "all", help="where the output head and the loss are computed: all (every position), targets (only the "
        "positions with a label: the same loss and gradients, without the head's work on a chat's prompts and user "
        "turns); auto = targets on a GPU where it applies (not with compile=model or model parallel)",
        resume=free("the same loss (test_loss)"), used_when=ALWAYS,
    )
    loss_chunk_tokens: int = field(
        4096, help="with loss=chunked: tokens per chunk", resume=free("(test_loss)"),
        used_when=Need("model.loss", ("chunked",), "the chunked loss's"),
        accepts={"2**31": "one chunk: the whole micro-batch, as loss=full"},
    )

    @property
    def chunk_tokens(self) -> int:
        """What toolkit.models.loss.forward_loss_sum takes: 0 for the full path, else the chunk size."""
        return self.loss_chunk_tokens if self.loss == "chunked" else 0

    def validate(self) -> list[str]:
        fix = "use sdpa, eager, flex_attention, flash_attention_2 on GPU, or auto"
        problems = name_problems(self, ("attn_implementation",), fix)
        # caught here, not when the trainer starts or the model is built
        if not problems and self.attn_implementation not in ATTENTION:
            given = str(self.attn_implementation).lower()  # a misspelling is told its nearest; another kernel, why not
            # (sdpa_paged, a kernel of its own, is not sdpa misspelt)
            near = [a for a in sorted(ATTENTION) if given.startswith(a) and not given[len(a):].startswith(("_", "|"))] \
                or difflib.get_close_matches(
                given, sorted(ATTENTION), n=1, cutoff=0.8)
            problems.append(f"attn_implementation={str(self.attn_implementation)[:60]} is not one of "
                            f"{', '.join(sorted(ATTENTION))}; did you mean {near[0]}?" if near else
                            f"attn_implementation={str(self.attn_implementation)[:60]} cannot keep packed documents apart; "
                            f"{fix}")
        if self.gradient_checkpointing_k < 1:
            problems.append(f"gradient_checkpointing_k={self.gradient_checkpointing_k} must be at least 1")
        if self.loss_chunk_tokens < 1:
            problems.append(f"loss_chunk_tokens={self.loss_chunk_tokens} must be at least 1")
        if self.compile == "model" and self.loss_positions == "targets":
            problems.append("compile=model computes the loss in the compiled graph, at every position: set "
                            "loss_positions=all (or auto), or compile=layers to keep loss_positions=targets")
        if self.compile == "model" and self.loss == "chunked":
            problems.append("compile=model computes the loss in the compiled graph, whole: set loss=full, or "
                            "compile=layers to keep loss=chunked")
        return problems
