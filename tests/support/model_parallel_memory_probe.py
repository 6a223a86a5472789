"""Run on 2 ranks with torchrun's variables (gloo, tests/support/probe_ranks.py) by test_estimate.py: what a rank holds under tensor, context
and sequence parallel, for the memory model to be compared with. Rank 0 writes to the JSON file argv[1]:

- "tp": test_estimate.probe_model() split over the 2 ranks (toolkit.strategy.tensor_parallel.split,
  fsdp_tp.yaml's tp 2 x dp_shard 1): this rank's bytes of parameters, of gradients after one backward
  and of AdamW's state after one step (the local shards of the DTensors), and the bytes autograd keeps
  inside decoder layer 1 in a forward under CPU bf16 autocast over the fp32 weights, as the recipe
  trains it (transformers' FSDP2 casts no weights);
- "cp": the same model in bf16 (FSDP2's param_dtype casts the weights so) with its attention routed
  through toolkit.strategy.context_parallel (cp 2): the bytes layer 1 keeps for this rank's half of
  every sequence;
- "sp" (and "sp_kv1" with one key/value head, which DeepSpeed replicates to both ranks): the same model
  in bf16 (DeepSpeed's bf16 mode casts the weights so) with its attention routed through
  toolkit.strategy.sequence_parallel (DeepSpeed Ulysses, sp 2): the bytes layer 1 keeps for this rank's
  half of every sequence, its attention over the whole sequence with half of the heads; the bytes
  layers 0 and 1 keep together, and those of the storages both keep (the whole sequence's mask);
- "ep": a Qwen3-MoE of the same sizes (MOE_CONFIG, 4 experts, top-2) split as "tp" is, its experts spread
  whole over the 2 ranks (expert parallel, ep = tp): this rank's bytes of parameters, of gradients
  after one backward and of AdamW's state after one step, and what layer 1 keeps under bf16 autocast
  (and "ep_fp32" in fp32, "ep_mixtral" a Mixtral of the same sizes under autocast: fp32 routing
  weights), every router forced to balanced routing (`balance_routing`) so that each rank's experts
  receive the same rows in every run.

Saved weights and autocast's copies of them (their shapes, and the experts' 3-D weights transposed as
grouped_mm takes them), and rotary cos/sin (shared by all layers,
counted apart by the model), are left out, as in test_estimate.saved_by_one_layer; the block-causal mask
in the compute dtype that sdpa keeps is counted, in each layer that keeps it.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.overrides import TorchFunctionMode
from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig, Qwen3Config, Qwen3MoeConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from toolkit.strategy.context_parallel import ContextParallel  # noqa: E402
from toolkit.strategy.sequence_parallel import SequenceParallel  # noqa: E402
from toolkit.strategy.tensor_parallel import split  # noqa: E402

BATCH, SEQ = 3, 32
CONFIG = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=SEQ, use_cache=False)  # test_estimate.probe_model's
# tensor parallel with sequence parallel: (model, precision, packed documents)
TP_SEQUENCE_CASES = [("llama", "bf16", False), ("llama", "bf16", True), ("llama", "fp32", False), ("llama", "fp32", True),
                     ("qwen3", "bf16", True)]
MOE_CONFIG = dict(CONFIG, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2, head_dim=32)
MIXTRAL_CONFIG = dict(CONFIG, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, head_dim=32)


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def plain(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor whose storage `t` keeps: a DTensor's shard, and inside it the result of a
    functional collective (AsyncCollectiveTensor, a wrapper without storage of its own: the embedding's
    reduce-scatter under sequence parallel)."""
    while True:
        if hasattr(t, "_local_tensor"):
            t = t._local_tensor
        elif isinstance(t, AsyncCollectiveTensor):
            t = t.elem
        else:
            return t


def nbytes(tensors) -> int:
    return sum(local(t).numel() * local(t).element_size() for t in tensors)


class _AddToLinear(TorchFunctionMode):
    """Adds `bias` to what F.linear returns (a router's forward calls it once: its logits)."""

    def __init__(self, bias: torch.Tensor):
        super().__init__()
        self.bias = bias

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out + self.bias.to(out.dtype) if func is torch.nn.functional.linear else out


def balance_routing(model: torch.nn.Module) -> None:
    """Every router of `model` sends token t (of the flattened batch) to experts t, t + 1, ..., t + k - 1
    (mod E): its logits get +30 there, so its own softmax, top-k and weights run as in training and keep
    what they keep. Each expert then gets T·k/E of the routed copies, and each slice of tokens a rank
    dispatches sends every expert the same number: which rows a rank's experts receive no longer
    depends on the random weights."""
    for layer in model.model.layers:
        router = layer.mlp.gate

        def forward(hidden_states, router=router, own=router.forward):
            tokens = torch.arange(hidden_states.reshape(-1, router.hidden_dim).shape[0])
            chosen = (tokens[:, None] + torch.arange(router.top_k)) % router.num_experts
            bias = torch.zeros(len(tokens), router.num_experts).scatter_(1, chosen, 30.0)
            with _AddToLinear(bias):
                logits, weights, indices = own(hidden_states)
            assert torch.equal(indices.sort(-1).values, chosen.sort(-1).values), "the routing was not forced"
            return logits, weights, indices

        router.forward = forward


def kept_by_layers(model: torch.nn.Module, run_forward, indices=(1,)) -> tuple[torch.Tensor, dict]:
    """(what `run_forward()` returns, for each decoder layer in `indices` (or module, by its name: "lm_head")
    the storages autograd keeps inside it meanwhile: {data pointer: bytes}), their weights (by their local
    shapes) and the rotary cos/sin (by their storage) left out. A storage two layers keep appears under both."""
    layers = {i: model.model.layers[i] if isinstance(i, int) else model.get_submodule(i) for i in indices}
    weights = {tuple(local(p).shape) for layer in layers.values() for p in layer.parameters()}
    weights |= {shape[::-1] for shape in weights} | {shape[:-2] + shape[:-3:-1] for shape in weights if len(shape) == 3}
    rotary: set[int] = set()
    kept: dict[int, dict[int, tuple[int, tuple]]] = {i: {} for i in indices}
    forwards = {i: layer.forward for i, layer in layers.items()}

    def hooked(i):
        def pack(t: torch.Tensor) -> torch.Tensor:
            inner = plain(t)
            storage = inner.untyped_storage()
            kept[i][storage.data_ptr()] = (storage.nbytes(), tuple(inner.shape))
            return t

        def forward(*args, **kwargs):
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                return forwards[i](*args, **kwargs)

        return forward

    for i, layer in layers.items():
        layer.forward = hooked(i)
    hook = model.model.rotary_emb.register_forward_hook(
        lambda module, args, out: rotary.update(t.untyped_storage().data_ptr() for t in out)
    )
    try:
        out = run_forward()
    finally:
        for i, layer in layers.items():
            layer.forward = forwards[i]
        hook.remove()
    return out, {i: {ptr: n for ptr, (n, shape) in kept[i].items() if shape not in weights and ptr not in rotary}
                 for i in indices}


def saved_by_layer(model: torch.nn.Module, run_forward) -> tuple[torch.Tensor, int]:
    """(what `run_forward()` returns, the bytes autograd keeps inside decoder layer 1 meanwhile)."""
    out, kept = kept_by_layers(model, run_forward)
    return out, sum(kept[1].values())


def tensor_parallel(ids: torch.Tensor, config=None, precision: str = "bf16") -> dict:
    torch.manual_seed(0)  # split slices each rank's own copy: the same seed everywhere
    config = config or LlamaConfig(**CONFIG)
    model = split(AutoModelForCausalLM.from_config(config, dtype=torch.float32), dist.get_world_size())
    if getattr(config, "num_experts_per_tok", 0):
        balance_routing(model)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}])

    def forward():
        with torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext():
            return model(input_ids=ids, labels=ids).loss

    loss, saved = saved_by_layer(model, forward)
    loss.backward()
    grads = nbytes(p.grad for p in model.parameters())
    optimizer.step()
    state = sum(nbytes(s.values()) for s in optimizer.state.values())
    return {"params": nbytes(model.parameters()), "grads": grads, "optimizer": state, "saved": saved}


def tensor_parallel_sequence(ids: torch.Tensor, model_type: str, precision: str, packed: bool) -> dict:
    """The same sizes (LLaMA, or Qwen3 with its per-head q/k norms) split as an sdpa run splits it
    (split(..., "sdpa"): Megatron's sequence parallel between the layers), in fp32 or under CPU bf16
    autocast over the fp32 weights; with `packed`, packing's block-causal mask of three documents per
    row (4-D, whole on every rank, as toolkit.data.packing.collate gives sdpa). The bytes autograd keeps
    inside decoder layer 1, inside the final norm and inside the head (its input: the whole sequence)."""
    torch.manual_seed(0)
    config = (LlamaConfig if model_type == "llama" else Qwen3Config)(**CONFIG, head_dim=32)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    model = split(model, dist.get_world_size(), 1, "sdpa")
    inputs = {"input_ids": ids, "labels": ids, "position_ids": torch.arange(SEQ).expand(BATCH, SEQ)}
    if packed:
        documents = torch.arange(SEQ) // 12
        mask = (documents[:, None] == documents[None, :]) & torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
        inputs["attention_mask"] = mask.expand(BATCH, 1, SEQ, SEQ)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()

    def forward():
        with autocast:
            return model(**inputs).loss

    loss, kept = kept_by_layers(model, forward, (1, "model.norm", "lm_head"))
    loss.backward()
    return {"sequence_parallel": model.tp_whole_between_layers is None, "saved": sum(kept[1].values()),
            "final_norm": sum(kept["model.norm"].values()), "head": sum(kept["lm_head"].values())}


def context_parallel(ids: torch.Tensor) -> dict:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG), dtype=torch.bfloat16)
    group = ContextParallel(dist.get_world_size(), torch.device("cpu"))
    group.apply(model)
    shard = group.split({"input_ids": ids, "labels": ids, "position_ids": torch.arange(SEQ).expand(BATCH, SEQ)})
    inputs = {k: shard[k] for k in ("input_ids", "position_ids", "attention_mask")}
    _, saved = saved_by_layer(model, lambda: model.model(**inputs).last_hidden_state)
    return {"saved": saved}


def sequence_parallel(ids: torch.Tensor, kv_heads: int) -> dict:
    torch.manual_seed(0)
    config = LlamaConfig(**{**CONFIG, "num_key_value_heads": kv_heads}, attn_implementation="sdpa")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    group = SequenceParallel(dist.get_world_size(), torch.device("cpu"))
    group.apply(model)
    shard = group.split({"input_ids": ids, "labels": ids, "position_ids": torch.arange(SEQ).expand(BATCH, SEQ)})
    inputs = {k: shard[k] for k in ("input_ids", "position_ids")}
    _, kept = kept_by_layers(model, lambda: model.model(**inputs).last_hidden_state, (0, 1))
    both = {**kept[0], **kept[1]}
    shared = kept[0].keys() & kept[1].keys()
    return {"saved": sum(kept[1].values()), "saved_two_layers": sum(both.values()),
            "shared": sum(both[ptr] for ptr in shared)}


def main(out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    result = {"world": dist.get_world_size(), "batch": BATCH, "seq": SEQ, "tp": tensor_parallel(ids),
              "cp": context_parallel(ids), "sp": sequence_parallel(ids, CONFIG["num_key_value_heads"]),
              "sp_kv1": sequence_parallel(ids, 1), "ep": tensor_parallel(ids, Qwen3MoeConfig(**MOE_CONFIG)),
              "ep_fp32": tensor_parallel(ids, Qwen3MoeConfig(**MOE_CONFIG), "fp32"),
              "ep_mixtral": tensor_parallel(ids, MixtralConfig(**MIXTRAL_CONFIG)),
              "tp_sp": {f"{model_type} {precision} {'packed' if packed else 'unpacked'}":
                        tensor_parallel_sequence(ids, model_type, precision, packed)
                        for model_type, precision, packed in TP_SEQUENCE_CASES}}
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, result)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(ranks))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
