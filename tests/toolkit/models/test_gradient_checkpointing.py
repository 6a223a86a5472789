"""Gradient checkpointing: same gradients, far fewer activations kept for the backward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from toolkit.config.errors import UserError
from toolkit.models.gradient_checkpointing import apply_gradient_checkpointing
from toolkit.parallel_layout import ParallelLayout
from toolkit.planner.activations import Shapes, selective_bytes_per_token
from toolkit.planner.facts import Run, StrategyFacts

# Sizes where layer activations dominate what the forward saves (4 layers, seq 256, FFN 4x).
SIZES = dict(
    num_hidden_layers=4, hidden_size=64, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2
)
BATCH, SEQ = 2, 256


def make_model(tiny_model, mode: str) -> torch.nn.Module:
    model = tiny_model("llama", seed=0, **SIZES)
    apply_gradient_checkpointing(model, mode, every_k=2)
    return model.train()


def run(tiny_model, mode: str):
    """Forward + backward; returns (saved-activation bytes in the forward, loss, grads)."""
    model = make_model(tiny_model, mode)
    ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = max(saved.get(storage.data_ptr(), 0), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(input_ids=ids).logits
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
    )
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return sum(saved.values()), loss.detach(), grads


def held_after_forward(tiny_model, mode: str, trace: Path) -> int:
    """Bytes the forward leaves allocated (what the backward will read, logits included): the CPU
    allocator's running total ("Total Allocated" of torch.profiler's memory events) at the end of the
    forward less at its start. Unlike autograd's saved_tensors_hooks it sees what selective
    checkpointing keeps in its own cache."""
    model = make_model(tiny_model, mode)
    ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.profiler.profile(profile_memory=True) as profile:
        logits = model(input_ids=ids).logits
    profile.export_chrome_trace(str(trace))
    del logits
    memory = [e["args"] for e in json.loads(trace.read_text())["traceEvents"] if e.get("name") == "[memory]"]
    return memory[-1]["Total Allocated"] - (memory[0]["Total Allocated"] - memory[0]["Bytes"])


@pytest.fixture(scope="module")
def runs(tiny_model):
    return {mode: run(tiny_model, mode) for mode in ("none", "full", "every_k", "selective")}


@pytest.mark.parametrize("mode", ["full", "every_k", "selective"])
def test_same_gradients(runs, mode):
    _, loss_ref, grads_ref = runs["none"]
    _, loss, grads = runs[mode]
    # recomputation runs the same forward kernels on the same inputs; only the backward's sums may
    # group otherwise: u sqrt(K) = 1e-6 of the scale (u = 2^-24, K = 300 the tiny vocabulary), x 4 as
    # in test_loss.py's assert_same_grads. Measured: equal to the bit
    torch.testing.assert_close(loss, loss_ref, rtol=4e-6, atol=0)
    assert grads.keys() == grads_ref.keys()
    for name in grads_ref:
        assert grads_ref[name].abs().sum() > 0, name  # every parameter actually gets a gradient
        scale = grads_ref[name].abs().max().item()
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=0, atol=4e-6 * scale, msg=name)


def test_full_saves_at_least_3x_less(runs):
    none, full = runs["none"][0], runs["full"][0]
    assert none >= 3 * full, f"none saved {none} bytes, full {full}"


def test_every_k_is_in_between(runs):
    none, full, every_k = runs["none"][0], runs["full"][0], runs["every_k"][0]
    assert full < every_k < none, (none, every_k, full)
    # k=2 on 4 identical layers checkpoints 2 of them: half of what full checkpointing saves
    midpoint = (none + full) / 2
    assert abs(every_k - midpoint) < 0.1 * (none - full), (none, every_k, full)


def test_none_leaves_model_alone(tiny_model):
    assert not make_model(tiny_model, "none").is_gradient_checkpointing
    assert make_model(tiny_model, "full").is_gradient_checkpointing


def test_non_reentrant(tiny_model):
    """Non-reentrant checkpointing (needed by ZeRO-3/FSDP) also supports torch.autograd.grad."""
    model = make_model(tiny_model, "full")
    ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids).logits.float().square().mean()
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params)  # the reentrant variant raises here
    assert all(g is not None for g in grads)


def test_unknown_mode_raises(tiny_model):
    model = tiny_model("llama", seed=0)
    with pytest.raises(ValueError, match="use none, full, every_k, selective"):
        apply_gradient_checkpointing(model, "some")
    assert not model.is_gradient_checkpointing


def test_selective_wraps_each_decoder_layer_and_needs_one(tiny_model):
    import copy

    model = make_model(tiny_model, "selective")
    twin = copy.deepcopy(model)  # the wrapped forward is bound to its own layer in a copy too
    assert all(layer.forward.__self__ is layer for layer in twin.model.layers)
    bare = tiny_model("llama", seed=0)
    bare._no_split_modules = []
    with pytest.raises(UserError, match="names no decoder layer class.*set model.gradient_checkpointing=full"):
        apply_gradient_checkpointing(bare, "selective")


def test_selective_keeps_the_matmul_and_attention_outputs_the_planner_counts(tiny_model, tmp_path):
    """Between full (the layers' inputs) and none: per layer and token, the outputs of q, k, v, o_proj, gate, up
    and down and sdpa's output and log-sum-exp (toolkit.planner.activations.selective_bytes_per_token), to the
    byte. Measured: none 14.2 MB, selective 8.4, full 1.6 (logits and the layers' inputs in all three)."""
    held = {mode: held_after_forward(tiny_model, mode, tmp_path / f"{mode}.json") for mode in ("none", "full", "selective")}
    assert held["full"] < held["selective"] < held["none"], held
    shapes = Shapes.of(make_model(tiny_model, "none"))
    run = Run(StrategyFacts("ddp", ParallelLayout("ddp")), 1, BATCH, SEQ, checkpointing="selective", precision="fp32",
              packed_documents=False)
    per_layer = selective_bytes_per_token(shapes, run) * BATCH * SEQ
    assert held["selective"] - held["full"] == SIZES["num_hidden_layers"] * per_layer


def test_selective_keeps_the_attention_kernels_of_flash_attn_too():
    """flash-attn (not installed here) registers its ops under its own namespace when imported."""
    from torch.utils.checkpoint import CheckpointPolicy

    from toolkit.models.gradient_checkpointing import _policy

    class FlashForward:  # an operator as torch.ops.flash_attn._flash_attn_forward.default shows itself
        namespace = "flash_attn"

    assert _policy(None, FlashForward()) == CheckpointPolicy.MUST_SAVE
    assert _policy(None, torch.ops.aten.mm.default) == CheckpointPolicy.MUST_SAVE
    assert _policy(None, torch.ops.aten.silu.default) == CheckpointPolicy.PREFER_RECOMPUTE
