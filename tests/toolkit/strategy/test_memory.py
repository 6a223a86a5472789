"""The memory model against what is really allocated.

- Model state: per-rank bytes of parameters, gradients, optimizer state and fp32 masters, from
  the live tensors of a real launch (conftest.py's sharding probe, every strategy at 2 and 3
  ranks), equal to the estimate within 1 %.
- Activations: what one decoder layer saves for backward, counted by autograd's
  saved_tensors_hooks on CPU, equal to the per-token formula (fp32, autocast over fp32 weights,
  weights cast to bf16; two shapes, grouped KV heads), with sdpa's copy of a document mask.
- Tensor, context, sequence and expert parallel on 2 CPU processes (model_parallel_memory_probe.py): a
  rank's model state split by transformers' plan, and what one layer keeps (a mixture of experts' with
  its routing forced balanced), equal to the estimate; under
  sequence parallel (zero3_sp.yaml, launched as shipped by the sharding probe) ZeRO-3's state.
- Pipeline parallel on 2 CPU processes (pipeline_memory_probe.py): each stage's parameters, gradients,
  AdamW state and torch's receive buffers, equal to the estimate for that stage.
- GPU peaks measured on an H100 (tests/toolkit/strategy/gpu_memory_points.json): within 15 %.
"""

from __future__ import annotations

import contextlib
import gc
import json
import weakref
from pathlib import Path

import probe_ranks
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, Qwen3Config

from toolkit.config import UserError, load_config
from toolkit.models.scratch import hf_config
from toolkit.strategy.memory import (
    Run,
    Shapes,
    StrategyFacts,
    estimate,
    layer_bytes,
    layer_bytes_per_token,
    live_facts,
    loss_bytes,
    model_tensors,
    norm_core_bytes_per_token,
    pipeline_stages,
    read_strategy,
    receive_buffers,
    sequence_mask_bytes,
    stage_tensors,
    state_bytes,
    stream_tokens,
)
from toolkit.training.recipe_config import PretrainConfig

ROOT = Path(__file__).resolve().parents[3]
POINTS = json.loads(Path(__file__).with_name("gpu_memory_points.json").read_text())
STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")


PROBE_SIZES = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, max_position_embeddings=32, use_cache=False)


def probe_model(config_class=LlamaConfig) -> torch.nn.Module:
    """tests/toolkit/strategy/sharding_probe.py's model (or another architecture of its sizes), on the
    meta device."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config_class(**PROBE_SIZES))


@pytest.mark.distributed
@pytest.mark.parametrize(("strategy", "nproc"), [
    # DDP replicates: 3 ranks hold what 2 do. ZeRO-1 partitions its optimizer state as ZeRO-2 does (one
    # DeepSpeed optimizer for both stages): zero2 at 3 checks the padding of an odd partition for both.
    (s, n) for s in STRATEGIES for n in (2, 3) if (s, n) not in {("ddp", 3), ("zero1", 3)}
])
def test_model_state_per_rank_equals_the_live_tensors(sharding_probe, matrix_sharding, strategy, nproc):
    # at 2 processes the strategy matrix's run (its tied-embedding LLaMA), at 3 the sharding probe's model
    measured = matrix_sharding(strategy) if nproc == 2 else sharding_probe(strategy, nproc)
    model = measured["model"] if nproc == 2 else probe_model()
    run = Run(read_strategy(ROOT / f"accelerate_configs/{strategy}.yaml", model.config.hidden_size), nproc, 2, 32,
              precision="fp32")
    estimated = state_bytes(model_tensors(model), run)
    for key in ("params", "grads", "optimizer", "master"):
        real = max(rank[key] for rank in measured["ranks"])
        assert estimated[key] == pytest.approx(real, rel=0.01, abs=8), f"{strategy}@{nproc} {key}: {estimated[key]} vs {real}"


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["fsdp", "zero2", "zero3"])
def test_a_mixture_of_experts_model_state_per_rank_equals_the_live_tensors(sharding_probe, strategy):
    """The sharding probe's Qwen3-MoE (4 experts of 3-D weights, the router) at 2 ranks: FSDP2 shards each
    expert tensor by its first dimension (the experts), ZeRO flattens it, as any tensor."""
    from transformers import Qwen3MoeConfig

    measured = sharding_probe(strategy, 2, "qwen3_moe")
    sizes = {k: v for k, v in probe_model().config.to_dict().items() if k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "max_position_embeddings")}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**sizes, moe_intermediate_size=64, num_experts=4,
                                                                num_experts_per_tok=2, head_dim=32, use_cache=False))
    run = Run(read_strategy(ROOT / f"accelerate_configs/{strategy}.yaml", 128), 2, 2, 32, precision="fp32")
    estimated = state_bytes(model_tensors(model), run)
    assert measured["n_params"] == sum(p.numel() for p in model.parameters())
    for key in ("params", "grads", "optimizer", "master"):
        assert [rank[key] for rank in measured["ranks"]] == [estimated[key]] * 2, key


def saved_by_one_layer(config: PretrainedConfig, mode: str, batch: int, seq: int, mask: torch.Tensor | None = None) -> int:
    """Bytes autograd keeps for backward inside decoder layer 1 (parameters excluded; rotary
    cos/sin, which every layer shares, excluded), with `mask` as the attention mask if given."""
    dtype = torch.bfloat16 if mode == "bf16 weights" else torch.float32
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, tuple[int, tuple]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = (storage.nbytes(), tuple(t.shape))
        return t

    layer = model.model.layers[1]
    forward = layer.forward

    def hooked(*args, **kwargs):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return forward(*args, **kwargs)

    layer.forward = hooked
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if mode == "autocast" else contextlib.nullcontext()
    with autocast:
        model.model(input_ids=torch.randint(0, config.vocab_size, (batch, seq)), attention_mask=mask)
    weights = {tuple(p.shape) for p in layer.parameters()} | {tuple(p.shape)[::-1] for p in layer.parameters()}  # autocast's casts
    rotary = (1, 1, seq, config.hidden_size // config.num_attention_heads)
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
    facts = StrategyFacts("fsdp" if mode == "bf16 weights" else "ddp", "fsdp" if mode == "bf16 weights" else "ddp")
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
    from transformers import MixtralConfig, Qwen3Config, Qwen3MoeConfig

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
    facts = StrategyFacts("fsdp" if mode == "bf16 weights" else "ddp", "fsdp" if mode == "bf16 weights" else "ddp")
    run = Run(facts, 1, batch, seq, precision="fp32" if mode == "fp32" else "bf16", packed_documents=False)
    assert layer_bytes(shapes, run) == measured


@pytest.mark.parametrize("mode", ["fp32", "autocast", "bf16 weights"])
@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_the_router_loss_keeps_what_the_estimate_says(mode, model_type):
    """toolkit.models.router.RouterLoss over 3 Qwen3-MoE (or Mixtral) layers: the recorded router logits until the loss,
    then what the loss keeps alive for backward, as large (a softmax of each layer's logits)."""
    from transformers import MixtralConfig, Qwen3MoeConfig

    from toolkit.models.router import RouterLoss
    from toolkit.strategy.memory import router_loss_bytes

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
    facts = StrategyFacts("fsdp" if mode == "bf16 weights" else "ddp", "fsdp" if mode == "bf16 weights" else "ddp")
    run = Run(facts, 1, batch, seq, precision="fp32" if mode == "fp32" else "bf16", packed_documents=False)
    compute = 4 if mode == "fp32" else 2
    assert recorded == 3 * batch * seq * 8 * compute
    assert router_loss_bytes(shapes, run, 3) == sum(kept.values()) == recorded + 4 * 8, kept


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
    run = Run(StrategyFacts("fsdp", "fsdp"), 1, batch, seq)
    assert layer_bytes(shapes, run) == measured
    # beside the unmasked layer: k and v repeated to the 4 query heads, and the mask's bf16 copy
    unmasked = Run(StrategyFacts("fsdp", "fsdp"), 1, batch, seq, packed_documents=False)
    repeated_kv = 2 * 2 * (4 - 2) * 64 * batch * seq
    assert layer_bytes(shapes, run) - layer_bytes(shapes, unmasked) == repeated_kv + 2 * batch * seq * seq


@pytest.mark.distributed
def test_tensor_context_and_sequence_parallel_ranks_hold_what_the_estimate_says(tmp_path):
    """tp 2 (fsdp_tp.yaml as shipped): parameters, gradients and AdamW state cut by transformers' plan,
    and a layer's activations with 1/tp of the heads and MLP width beside the whole residual stream
    (autocast over fp32 weights) under transformers' plan (what flex or flash attention gets). Under
    sdpa, Megatron's sequence parallel (LLaMA and Qwen3, fp32 and autocast, with and without packing's
    mask): the norms keep half of the tokens, attention and MLP their gathered whole-sequence input (one
    autocast cast per projection, or the one gathered tensor in fp32) and 1/tp of the heads and width;
    with one key/value head per rank repeat_kv is a view (only autocast's cast of k copies it out); the
    final norm keeps half of the tokens and the head its whole-sequence input. cp 2 (fsdp_cp.yaml): a layer keeps its half of the tokens and the
    whole sequence's gathered keys and values. sp 2 (zero3_sp.yaml): a layer keeps its half of the
    tokens outside attention, and inside it q, k, v and sdpa's output for the whole sequence and half
    of the heads and o_proj's own input; with one key/value head (replicated to both ranks) as much as
    with two. The whole sequence's bf16 mask is one tensor that layers 0 and 1 both keep, counted once.
    ep 2 (a Qwen3-MoE under fsdp_tp.yaml): each rank holds half of the experts whole; with the routing
    forced balanced, a layer keeps the router's tensors for every token and, per routed copy, what the
    rank sends (its half of the tokens) and what its experts receive (half of all the copies), under
    autocast and in fp32, and for Mixtral (fp32 routing weights)."""
    out = tmp_path / "ranks.json"
    proc = probe_ranks.run(Path(__file__).with_name("model_parallel_memory_probe.py"), [out], nproc=2, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    ranks = json.loads(out.read_text())
    world, batch, seq = ranks[0]["world"], ranks[0]["batch"], ranks[0]["seq"]
    model = probe_model()
    shapes = Shapes.of(model)

    tp = Run(read_strategy(ROOT / "accelerate_configs/fsdp_tp.yaml", 128), world, batch, seq, precision="fp32")
    held = state_bytes(model_tensors(model), tp)
    for key in ("params", "grads", "optimizer"):
        assert held[key] == max(rank["tp"][key] for rank in ranks), key
    whole = state_bytes(model_tensors(model), Run(StrategyFacts("ddp", "ddp"), 1, batch, seq, precision="fp32"))
    assert held["params"] > whole["params"] / 2, "the norms stay whole on every rank"

    # the probe's "tp" is split by transformers' plan and runs sdpa without a mask, which keeps what flex keeps
    tp_autocast = Run(tp.strategy, world, batch, seq, precision="bf16", packed_documents=False, attention="flex_attention")
    assert [rank["tp"]["saved"] for rank in ranks] == [layer_bytes(shapes, tp_autocast)] * world
    for case in ranks[0]["tp_sp"]:
        model_type, precision, packed = case.split()
        case_shapes = Shapes.of(probe_model(LlamaConfig if model_type == "llama" else Qwen3Config))
        run = Run(tp.strategy, world, batch, seq, precision=precision, packed_documents=packed == "packed")
        final_norm = stream_tokens(case_shapes, run) * norm_core_bytes_per_token(case_shapes, run)
        head_input = loss_bytes(case_shapes, run, True)["kept"] - final_norm - batch * seq * 512 * 4  # less the fp32 log-softmax
        for rank in ranks:
            got = rank["tp_sp"][case]
            assert got["sequence_parallel"], case
            assert (got["saved"], got["final_norm"], got["head"]) == (layer_bytes(case_shapes, run), final_norm, head_input), case
    assert stream_tokens(shapes, Run(tp.strategy, world, batch, seq)) == batch * seq // 2
    # beside transformers' plan, the two norms keep half of the tokens
    unpacked = ranks[0]["tp_sp"]["llama bf16 unpacked"]["saved"]
    assert ranks[0]["tp"]["saved"] - unpacked == 2 * norm_core_bytes_per_token(shapes, tp_autocast) * batch * seq // 2
    cp = Run(read_strategy(ROOT / "accelerate_configs/fsdp_cp.yaml", 128), world, batch, seq, precision="bf16")
    assert [rank["cp"]["saved"] for rank in ranks] == [layer_bytes(shapes, cp)] * world

    sp = Run(read_strategy(ROOT / "accelerate_configs/zero3_sp.yaml", 128), world, batch, seq, precision="bf16")
    mask = sequence_mask_bytes(sp)
    assert mask == 2 * batch * seq * seq
    with torch.device("meta"):
        one_kv = Shapes.of(AutoModelForCausalLM.from_config(LlamaConfig(**{**probe_model().config.to_dict(),
                                                                          "num_key_value_heads": 1})))
    for case, case_shapes in (("sp", shapes), ("sp_kv1", one_kv)):
        assert [rank[case]["saved"] for rank in ranks] == [layer_bytes(case_shapes, sp) + mask] * world, case
        assert [rank[case]["shared"] for rank in ranks] == [mask] * world, case
        assert [rank[case]["saved_two_layers"] for rank in ranks] == [2 * layer_bytes(case_shapes, sp) + mask] * world, case
    assert layer_bytes(one_kv, sp) == layer_bytes(shapes, sp)
    whole = Run(StrategyFacts("zero3", "deepspeed", zero_stage=3), 1, batch, seq, precision="bf16", packed_documents=False)
    halves = 2 * batch * seq // 2 * 128  # o_proj's bf16 input, apart from sdpa's output, for this rank's tokens
    assert layer_bytes(shapes, sp) == pytest.approx(layer_bytes(shapes, whole) / 2 + halves, abs=8)

    # a Qwen3-MoE split over the same 2 ranks (the probe's MOE_CONFIG): its experts spread whole (2 of 4 on
    # each), the router whole
    from transformers import MixtralConfig, Qwen3MoeConfig

    with torch.device("meta"):
        moe = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**PROBE_SIZES, moe_intermediate_size=64, num_experts=4,
                                                              num_experts_per_tok=2))
        mixtral = AutoModelForCausalLM.from_config(MixtralConfig(**{**PROBE_SIZES, "intermediate_size": 64},
                                                                 num_local_experts=4, num_experts_per_tok=2))
    moe_held = state_bytes(model_tensors(moe), tp)
    for key in ("params", "grads", "optimizer"):
        assert [rank["ep"][key] for rank in ranks] == [moe_held[key]] * world, key
    experts = sum(p.numel() for name, p in moe.named_parameters() if ".experts." in name)
    whole = state_bytes(model_tensors(moe), Run(StrategyFacts("ddp", "ddp"), 1, batch, seq, precision="fp32"))
    assert whole["params"] - moe_held["params"] > 4 * experts / 2, "half of the experts, and half of the attention"
    # what its layer 1 keeps, the routing forced balanced: the router's tensors for every token, the copies of
    # the rank's half of the tokens it sends, and the half of all the copies its experts receive
    for case, case_model, precision in (("ep", moe, "bf16"), ("ep_fp32", moe, "fp32"), ("ep_mixtral", mixtral, "bf16")):
        run = Run(tp.strategy, world, batch, seq, precision=precision, packed_documents=False)
        assert [rank[case]["saved"] for rank in ranks] == [layer_bytes(Shapes.of(case_model), run)] * world, case
    one = Run(StrategyFacts("ddp", "ddp"), 1, batch, seq, precision="bf16", packed_documents=False)
    assert ranks[0]["ep"]["saved"] < layer_bytes(Shapes.of(moe), one), "half of the heads and of the routed copies"


@pytest.mark.distributed
def test_sequence_parallel_model_state_is_zero3s_over_every_rank(sharding_probe):
    """zero3_sp.yaml as shipped (sp 2 x dp_shard 1), one step with the attention split by Ulysses: each
    rank holds ZeRO-3's partition over both ranks, the weights not split by sequence parallel."""
    measured = sharding_probe("zero3_sp", 2)
    run = Run(read_strategy(ROOT / "accelerate_configs/zero3_sp.yaml", 128), 2, 2, 32, precision="fp32")
    estimated = state_bytes(model_tensors(probe_model()), run)
    for key in ("params", "grads", "optimizer", "master"):
        assert [rank[key] for rank in measured["ranks"]] == [estimated[key]] * 2, key


@pytest.mark.distributed
def test_pipeline_stages_hold_what_the_estimate_says(tmp_path):
    """2 stages of a 3-layer tied LLaMA (fp32): stage 0 holds layers 0-1 and the embedding, stage 1 layer 2,
    the final norm and the head (the tied embedding's copy); each its weights, gradients and AdamW state
    whole, and a receive buffer per micro-batch of the step. The estimate is the larger stage's."""
    out = tmp_path / "stages.json"
    proc = probe_ranks.run(Path(__file__).with_name("pipeline_memory_probe.py"), [out], nproc=2)
    assert proc.returncode == 0, proc.stdout[-4000:]
    ranks = sorted(json.loads(out.read_text()), key=lambda r: r["stage"])
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=32, use_cache=False, tie_word_embeddings=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    first = ranks[0]
    run = Run(StrategyFacts("pipeline", "ddp", stages=2), 2, first["batch"], first["seq"],
              accumulation=first["micro_batches"], precision="fp32")
    stages = pipeline_stages(3, 2, run.accumulation)
    assert [(list(st.layers), st.in_flight) for st in stages] == [([0, 1], 2), ([2], 1)]
    tensors = model_tensors(model)
    for stage, rank in zip(stages, ranks, strict=True):
        held = state_bytes(stage_tensors(model, tensors, stage), run)
        for key in ("params", "grads", "optimizer"):
            assert held[key] == rank[key], f"stage {stage.index} {key}"
        assert receive_buffers(Shapes.of(model), run, stage) == rank["buffers"], f"stage {stage.index}"
    embedding = 512 * 128 * 4
    assert ranks[0]["params"] + ranks[1]["params"] == state_bytes(tensors, run)["params"] + embedding, \
        "the tied embedding/head counted on both ends"
    worst = estimate(model, run)
    assert worst.parts["params"] == ranks[worst.stage]["params"]


def llama_1b() -> torch.nn.Module:
    cfg = load_config(PretrainConfig, ROOT / "recipes/configs/pretrain_llama_1b.yaml", [])
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config(cfg.model, cfg.tokenizer.vocab_size, 0, None))


@pytest.mark.parametrize("point", POINTS["points"], ids=lambda p: f"{p['strategy']}-mb{p['micro_batch']}-{p['checkpointing']}")
def test_gpu_peaks_within_15_percent(point):
    model = llama_1b()
    facts = read_strategy(ROOT / f"accelerate_configs/{point['strategy']}.yaml", model.config.hidden_size)
    run = Run(
        facts, point["world"], point["micro_batch"], point["seq_len"], accumulation=point["accumulation"],
        checkpointing=point["checkpointing"], attention=point["attention"], loss_chunk_tokens=point["loss_chunk_tokens"],
    )
    est = estimate(model, run)
    measured = point["max_memory_allocated_mb"] * 1e6
    assert abs(est.peak_bytes / measured - 1) <= 0.15, f"{est.peak_bytes / 1e6:,.0f} MB estimated ({est.parts}), {measured / 1e6:,.0f} measured"


def test_the_shipped_configs_read_as_their_strategies():
    facts = {p.stem: read_strategy(p, 2048) for p in (ROOT / "accelerate_configs").glob("*.yaml")}
    assert facts["ddp"].kind == "ddp" and facts["fsdp"].kind == "fsdp"
    assert [facts[f"zero{n}"].zero_stage for n in (1, 2, 3)] == [1, 2, 3]
    assert facts["zero3"].reduce_bucket == 2048 * 2048, "Accelerate fills reduce_bucket_size=auto with hidden^2"
    assert facts["zero3"].persistence_threshold == 10 * 2048
    assert facts["zero3_offload"].offload_optimizer and not facts["zero3"].offload_optimizer
    assert (facts["fsdp_cp"].kind, facts["fsdp_cp"].cp, facts["fsdp_cp"].tp) == ("fsdp", 2, 1)
    assert (facts["fsdp_tp"].kind, facts["fsdp_tp"].cp, facts["fsdp_tp"].tp) == ("fsdp", 1, 2)
    assert (facts["zero3_sp"].kind, facts["zero3_sp"].zero_stage, facts["zero3_sp"].sp) == ("deepspeed", 3, 2)
    assert all(f.sp == 1 for name, f in facts.items() if not name.endswith("_sp"))


def test_sharding_divides_what_a_rank_holds():
    """At 8 ranks ZeRO-3 and FSDP2 hold 1/8 of every part of their 1-rank layout; ZeRO-1 of the optimizer's only."""
    tensors = model_tensors(llama_1b())

    def held(strategy: str, world: int) -> dict[str, int]:
        facts = read_strategy(ROOT / f"accelerate_configs/{strategy}.yaml", 2048)
        return state_bytes(tensors, Run(facts, world, 8, 2048, precision="fp32"))

    for strategy in ("zero3", "fsdp"):
        one, eight = held(strategy, 1), held(strategy, 8)
        for key in ("params", "grads", "optimizer", "master"):
            assert eight[key] == pytest.approx(one[key] / 8, rel=0.01), f"{strategy} {key}"
    one, eight = held("zero1", 1), held("zero1", 8)
    assert eight["params"] == one["params"] and eight["optimizer"] == pytest.approx(one["optimizer"] / 8, rel=0.01)


def test_checkpointing_and_micro_batch_move_the_peak_the_right_way():
    model = llama_1b()
    facts = read_strategy(ROOT / "accelerate_configs/ddp.yaml", 2048)

    def peak(ckpt: str, mb: int) -> int:
        return estimate(model, Run(facts, 1, mb, 2048, accumulation=2, checkpointing=ckpt)).peak_bytes

    assert peak("full", 8) < peak("every_k", 8) < peak("none", 8)
    assert peak("none", 4) < peak("none", 8)


def test_an_architecture_it_does_not_model_is_refused():
    from transformers import GPT2Config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(GPT2Config(n_layer=2, n_embd=64, n_head=4))
    with pytest.raises(UserError, match="LLaMA-style"):
        Shapes.of(model)


# ---------------------------------------------------------------- a model the machine cannot hold (issue 26)
def launched(kind: str = "single", world: int = 1, device: str = "cpu", precision: str = "no", zero_stage=None,
             offload_optimizer: bool = False, offload_params: bool = False, name: str = "single process"):
    """What check_fits reads of a launched toolkit.strategy.distributed.Strategy."""
    from types import SimpleNamespace

    ds = SimpleNamespace(deepspeed_config={"zero_optimization": {"offload_param": {"device": "cpu"}}}
                         if offload_params else {})
    fsdp = SimpleNamespace(cpu_offload=SimpleNamespace(offload_params=offload_params))
    accelerator = SimpleNamespace(mixed_precision=precision, state=SimpleNamespace(deepspeed_plugin=ds, fsdp_plugin=fsdp))
    return SimpleNamespace(accelerator=accelerator, kind=kind, name=name, zero_stage=zero_stage,
                           offloads_optimizer=offload_optimizer, cp=1, tp=1, sp=1, stages=1, world_size=world,
                           device=torch.device(device))


def meta_llama(**sizes) -> torch.nn.Module:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=4096, **sizes))


def test_a_model_whose_training_state_exceeds_the_machine_is_refused(monkeypatch):
    """The 6.5B default LLaMA on one CPU process of a 20 GB machine: ~104 GB of weights, gradients and
    AdamW state (16 bytes a parameter in fp32), refused in one line that says what to do."""
    import psutil

    from toolkit.strategy.memory import check_fits, training_state_bytes

    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("vm", (), {"available": 20e9})())
    model = meta_llama()
    n = sum(p.numel() for p in model.parameters())
    # 4 bytes of weight, gradient and each AdamW moment per parameter, + a 4-byte step per tensor
    assert 0 < training_state_bytes(model, live_facts(launched()), 1, "fp32") - 16 * n < 4 * 1000
    with pytest.raises(UserError) as err:
        check_fits(model, launched(), "model.config (llama)")
    assert str(err.value) == (
        "model.config (llama) has 6.5B parameters; training it needs ~104 GB per process under single process "
        "(weights, gradients and AdamW state, before activations) and this machine has 20 GB available; pick a "
        "smaller model, shard it over more GPUs or machines under zero3 or fsdp, or see python recipes/plan.py")
    check_fits(meta_llama(hidden_size=512, intermediate_size=1024, num_hidden_layers=4), launched(), "small")
    # the processes of one node share its memory: 2 of a 1.3 GB-state model do not fit in 2 GB
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("vm", (), {"available": 2e9})())
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(UserError, match=r"this machine has \(for 2 processes\) 2 GB available"):
        check_fits(meta_llama(hidden_size=1024, intermediate_size=2048, num_hidden_layers=6), launched("ddp", 2), "m")


def test_on_a_gpu_the_free_device_memory_decides_as_the_strategy_shards(monkeypatch):
    """The shipped 1B config fits an 80 GB GPU under DDP (~20 GB of state); an 8B fits 8 GPUs under ZeRO-3
    but not DDP; optimizer state offloaded to the CPU is not counted against the GPU."""
    from toolkit.strategy.memory import check_fits

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (79e9, 80e9))
    check_fits(llama_1b(), launched("ddp", 8, "cuda", "bf16", name="DDP"), "1b")
    eight_b = meta_llama(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_key_value_heads=8)
    with pytest.raises(UserError, match=r"has 7\.0B parameters; training it needs ~112 GB per process under DDP"):
        check_fits(eight_b, launched("ddp", 8, "cuda", "bf16", name="DDP"), "8b")
    check_fits(eight_b, launched("deepspeed", 8, "cuda", "bf16", zero_stage=3, name="zero3"), "8b")
    with pytest.raises(UserError, match="this GPU has 79 GB available"):
        check_fits(eight_b, launched("deepspeed", 1, "cuda", "bf16", zero_stage=3, name="zero3"), "8b")
    check_fits(eight_b, launched("deepspeed", 1, "cuda", "bf16", zero_stage=3, offload_optimizer=True,
                                 offload_params=True, name="zero3_offload"), "8b")
    check_fits(eight_b, launched("fsdp", 1, "cuda", "bf16", offload_params=True, name="fsdp_offload"), "8b")
