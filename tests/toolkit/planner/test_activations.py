"""Activations saved for backward (toolkit.planner.activations): what one decoder layer keeps, counted by
autograd's saved_tensors_hooks on CPU, equal to the per-token formula (fp32, autocast over fp32 weights,
weights cast to bf16; LLaMA, Qwen3, mixtures of experts), with sdpa's copy of a document mask."""

from __future__ import annotations

import contextlib
import gc
import json
import weakref
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, Qwen3Config

from toolkit.models.compilation import decoder_layers
from toolkit.models.gradient_checkpointing import apply_gradient_checkpointing
from toolkit.parallel_layout import ParallelLayout
from toolkit.planner.activations import Shapes, activation_bytes, layer_bytes, layer_bytes_per_token
from toolkit.planner.facts import Run, StrategyFacts


def facts_of(mode: str) -> StrategyFacts:
    """bf16 weights: FSDP2's mixed-precision policy casts the weights; the other modes run DDP's fp32 weights (or,
    "bf16 base, autocast", a base loaded in bf16 with LoRA's fp32 adapters under autocast)."""
    kind = "fsdp" if mode == "bf16 weights" else "ddp"
    return StrategyFacts(kind, ParallelLayout(kind))


def run_of(mode: str, batch: int, seq: int, attention: str = "sdpa") -> Run:
    return Run(facts_of(mode), 1, batch, seq, precision="fp32" if mode == "fp32" else "bf16", packed_documents=False,
               attention=attention, param_dtype=torch.bfloat16 if mode.startswith("bf16") else torch.float32)


def saved_by_one_layer(config: PretrainedConfig, mode: str, batch: int, seq: int, mask: torch.Tensor | None = None,
                       attn: str = "sdpa", lora=None) -> int:
    """Bytes autograd keeps for backward inside decoder layer 1 (parameters excluded; rotary
    cos/sin, which every layer shares, excluded), with `mask` as the attention mask if given, and `lora` (a peft
    LoraConfig) on the model if given: its adapters fp32 as peft makes them, but under "bf16 weights" (cast with
    the base, as FSDP2 and DeepSpeed do)."""
    dtype = torch.bfloat16 if mode.startswith("bf16") else torch.float32
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    if lora is not None:
        from peft import get_peft_model

        model = get_peft_model(model, lora)
        if mode == "bf16 weights":
            model.to(torch.bfloat16)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, tuple[int, tuple]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = (storage.nbytes(), tuple(t.shape))
        return t

    inner = model.get_base_model() if lora is not None else model
    layer = inner.model.layers[1]
    forward = layer.forward

    def hooked(*args, **kwargs):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return forward(*args, **kwargs)

    layer.forward = hooked
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if "autocast" in mode else contextlib.nullcontext()
    with autocast:
        inner.model(input_ids=torch.randint(0, config.vocab_size, (batch, seq)), attention_mask=mask)
    weights = {tuple(p.shape) for p in layer.parameters()} | {tuple(p.shape)[::-1] for p in layer.parameters()}  # autocast's casts
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rotary = (1, 1, seq, head_dim)
    return sum(n for n, shape in kept.values() if shape not in weights and shape != rotary)


@pytest.mark.parametrize("mode", ["fp32", "autocast", "bf16 weights"])
@pytest.mark.parametrize("sizes", [(256, 1024, 4, 2), (192, 512, 6, 3)])
def test_saved_activations_per_layer_equal_the_formula(mode, sizes):
    hidden, inter, heads, kv = sizes
    config = LlamaConfig(
        vocab_size=128, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=kv, max_position_embeddings=64, use_cache=False,
    )
    batch, seq = 3, 40
    measured = saved_by_one_layer(config, mode, batch, seq)
    with torch.device("meta"):
        shapes = Shapes.of(AutoModelForCausalLM.from_config(config))
    facts = facts_of(mode)
    run = Run(facts, 1, batch, seq, precision="fp32" if mode == "fp32" else "bf16", packed_documents=False)
    assert layer_bytes_per_token(shapes, run) * batch * seq == measured


@pytest.mark.parametrize("mode", ["fp32", "autocast", "bf16 weights"])
@pytest.mark.parametrize("model", ["qwen3", "qwen3_moe 4x2", "qwen3_moe 8x3 norm_topk", "mixtral 4x2", "mixtral 8x3"])
def test_qwen3_and_mixture_of_experts_layers_save_what_the_formula_says(mode, model):
    """Qwen3's per-head q_norm and k_norm (their fp32 inputs, 1/rms and outputs), and a Qwen3-MoE layer:
    the router's fp32 softmax and top-k indices, and per routed copy of a token transformers'
    grouped_mm experts' gathered input, gate_up output, silu, product and down output in the weights'
    dtype (fp32 under autocast: grouped_mm is not autocast), its routing weight and three index vectors;
    Mixtral's the same, its routing weights fp32."""
    from transformers import MixtralConfig, Qwen3MoeConfig

    sizes = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=64, use_cache=False)
    if model == "qwen3":
        config = Qwen3Config(**sizes)
    elif model.startswith("mixtral"):
        experts, top_k = (4, 2) if "4x2" in model else (8, 3)
        config = MixtralConfig(**{**sizes, "intermediate_size": 32 if experts == 4 else 48}, num_local_experts=experts,
                               num_experts_per_tok=top_k)
    else:
        experts, top_k = (4, 2) if "4x2" in model else (8, 3)
        config = Qwen3MoeConfig(**sizes, moe_intermediate_size=32 if experts == 4 else 48, num_experts=experts,
                                num_experts_per_tok=top_k, norm_topk_prob="norm_topk" in model)
    batch, seq = 3, 40
    measured = saved_by_one_layer(config, mode, batch, seq)
    with torch.device("meta"):
        shapes = Shapes.of(AutoModelForCausalLM.from_config(config))
    assert shapes.qk_norm == (not model.startswith("mixtral"))
    assert shapes.experts == (getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 0))
    facts = facts_of(mode)
    run = Run(facts, 1, batch, seq, precision="fp32" if mode == "fp32" else "bf16", packed_documents=False)
    assert layer_bytes(shapes, run) == measured


@pytest.mark.parametrize("mode", ["fp32", "autocast", "bf16 weights"])
@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_the_router_loss_keeps_what_the_estimate_says(mode, model_type):
    """toolkit.models.router.RouterLoss over 3 Qwen3-MoE (or Mixtral) layers: the recorded router logits until the loss,
    then what the loss keeps alive for backward, as large (a softmax of each layer's logits)."""
    from transformers import MixtralConfig, Qwen3MoeConfig

    from toolkit.models.router import RouterLoss
    from toolkit.planner.activations import router_loss_bytes

    sizes = dict(vocab_size=128, hidden_size=64, num_experts_per_tok=3, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, use_cache=False)
    if model_type == "mixtral":
        config = MixtralConfig(**sizes, intermediate_size=32, num_local_experts=8)
    else:
        config = Qwen3MoeConfig(**sizes, intermediate_size=128, moe_intermediate_size=32, num_experts=8)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if mode == "bf16 weights" else torch.float32)
    router = RouterLoss.of(model)
    batch, seq = 3, 40
    saved: list = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(weakref.ref(t))  # what a freed node saved dies with it: only the living are kept
        return t

    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if mode == "autocast" else contextlib.nullcontext()
    with autocast:
        router.start()
        model(input_ids=torch.randint(0, 128, (batch, seq)))
        recorded = sum(t.untyped_storage().nbytes() for t in router._logits)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = router.loss()
    gc.collect()
    assert loss.requires_grad and not router._logits
    kept = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for ref in saved if (t := ref()) is not None}
    with torch.device("meta"):
        shapes = Shapes.of(AutoModelForCausalLM.from_config(config))
    facts = facts_of(mode)
    run = Run(facts, 1, batch, seq, precision="fp32" if mode == "fp32" else "bf16", packed_documents=False)
    compute = 4 if mode == "fp32" else 2
    assert recorded == 3 * batch * seq * 8 * compute
    assert router_loss_bytes(shapes, run, 3) == sum(kept.values()) == recorded + 4 * 8, kept


GEMMA2 = dict(query_pre_attn_scalar=16, sliding_window=64)  # Gemma 2: eager attention (transformers gives it no sdpa)


def small(model_type: str) -> PretrainedConfig:
    from transformers import Gemma2Config

    sizes = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=64, use_cache=False)
    return Gemma2Config(**sizes, **GEMMA2) if model_type == "gemma2" else LlamaConfig(**sizes)


@pytest.mark.parametrize("mode", ["fp32", "autocast", "bf16 weights"])
@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_eager_attention_and_gemma2_layers_save_what_the_formula_says(mode, model_type):
    """Eager attention: q, k and v repeated to every query head, o_proj's input, the softmax's fp32 output and its
    copy in the compute dtype (none in fp32). Gemma 2 also the tanh of its capped scores, and its four norms
    (each keeping its normalised x in fp32; the two after attention and the MLP nothing for a consumer)."""
    config = small(model_type)
    batch, seq = 3, 40
    measured = saved_by_one_layer(config, mode, batch, seq, attn="eager")
    with torch.device("meta"):
        shapes = Shapes.of(AutoModelForCausalLM.from_config(config))
    assert (shapes.sandwich_norms, shapes.attn_softcap, shapes.logit_softcap) == ((model_type == "gemma2",) * 3)
    assert layer_bytes_per_token(shapes, run_of(mode, batch, seq, "eager")) * batch * seq == measured


ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("mode", ["fp32", "autocast", "bf16 weights", "bf16 base, autocast"])
@pytest.mark.parametrize(("model_type", "targets", "dropout"), [
    ("llama", ALL_LINEAR, 0.0), ("llama", ["q_proj", "v_proj"], 0.1), ("gemma2", ["o_proj", "down_proj"], 0.0),
    ("gemma2", ALL_LINEAR, 0.1)])
def test_lora_layers_save_what_the_formula_says(mode, model_type, targets, dropout):
    """A frozen base keeps nothing for its weights (a norm its fp32 input and 1/rms; the MLP gate, activation, up);
    each adapter its input (shared by the adapters of one input where they run in its dtype, its own cast under
    autocast) and its rank-r activation; with dropout its dropped copy and mask, which CPU keeps as noise in the
    copy's dtype where CUDA keeps one byte (the formula's)."""
    from peft import LoraConfig, get_peft_model

    config = small(model_type)
    lora = LoraConfig(r=8, target_modules=targets, lora_dropout=dropout)
    batch, seq = 3, 40
    attn = "eager" if model_type == "gemma2" else "sdpa"
    measured = saved_by_one_layer(config, mode, batch, seq, attn=attn, lora=lora)
    with torch.device("meta"):
        shapes = Shapes.of(get_peft_model(AutoModelForCausalLM.from_config(config), lora))
    assert sorted(shapes.lora) == sorted(targets) and shapes.lora_dropout == (dropout > 0)
    cpu_noise = ((2 if mode == "bf16 weights" else 4) - 1) * sum(d_in for d_in, _, _ in shapes.lora.values())
    expected = layer_bytes_per_token(shapes, run_of(mode, batch, seq, attn)) + (cpu_noise if dropout else 0)
    assert expected * batch * seq == measured


def test_sdpa_with_the_document_mask_keeps_repeated_keys_and_a_mask_copy_in_every_layer():
    """transformers repeats k and v to every query head when sdpa gets a mask (use_gqa_in_sdpa), and
    sdpa converts a boolean mask to the compute dtype in each call and keeps it; an H100 (torch 2.11,
    cuDNN attention) keeps the same tensors."""
    config = LlamaConfig(
        vocab_size=128, hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, use_cache=False,
    )
    batch, seq = 3, 40
    documents = torch.arange(seq) // 16  # three packed documents, each attending to itself only
    mask = (documents[:, None] == documents[None, :]) & torch.ones(seq, seq, dtype=torch.bool).tril()
    measured = saved_by_one_layer(config, "bf16 weights", batch, seq, mask.expand(batch, 1, seq, seq))
    with torch.device("meta"):
        shapes = Shapes.of(AutoModelForCausalLM.from_config(config))
    run = Run(StrategyFacts("fsdp", ParallelLayout("fsdp")), 1, batch, seq)
    assert layer_bytes(shapes, run) == measured
    # beside the unmasked layer: k and v repeated to the 4 query heads, and the mask's bf16 copy
    unmasked = Run(StrategyFacts("fsdp", ParallelLayout("fsdp")), 1, batch, seq, packed_documents=False)
    repeated_kv = 2 * 2 * (4 - 2) * 64 * batch * seq
    assert layer_bytes(shapes, run) - layer_bytes(shapes, unmasked) == repeated_kv + 2 * batch * seq * seq


def held_by_the_forward(config: PretrainedConfig, mode: str, checkpointing: str, batch: int, seq: int, trace: Path) -> int:
    """Bytes a model's forward leaves allocated, its layers compiled: the CPU allocator's running total (torch.profiler's
    memory events) at its end less at its start, after a first step that compiles. Unlike saved_tensors_hooks it
    sees what the compiled graphs and selective checkpointing keep. The backend is inductor's partitioner without
    inductor's code generation: what is kept is the partitioner's choice (measured: the same bytes as inductor's, in
    a third of the time)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if mode == "bf16 weights" else torch.float32,
                                             attn_implementation="sdpa").train()
    apply_gradient_checkpointing(model, checkpointing)
    for layer in decoder_layers(model):
        layer.compile(backend="aot_eager_decomp_partition")
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if mode == "autocast" else contextlib.nullcontext()
    with autocast:
        model(input_ids=ids).logits.float().sum().backward()
    model.zero_grad(set_to_none=True)
    with torch.profiler.profile(profile_memory=True) as profile, autocast:
        logits = model(input_ids=ids).logits
    profile.export_chrome_trace(str(trace))
    del logits
    memory = [e["args"] for e in json.loads(trace.read_text())["traceEvents"] if e.get("name") == "[memory]"]
    return memory[-1]["Total Allocated"] - (memory[0]["Total Allocated"] - memory[0]["Bytes"])


@pytest.mark.parametrize("mode", ["fp32", "autocast", "bf16 weights"])
@pytest.mark.parametrize("checkpointing", ["none", "selective"])
def test_a_compiled_layer_keeps_what_the_compiled_formula_says(mode, checkpointing, tmp_path):
    """model.compile: inductor's partitioner recomputes the pointwise work, so a layer keeps less than eager. What
    one more layer adds to the forward's allocations, against activation_bytes (head_dim 32 x 4 heads = 128 apart
    from the hidden size, 64; no document mask: sdpa keeps what flex attention does)."""
    sizes = dict(vocab_size=128, hidden_size=64, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=32, max_position_embeddings=256, use_cache=False)
    batch, seq = 2, 128
    measured, expected = [], []
    torch._dynamo.reset()  # the layers of both models share one compiled graph; other tests' graphs go
    for layers in (2, 4):
        config = LlamaConfig(**sizes, num_hidden_layers=layers)
        measured.append(held_by_the_forward(config, mode, checkpointing, batch, seq, tmp_path / "trace.json"))
        with torch.device("meta"):
            shapes = Shapes.of(AutoModelForCausalLM.from_config(config))
        run = Run(facts_of(mode), 1, batch, seq, checkpointing=checkpointing, precision="fp32" if mode == "fp32" else "bf16",
                  attention="sdpa", packed_documents=False, compiled=True)
        expected.append(activation_bytes(shapes, run)["saved"])
    # under autocast the estimate counts the norms' weights among the casts, which autocast does not cast
    slack = 2 * 2 * sizes["hidden_size"] * 2 if mode == "autocast" and checkpointing == "none" else 0
    assert abs((measured[1] - measured[0]) - (expected[1] - expected[0])) <= slack, (measured, expected)


def test_weight_copies_made_once_per_step_are_held_for_every_layer_through_recomputation(tmp_path):
    """model.cast_weights=per_step with compiled layers under full recomputation: what the step's copies add to the
    forward's allocations beside autocast's copies at every forward, per layer, against activation_bytes. Autocast's
    copies are made inside each layer's graph and dropped with it; the step's are kept for all the layers. (Eager,
    autocast caches its copies until the forward ends, layers recomputed or not: that is not modelled.)"""
    sizes = dict(vocab_size=128, hidden_size=64, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=256, use_cache=False)
    batch, seq = 2, 64
    measured, expected = {}, {}
    torch._dynamo.reset()
    for cast in ("per_forward", "per_step"):
        for layers in (2, 4):
            config = LlamaConfig(**sizes, num_hidden_layers=layers)
            measured[cast, layers] = held_by_a_step(config, cast, batch, seq, tmp_path / "trace.json")
            with torch.device("meta"):
                shapes = Shapes.of(AutoModelForCausalLM.from_config(config))
            run = Run(facts_of("autocast"), 1, batch, seq, checkpointing="full", attention="sdpa",
                      packed_documents=False, compiled=True, cast_per_step=cast == "per_step")
            expected[cast, layers] = activation_bytes(shapes, run)["saved"]

    def per_two_layers(bytes_):
        return (bytes_["per_step", 4] - bytes_["per_step", 2]) - (bytes_["per_forward", 4] - bytes_["per_forward", 2])

    copies = 2 * 2 * (4 * 64 * 48 + 3 * 64 * 192)  # bf16 q, k, v, o, gate, up and down of two layers
    assert per_two_layers(measured) == copies, measured
    # the estimate counts the norms' weights among the copies (two 64-wide norms a layer)
    assert per_two_layers(expected) == copies + 2 * 2 * 2 * 64, expected


def held_by_a_step(config: PretrainedConfig, cast: str, batch: int, seq: int, trace: Path) -> int:
    """Bytes allocated at the end of the forward of a second step (the first compiles), fully recomputed layers
    compiled by inductor's partitioner (as held_by_the_forward), the step's weight copies included."""
    from toolkit.models.weight_cast import WeightCast

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").train()
    apply_gradient_checkpointing(model, "full")
    copies = WeightCast(model, torch.bfloat16) if cast == "per_step" else None
    for layer in decoder_layers(model):
        layer.compile(backend="aot_eager_decomp_partition")
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    for profiled in (False, True):
        step = copies.step() if copies else contextlib.nullcontext()
        with (torch.profiler.profile(profile_memory=True) if profiled else contextlib.nullcontext()) as profile, \
                step, torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=ids).logits
            marker = torch.empty(12345, dtype=torch.uint8)  # the forward's end, before the step's copies go
            if not profiled:
                logits.float().sum().backward()
        del logits, marker
        model.zero_grad(set_to_none=True)
    profile.export_chrome_trace(str(trace))
    memory = [e["args"] for e in json.loads(trace.read_text())["traceEvents"] if e.get("name") == "[memory]"]
    end = next(m for m in memory if m["Bytes"] == 12345)
    return end["Total Allocated"] - end["Bytes"] - (memory[0]["Total Allocated"] - memory[0]["Bytes"])


def test_lora_on_some_layers_is_read_from_the_first_adapted_one():
    """adapter.layers: the adapters of the first adapted layer, priced on every layer (more than the others keep),
    never the full fine-tune's formula a layer without adapters would give."""
    from peft import LoraConfig, get_peft_model

    with torch.device("meta"):
        model = get_peft_model(AutoModelForCausalLM.from_config(small("llama")),
                               LoraConfig(r=8, target_modules=["q_proj", "v_proj"], layers_to_transform=[1]))
    assert sorted(Shapes.of(model).lora) == ["q_proj", "v_proj"]
