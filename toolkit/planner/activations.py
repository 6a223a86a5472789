"""Activations saved for backward, logits and loss buffers, per token and decoder layer, from the model's shapes
and the run's dtypes (docs/memory.md; counted with saved_tensors_hooks in tests)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from toolkit.config.errors import UserError
from toolkit.models.router import expert_count
from toolkit.planner.facts import Run
from toolkit.strategy.families import family_of
from toolkit.strategy.tensor_parallel import SEQUENCE_ATTENTION

LLAMA_STYLE = ("llama", "mistral", "qwen2", "qwen3")
# LLaMA-style with Gemma 2's differences (Shapes.sandwich_norms, attn_softcap, logit_softcap): measured alike
GEMMA_STYLE = ("gemma2",)
MIXTURES = ("qwen3_moe", "mixtral")  # LLaMA-style attention, every layer's MLP a mixture of experts (transformers' grouped_mm experts)


@dataclass
class Shapes:
    """A LLaMA-style decoder's sizes (what its saved activations depend on)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    layer_params: int  # one decoder layer's parameters (what FSDP2 / ZeRO-3 gather at once)
    experts: int = 0  # a mixture of experts' experts per layer (0: a dense SwiGLU MLP)
    top_k: int = 0  # experts each token is routed to
    expert_params: int = 0  # one layer's expert weights (autocast casts none of them: grouped_mm runs in their dtype)
    norm_topk: bool = False  # the router renormalises its top-k weights (norm_topk_prob)
    qk_norm: bool = False  # RMSNorm on each head's query and key (Qwen3's q_norm, k_norm)
    # Gemma 2: a norm after attention and after the MLP too, every norm normalising in fp32 (x (1 + w)); its attention
    # scores capped (c tanh(s / c)) before the softmax; its logits capped after the head
    sandwich_norms: bool = False
    attn_softcap: bool = False
    logit_softcap: bool = False
    fp32_routing: bool = False  # the router's top-k weights stay fp32 (Mixtral), not cast to its logits' dtype
    lora: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # adapted linear -> (in, rank, out)
    lora_dropout: bool = False

    @classmethod
    def of(cls, model: torch.nn.Module) -> Shapes:
        config = getattr(model, "config", None)
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        config = getattr(base, "config", config)
        model_type = getattr(config, "model_type", None)
        if model_type not in LLAMA_STYLE + GEMMA_STYLE + MIXTURES:
            raise UserError(
                f"the memory planner models LLaMA-style decoders ({', '.join(LLAMA_STYLE + GEMMA_STYLE)}) and "
                f"mixtures of experts ({', '.join(MIXTURES)}); model_type {model_type!r} is not modelled yet, so there is "
                "no plan: launch it as its YAML's first line says and read what each process held in metrics.jsonl's "
                "memory row (docs/metrics.md)"
            )
        heads = config.num_attention_heads
        layer = base.model.layers[0]
        moe = {}
        if model_type in MIXTURES:
            if getattr(config, "mlp_only_layers", None) or getattr(config, "decoder_sparse_step", 1) != 1:
                raise UserError(f"the memory planner models {model_type} with a mixture of experts in every layer; "
                                "model.config.mlp_only_layers / decoder_sparse_step give dense layers too")
            if getattr(config, "experts_implementation", None) not in (None, "grouped_mm"):
                raise UserError(f"the memory planner models transformers' grouped_mm experts; "
                                f"model.config.experts_implementation={config.experts_implementation!r} is not modelled")
            experts = layer.mlp.experts
            moe = dict(experts=expert_count(config), top_k=config.num_experts_per_tok,
                       expert_params=sum(p.numel() for p in experts.parameters()),
                       norm_topk=bool(getattr(config, "norm_topk_prob", True)),  # Mixtral always renormalises
                       fp32_routing=model_type == "mixtral")
        lora, dropout = {}, False
        # the first adapted layer's adapters, priced on every layer (adapter.layers: the others keep less)
        layer = next((lay for lay in base.model.layers if any(hasattr(m, "lora_A") for m in lay.modules())), layer)
        for name, module in layer.named_modules():
            if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
                a = module.lora_A["default"]
                lora[name.rsplit(".", 1)[-1]] = (a.in_features, a.out_features, module.base_layer.out_features)
                drop = module.lora_dropout["default"]
                dropout = dropout or isinstance(drop, torch.nn.Dropout)
        return cls(
            hidden=config.hidden_size, layers=config.num_hidden_layers,
            intermediate=getattr(config, "moe_intermediate_size", config.intermediate_size),
            heads=heads, kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads, vocab=config.vocab_size,
            layer_params=sum(p.numel() for p in layer.parameters()), lora=lora, lora_dropout=dropout, **moe,
            qk_norm=hasattr(layer.self_attn, "q_norm"), sandwich_norms=hasattr(layer, "post_feedforward_layernorm"),
            attn_softcap=bool(getattr(config, "attn_logit_softcapping", None)),
            logit_softcap=bool(getattr(config, "final_logit_softcapping", None)),
        )


def dtypes(run: Run) -> tuple[int, int, bool]:
    """(bytes of the residual stream, bytes of matmul inputs, whether autocast casts each input).

    Autocast over fp32 weights (DDP, a single GPU) keeps an fp32 residual stream and casts every
    matmul's input on its own; FSDP2 (param_dtype) and DeepSpeed (bf16 mode) cast the weights
    instead, so the whole stream is in the compute dtype. Tensor parallel is autocast over fp32
    weights too: transformers' FSDP2 has no MixedPrecisionPolicy (DistributedConfig's
    fsdp_mixed_precision is off) and Accelerate takes that model as it is."""
    if run.precision == "fp32":
        return 4, 4, False
    weights_cast = cast_by_strategy(run) or run.param_dtype != torch.float32
    return (2, 2, False) if weights_cast else (4, 2, True)


def cast_by_strategy(run: Run) -> bool:
    """Whether the strategy casts the weights to the compute dtype (FSDP2's param_dtype without tensor parallel,
    DeepSpeed's bf16 mode), rather than autocast each matmul's input."""
    return family_of(run.strategy.layout).casts_weights(run.strategy.layout)


def compiled_bytes_per_token(shapes: Shapes, run: Run, selective: bool) -> float | None:
    """What a compiled decoder layer (model.compile) keeps per token, measured on CPU (inductor): less than eager,
    since the compiler's partitioner recomputes the pointwise work (norms, rotary, SwiGLU's product) in the backward
    from what it keeps. Without checkpointing: a stream-width tensor in the stream's dtype and three in the compute
    dtype, the query and attention output, keys and values, three of the MLP's width, the fp32 log-sum-exp per head
    and the two norms' 1/rms. Selective (beside the checkpointed input, which activation_bytes counts): one
    stream-width tensor, the query and attention output, keys and values, two of the MLP's width and the
    log-sum-exp. Not modelled (None: the eager counts, more than it keeps): mixtures of experts, LoRA, Qwen3's
    query/key norms, Gemma 2, model-parallel layouts, eager attention and sdpa's repeated keys under a document mask."""
    layout = run.strategy.layout
    masked = run.attention == "sdpa" and run.packed_documents and not run.own_attention
    if (not run.compiled or shapes.experts or shapes.lora or shapes.qk_norm or shapes.sandwich_norms or masked
            or run.attention == "eager"
            or layout.tp > 1 or layout.sp > 1 or layout.cp > 1):
        return None
    rb, cb, _ = dtypes(run)
    h, i = shapes.hidden, shapes.intermediate
    q, kv = shapes.heads * shapes.head_dim, shapes.kv_heads * shapes.head_dim
    if selective:
        return cb * (h + 2 * q + 2 * kv + 2 * i) + 4 * shapes.heads
    return (rb + 3 * cb) * h + cb * (2 * q + 2 * kv + 3 * i) + 4 * shapes.heads + 8


def layer_bytes_per_token(shapes: Shapes, run: Run) -> float:
    """Bytes one decoder layer saves for backward per token (sequence-length terms folded in), compiled or eager.

    RMSNorm: its fp32 input, 1/rms, the normalised x in the stream's dtype, and the output the
    projections read (one copy per projection under autocast). Attention (sdpa, flash, flex):
    q, k, v, out and the log-sum-exp, k and v repeated to every query head when sdpa gets the
    packed documents' mask; eager also the (heads x seq) probabilities in fp32 and (unless that is the compute
    dtype) in the compute dtype, and k, v repeated to every query head. SwiGLU: gate, silu(gate), up and
    their product (Gemma's GeGLU the same). LoRA: the rank-r activations (and the dropout's copy of the input).
    Gemma 2: every norm keeps its normalised x in fp32, and the norms after attention and after the MLP keep
    what a norm keeps of its own (8h + 4; nothing reads their output but the residual add); eager attention
    also keeps the capped scores' tanh (heads x seq, compute dtype). Flash and flex attention: as LLaMA's (its
    cap inside the kernel; not measured).

    Tensor parallel: each rank has 1/tp of the heads and of the MLP's width, so attention and MLP
    terms fall by tp; the projections' inputs are the whole sequence on every rank (under Megatron's
    sequence parallel the all-gathered input, which autocast casts once per projection, or which the
    projections share uncast). The norms' own tensors are per token of the residual stream: whole under
    transformers' plan, 1/tp under sequence parallel, which layer_bytes applies
    (norm_core_bytes_per_token). Context parallel's keys and values are layer_bytes's.

    Sequence parallel (per token of the rank's seq_len / sp): sdpa keeps q, k, v and its output for
    the whole sequence and heads / sp of the heads, which is q (and its output) per local token; k and
    v are max(kv_heads, sp) x head_dim per local token (each rank gets kv_heads / sp heads, or one
    replicated head when sp exceeds them), never repeated to the query heads (enable_gqa). The
    all-to-all back gives o_proj an input of its own (c·q), beside sdpa's output."""
    compiled = compiled_bytes_per_token(shapes, run, selective=False)
    if compiled is not None:
        return compiled
    h, r, tp = shapes.hidden, run, run.strategy.layout.tp
    i, heads = shapes.intermediate // tp, shapes.heads // tp
    q, kv = heads * shapes.head_dim, shapes.kv_heads // tp * shapes.head_dim
    rb, cb, casts = dtypes(r)
    lora = shapes.lora

    normalised = 4 if shapes.sandwich_norms else rb  # Gemma's norm multiplies by (1 + w) in fp32

    def norm(consumers: int) -> float:
        kept_output = consumers * cb * h if casts else (rb * h if consumers else 0)
        return 4 * h + 4 + normalised * h + kept_output

    post_norms = 2 * norm(0) if shapes.sandwich_norms else 0

    k = v = kv
    if run.attention == "sdpa" and run.packed_documents and not run.own_attention:
        # given a mask, transformers repeats k and v to every query head (use_gqa_in_sdpa); not context
        # parallel's attention. With one key/value head on the rank (kv_heads = tp) repeat_kv's reshape
        # is a view of it (stride 0 over the heads): v stays kv wide, k too unless autocast casts its
        # fp32 rotary output, which copies it out at q width (measured, tp 2)
        k = v = q
        if shapes.kv_heads // tp == 1:
            k, v = (q if casts else kv), kv
    attention = cb * (2 * q + k + v) + 4 * heads
    if run.strategy.layout.sp > 1:  # the gathered k and v, and o_proj's input apart from sdpa's output
        attention = cb * (3 * q + 2 * max(shapes.kv_heads, run.strategy.layout.sp) * shapes.head_dim) + 4 * heads
    elif run.attention == "eager" and run.strategy.layout.cp == 1:  # context parallel runs its own sdpa attention
        # the softmax's fp32 output, its copy in the compute dtype (none in fp32), Gemma's capped scores' tanh
        scores = 4 + (cb if cb < 4 else 0) + (cb if shapes.attn_softcap else 0)
        attention = cb * 4 * q + scores * heads * run.seq_len
    if shapes.qk_norm:  # per head: the fp32 input, 1/rms, the output in the projections' dtype (before any all-to-all)
        local_kv = shapes.kv_heads // tp
        attention += (4 + cb) * (heads + local_kv) * shapes.head_dim + 4 * (heads + local_kv)
    if shapes.experts:
        return norm(3) + attention + norm(0 if casts else 1) + moe_bytes_per_token(shapes, run)
    mlp = 4 * cb * i
    if not lora:
        return norm(3) + attention + norm(2) + mlp + post_norms
    # LoRA, on a frozen base (measured on CPU): a frozen projection, norm or MLP keeps nothing for its weights, so
    # a norm keeps its fp32 input and 1/rms alone and the MLP its gate, activation and up; each adapter keeps its
    # input and its rank-r activation. Where autocast runs the fp32 adapters (peft keeps them fp32) each adapter
    # casts its input for itself (peft's cast to the adapter's dtype, then autocast's); where the adapters run in
    # the input's dtype (fp32, or cast with the base by FSDP2 or DeepSpeed) the adapters of one input share it,
    # and o_proj's input is the attention's output, which sdpa keeps anyway (eager does not: its own). With
    # dropout, each adapter its dropped copy and CUDA's 1-byte mask (CPU keeps its noise in the dropped copy's dtype).
    per_adapter = run.precision != "fp32" and not cast_by_strategy(run)
    kept_by_attention = run.attention != "eager" or run.strategy.layout.cp > 1
    shared = {"q_proj": "norm", "k_proj": "norm", "v_proj": "norm", "gate_proj": "mlp_norm", "up_proj": "mlp_norm",
              "o_proj": "out" if kept_by_attention else "o_proj"}
    inputs, adapters = {}, 0.0
    for name, (d_in, rank, _) in lora.items():
        adapters += cb * rank
        if shapes.lora_dropout:
            adapters += (cb + 1) * d_in
        elif per_adapter:
            adapters += cb * d_in
        else:
            inputs[shared.get(name, name)] = cb * d_in
    inputs.pop("out", None)
    if not kept_by_attention:  # eager's q-wide fourth was o_proj's input, which a frozen o_proj does not keep
        attention -= cb * q
    frozen_norm = 4 * h + 4
    post = 2 * frozen_norm if shapes.sandwich_norms else 0
    return 2 * frozen_norm + post + attention + 3 * cb * i + sum(inputs.values()) + adapters


def moe_bytes_per_token(shapes: Shapes, run: Run) -> float:
    """What a mixture-of-experts MLP (transformers' Qwen3-MoE block, grouped_mm experts) saves per token,
    measured on CPU. The router: its fp32 softmax (4 x experts), the top-k indices (8 x k), with
    norm_topk_prob the top-k weights and their sum (4k + 4); under autocast its input's cast (c·h).
    Per routed copy of a token (k of them): the gathered input (h), gate_up's output (2i), silu's
    output (i), the product (i) and down's output (h), in the dtype the experts run in, which is the
    weights' (grouped_mm is not autocast: fp32 under autocast over fp32 weights), the routing weight
    in the router's dtype (fp32 for Mixtral), and three int64 index vectors (sort permutation, sorted ids,
    token ids). Qwen3-MoE's and Mixtral's blocks (the same grouped_mm experts) measured alike.

    Expert parallel (fsdp_tp.yaml: ep = tp, transformers' AllToAllEP; measured on 2 gloo processes,
    tests/support/model_parallel_memory_probe.py): the router runs on every token of the batch the tp ranks share and
    keeps the same as above for all of them. Each rank then sends the k routed copies of its 1/tp of the
    tokens to the ranks of their experts and keeps, per copy sent: the gather's int64 index (8), the
    int64 order the results come back in (8), the returned expert output (x·h) and its routing weight.
    Its experts run on the copies they receive, top-1 with unit weights, and keep per copy received:
    the gathered input (x·h), gate_up's output (2i), silu's (i), the product (i), the unit weight (x),
    the sentinel mask of the rows routed off the rank (1 byte) and two int64 indices (gather, inverse
    order); down's output is not kept (the unit weights need no gradient). A rank receives the copies
    routed to its num_experts / ep experts: k / ep per token with balanced routing, which the estimate
    assumes; imbalance makes a rank receive, and hold, more (up to min(k, experts / ep) per token when
    every token picks its experts)."""
    h, i, k = shapes.hidden, shapes.intermediate, shapes.top_k
    rb, cb, casts = dtypes(run)
    xb = rb  # the experts' dtype: the weights' (the residual stream's under autocast, cb when cast)
    weight = 4 if shapes.fp32_routing else cb  # a routing weight
    router = 4 * shapes.experts + 8 * k + ((4 * k + 4) if shapes.norm_topk else 0) + (cb * h if casts else 0)
    ep = run.strategy.layout.tp  # expert parallel spreads the experts over the tp ranks
    if ep == 1:
        return router + k * (xb * (2 * h + 4 * i) + 24 + weight)
    sent = 8 + 8 + xb * h + weight
    received = xb * (h + 4 * i) + xb + 1 + 8 + 8
    return router + k * (sent + received) / ep


def gathered_kv_bytes(shapes: Shapes, run: Run) -> int:
    """Context parallel: the keys and values of the whole sequence that each layer all-gathers from
    its group and sdpa keeps for backward (0 without context parallel)."""
    if run.strategy.layout.cp == 1:
        return 0
    return 2 * dtypes(run)[1] * shapes.kv_heads * shapes.head_dim * run.micro_batch * run.seq_len


def selective_bytes_per_token(shapes: Shapes, run: Run) -> float:
    """Bytes a decoder layer under model.gradient_checkpointing=selective keeps per token beside its
    checkpointed input (toolkit.models.gradient_checkpointing.KEPT): the outputs of its matmuls (q, k
    and v, o_proj, gate and up, down; a LoRA adapter's rank-r and output activations) and of its
    attention kernel (the output and the fp32 log-sum-exp; eager attention's two matmuls: the scores
    and the output), in the compute dtype. Measured on CPU for a dense model on one rank. A mixture of
    experts, Gemma 2 and the tensor, sequence and context parallel layouts are not modelled: there it counts
    what the layer keeps without checkpointing, more than it does."""
    layout = run.strategy.layout
    if shapes.experts or shapes.sandwich_norms or layout.tp > 1 or layout.sp > 1 or layout.cp > 1:
        return layer_bytes_per_token(shapes, run)
    compiled = compiled_bytes_per_token(shapes, run, selective=True)
    if compiled is not None:
        return compiled
    h, i, cb = shapes.hidden, shapes.intermediate, dtypes(run)[1]
    q, kv = shapes.heads * shapes.head_dim, shapes.kv_heads * shapes.head_dim
    attention = cb * q + 4 * shapes.heads
    if run.attention == "eager":
        attention = cb * (q + shapes.heads * run.seq_len)
    adapters = sum(cb * (rank + d_out) for _, rank, d_out in (shapes.lora or {}).values())
    return cb * (q + 2 * kv + 2 * h + 2 * i) + attention + adapters


def layer_bytes(shapes: Shapes, run: Run) -> int:
    """Bytes one decoder layer saves for backward on a rank, for one micro-batch: its seq_len / cp (or
    / sp) tokens, and under context parallel the gathered keys and values in place of its own. sdpa
    given a boolean mask (packed documents; context parallel's rows of it) converts it to the compute
    dtype in every layer and keeps that copy for backward (measured on CPU; torch's
    convert_boolean_attn_mask runs before any kernel is chosen). Sequence parallel's whole-sequence
    mask is made once per forward in the compute dtype and every layer keeps that same tensor:
    sequence_mask_bytes, counted once by activation_bytes, not here."""
    tokens = run.micro_batch * run.local_seq
    cb = dtypes(run)[1]
    own_kv = 2 * cb * shapes.kv_heads * shapes.head_dim * tokens if run.strategy.layout.cp > 1 else 0
    masked = run.strategy.layout.cp > 1 or (run.packed_documents and run.attention == "sdpa" and not run.own_attention)
    mask = cb * run.micro_batch * run.local_seq * run.seq_len if masked else 0
    offsets = 4 * shapes.experts // run.strategy.layout.tp  # grouped_mm's int32 offsets, one per expert of the rank
    # tensor parallel's sequence parallel: the two norms keep their own tensors for the rank's part only
    norms_apart = 2 * norm_core_bytes_per_token(shapes, run) * (tokens - stream_tokens(shapes, run))
    return (round(layer_bytes_per_token(shapes, run) * tokens) - norms_apart - own_kv + gathered_kv_bytes(shapes, run)
            + mask + offsets)


def tp_sequence_parallel(shapes: Shapes, run: Run) -> bool:
    """Whether tensor parallel also shards the sequence between the layers (Megatron's sequence
    parallel, toolkit.strategy.tensor_parallel.sequence_layout): a dense model under sdpa or eager
    attention. A mixture of experts, or flex/flash attention, keeps transformers' plan."""
    return run.strategy.layout.tp > 1 and not shapes.experts and run.attention in SEQUENCE_ATTENTION


def stream_tokens(shapes: Shapes, run: Run) -> int:
    """Tokens of the residual stream a rank holds between the layers, for one micro-batch: its seq_len
    / cp (or / sp) of each sequence, and under tensor parallel's sequence parallel the first rank's
    ceil(seq_len / tp) (DTensor's Shard(1))."""
    if tp_sequence_parallel(shapes, run):
        return run.micro_batch * math.ceil(run.seq_len / run.strategy.layout.tp)
    return run.micro_batch * run.local_seq


def norm_core_bytes_per_token(shapes: Shapes, run: Run) -> int:
    """What an RMSNorm keeps of its own per token: its fp32 input, 1/rms and the normalised x in the
    stream's dtype (Gemma's in fp32; the output the projections read is theirs: layer_bytes_per_token's norm)."""
    return 4 * shapes.hidden + 4 + (4 if shapes.sandwich_norms else dtypes(run)[0]) * shapes.hidden


def sequence_mask_bytes(run: Run) -> int:
    """Sequence parallel's block-causal mask of the whole sequence (micro-batch x 1 x seq x seq), additive
    in the compute dtype: made once per forward (SequenceParallel.mask) and given to every layer's sdpa,
    which keeps that one tensor (measured: two layers keep one storage); the strategy holds it until the
    next forward makes another, so through the backward and the optimizer step too. 0 without sequence
    parallel."""
    if run.strategy.layout.sp == 1:
        return 0
    return dtypes(run)[1] * run.micro_batch * run.seq_len * run.seq_len


def router_loss_bytes(shapes: Shapes, run: Run, layers: int) -> int:
    """A mixture of experts' router loss (toolkit.models.router.RouterLoss, in every training step) over
    `layers` MoE layers: each router's logits (tokens x experts, the compute dtype) are recorded through
    the forward; the loss (transformers' load_balancing_loss_func) keeps for backward a softmax of each,
    as large, and drops the logits (its top-k indices die with their unused values); measured on CPU.
    Within the loss call both are alive for a moment (2x this), not counted. Checkpointing keeps them
    all the same (the routers' forwards are recorded, not their recomputation)."""
    if not shapes.experts:
        return 0
    tokens = run.micro_batch * run.local_seq
    return layers * tokens * dtypes(run)[1] * shapes.experts + 4 * shapes.experts


def activation_bytes(shapes: Shapes, run: Run, layers: range | None = None) -> dict[str, int]:
    """Saved activations of one micro-batch in `layers` (every decoder layer by default), split into
    what stays until backward and what backward adds."""
    tokens = run.micro_batch * run.local_seq
    rb, cb, casts = dtypes(run)
    per_layer = layer_bytes(shapes, run)
    layers = range(shapes.layers) if layers is None else layers
    # transformers checkpoints layer i when i % k == 0 (every_n_layers), numbered in the whole model
    every = {"none": 0, "full": 1, "every_k": max(1, run.every_k), "selective": 1}[run.checkpointing]
    ckpt = sum(i % every == 0 for i in layers) if every else 0
    kept = len(layers) - ckpt
    stream = stream_tokens(shapes, run)  # a checkpointed layer's input is the rank's part of the stream
    selective = round(selective_bytes_per_token(shapes, run) * tokens) if run.checkpointing == "selective" else 0
    saved = kept * per_layer + ckpt * (rb * shapes.hidden * stream + selective)
    # rotary cos/sin (shared by the layers), the token ids, the packed-document mask of sdpa/eager;
    # context parallel passes every rank its rows of the block-causal mask (micro-batch x seq/cp x seq);
    # sequence parallel its whole-sequence mask in the compute dtype, one for all the layers
    shared = 2 * run.local_seq * shapes.head_dim * rb + 8 * tokens + sequence_mask_bytes(run)
    shared += router_loss_bytes(shapes, run, len(layers))
    if run.strategy.layout.sp == 1 and (run.strategy.layout.cp > 1 or (run.packed_documents and run.attention in ("sdpa", "eager"))):
        # boolean, or eager's additive bf16 (toolkit.data.packing.packed_mask)
        mask_bytes = 2 if run.attention == "eager" and run.strategy.layout.cp == 1 else 1
        shared += mask_bytes * run.micro_batch * run.local_seq * run.seq_len
    # autocast's weight copies, saved by the matmuls (under tensor parallel each rank's slice, a router
    # whole; the norms' weights, whole on every rank, are ~1e-4 of a layer). grouped_mm's experts are not cast
    router = shapes.experts * shapes.hidden
    layer_params = (shapes.layer_params - shapes.expert_params - router) // run.strategy.layout.tp + router
    # (made once per step instead: every layer's copy for the whole step, and none in a recompute)
    casts_kept = cb * layer_params * (len(layers) if run.cast_per_step else kept) if casts else 0
    recompute = per_layer - selective + (cb * layer_params if casts and not run.cast_per_step else 0) if ckpt else 0
    # the gradient arriving at a layer and the MLP's intermediate gradients while backward runs through
    # it; under context parallel also the gathered keys' and values' gradients, until reduce-scattered
    inner = 2 * cb * shapes.intermediate // run.strategy.layout.tp
    if shapes.experts:  # not measured: per routed copy the gradients of gate_up's output, the product and the input
        # (expert parallel: of the copies the rank's experts receive, k / tp per token when balanced)
        inner = dtypes(run)[0] * shapes.top_k * (3 * shapes.intermediate + shapes.hidden) / run.strategy.layout.tp
    if run.strategy.layout.sp > 1:
        # or, in the attention's backward, sdpa's gradients of q, k, v (whole sequence, heads / sp) beside
        # the all-to-all's outputs (this rank's tokens, every head), whichever the larger
        inner = max(inner, 2 * cb * (shapes.heads + 2 * max(shapes.kv_heads, run.strategy.layout.sp)) * shapes.head_dim)
    transient = stream * 2 * rb * shapes.hidden + tokens * inner + gathered_kv_bytes(shapes, run)
    return {"saved": int(saved + shared + casts_kept), "recompute": int(recompute), "transient": int(transient)}


def loss_bytes(shapes: Shapes, run: Run, head_trainable: bool) -> dict[str, int]:
    """The output head and the loss: at the end of the forward, and what stays for backward."""
    tokens = run.micro_batch * run.local_seq
    rb, cb, casts = dtypes(run)
    h, v, tp = shapes.hidden, shapes.vocab, run.strategy.layout.tp
    final_norm = stream_tokens(shapes, run) * norm_core_bytes_per_token(shapes, run)  # 1/tp under sequence parallel
    if run.loss_chunk_tokens <= 0:
        # logits in the compute dtype, their fp32 copy and log-softmax (saved); backward: two fp32 gradients.
        # Tensor parallel: the head is colwise_gather_output, so every rank all-gathers the whole logits
        # (its own 1/tp slice beside them while it does) and computes the same loss. Under sequence
        # parallel the head gathers the sequence first, and its cast input is the whole sequence's too
        head_input = tokens * (cb if casts else rb) * h  # the head's matmul keeps its input (autocast's cast of it)
        # Gemma 2's cap after the head (read from its code): the tanh it keeps, beside the capped logits, and
        # in the backward the gradient through the cap
        cap = cb if shapes.logit_softcap else 0
        forward = tokens * v * (cb + cap + 4 + 4) + (tokens * v * cb // tp if tp > 1 else 0)
        return {"forward": final_norm + head_input + forward,
                "kept": final_norm + head_input + tokens * v * (4 + cap), "backward": tokens * v * (12 + 2 * cap)}
    chunk = min(run.loss_chunk_tokens, tokens)
    kept = tokens * h * rb + (4 * v * h if head_trainable else 0)  # d(loss)/d(hidden) and the head's fp32 gradient
    weight_cast = cb * v * h if casts else 0
    cap = 4 if shapes.logit_softcap else 0  # a chunk's tanh(z / c), fp32, for the gradient through the cap
    return {"forward": final_norm + kept + weight_cast + chunk * v * (2 * cb + 4 + cap), "kept": final_norm + kept,
            "backward": 0}
