"""Loss normalisation: accumulation and data parallelism must not change the loss or the gradient.

The recipe's path (recipes/pretrain.py): every micro-batch backwards
`forward_loss_sum(model, batch) * backward_scale(global_targets, world_size, accum)` under
`accelerator.accumulate(model)`. Micro-batches here hold DIFFERENT numbers of target tokens,
which is exactly where averaging per micro-batch (transformers issue #34191) goes wrong.
"""

from __future__ import annotations

import math

import datasets
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from toolkit.config.errors import UserError
from toolkit.data.packing import IGNORE_INDEX, collate, pack_documents, target_counts, tokenize_documents
from toolkit.models.loss import (
    TARGETS_ONLY,
    backward_scale,
    forward_loss_sum,
    linear_cross_entropy_sum,
    loss_on_targets,
    target_rows,
    targets_of,
    token_loss_sum,
    with_target_rows,
)

SEQ_LEN = 32
MICRO = 2
ACCUM = 4
# A wider init than the default 0.02 makes token losses vary (a default-init model predicts ~uniformly,
# so every micro-batch mean is ~log(vocab) and mean-of-means would hide behind the tolerance).
INIT_RANGE = 0.2


@pytest.fixture(scope="module")
def setup(tiny_texts, tiny_tokenizer):
    """8 packed blocks ordered so that the 4 micro-batches of 2 have very different target counts."""
    long_doc = tiny_texts[2][:300]  # fills several blocks with one document: 31 targets per block
    tiny_docs = list("abcdefghijklmnopqrstuvwxyz0123456789ABCD")  # 2 tokens each: 1 target, 1 start
    texts = [long_doc, *tiny_docs, tiny_texts[4][:350], "the end."]
    tokenized = tokenize_documents(datasets.Dataset.from_dict({"text": texts}), tiny_tokenizer)
    blocks = pack_documents(tokenized, SEQ_LEN, tiny_tokenizer.pad_token_id).with_format("numpy")
    counts = target_counts(blocks)
    order = np.argsort(counts, kind="stable")
    # micro-batch 0: the two blocks with the fewest targets; 1: the two with the most; 2 and 3 mixed
    chosen = [order[0], order[1], order[-1], order[-2], order[2], order[-3], order[3], order[-4]]
    micro_idx = [chosen[i : i + MICRO] for i in range(0, len(chosen), MICRO)]
    micro_batches = [collate(blocks[list(idx)], "sdpa") for idx in micro_idx]
    full_batch = collate(blocks[list(chosen)], "sdpa")
    global_targets = int(counts[chosen].sum())
    micro_targets = [int(counts[idx].sum()) for idx in micro_idx]
    return dict(
        micro=micro_batches, full=full_batch, global_targets=global_targets, micro_targets=micro_targets
    )


@pytest.fixture(scope="module")
def make_model(tiny_model, tiny_tokenizer):
    """The same initial weights every call (seeded): a 2-layer LLaMA, hidden 64, fp32."""
    return lambda: tiny_model("llama", seed=0, tokenizer=tiny_tokenizer, initializer_range=INIT_RANGE)


def fresh_accelerator(accum: int) -> Accelerator:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return Accelerator(cpu=True, gradient_accumulation_steps=accum)


@pytest.fixture(autouse=True)
def _reset_accelerate(monkeypatch):
    monkeypatch.delenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", raising=False)
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def train_step(make_model, batches, global_targets: int, accum: int, world_size: int = 1):
    """One optimizer step exactly as recipes/pretrain.py runs it; returns (loss, grads at sync)."""
    acc = fresh_accelerator(accum)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    model, optimizer = acc.prepare(model, optimizer)
    model.train()
    scale = backward_scale(global_targets, world_size, accum)
    loss_sum = torch.zeros((), dtype=torch.float64)
    grads, syncs = None, []
    for batch in batches:
        with acc.accumulate(model):
            micro_loss = forward_loss_sum(model, batch)
            acc.backward(micro_loss * scale)
            loss_sum += micro_loss.detach().double()
            syncs.append(acc.sync_gradients)
            if acc.sync_gradients:
                grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    assert syncs == [False] * (accum - 1) + [True]  # one optimizer step, after the last micro-batch
    return loss_sum.item() / global_targets, grads


def assert_grads_close(actual: dict, expected: dict):
    assert_same_grads(actual, expected)


def test_micro_batches_have_unequal_targets(setup):
    micro_targets = setup["micro_targets"]
    assert sum(micro_targets) == setup["global_targets"]
    assert max(micro_targets) >= 1.5 * min(micro_targets), micro_targets
    # target_counts agrees with the labels the loss actually uses (after the shift)
    for batch, n in zip(setup["micro"], micro_targets, strict=True):
        assert int((batch["labels"][:, 1:] != IGNORE_INDEX).sum()) == n


def test_accumulation_matches_one_big_batch(setup, make_model):
    loss_acc, grads_acc = train_step(make_model, setup["micro"], setup["global_targets"], ACCUM)
    loss_ref, grads_ref = train_step(make_model, [setup["full"]], setup["global_targets"], 1)
    assert loss_acc == pytest.approx(loss_ref, rel=1e-5)
    assert_grads_close(grads_acc, grads_ref)


def test_data_parallel_split_matches_one_big_batch(setup, make_model):
    """2 ranks x 2 micro-batches, gradients averaged as DDP does, equal the 1-process batch of 8."""
    world = 2
    per_rank = ACCUM // world
    losses, grads = [], []
    for rank in range(world):
        mine = setup["micro"][rank * per_rank : (rank + 1) * per_rank]
        loss, g = train_step(make_model, mine, setup["global_targets"], per_rank, world_size=world)
        losses.append(loss)
        grads.append(g)
    averaged = {n: sum(g[n] for g in grads) / world for n in grads[0]}  # DDP all-reduce mean
    loss_ref, grads_ref = train_step(make_model, [setup["full"]], setup["global_targets"], 1)
    assert sum(losses) == pytest.approx(loss_ref, rel=1e-5)
    assert_grads_close(averaged, grads_ref)


def test_naive_mean_of_means_differs(setup, make_model):
    """Negative control: the per-micro-batch mean (#34191) is measurably wrong on this data."""
    model = make_model().train()
    sums = [forward_loss_sum(model, b) for b in setup["micro"]]
    correct = sum(sums) / setup["global_targets"]
    naive = sum(s / n for s, n in zip(sums, setup["micro_targets"], strict=True)) / len(sums)
    assert abs(naive.item() - correct.item()) > 1e-3 * correct.item()

    # and its gradient differs from the correct one far beyond the tolerance used above
    model.zero_grad()
    correct.backward(retain_graph=True)
    g_correct = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad()
    naive.backward()
    g_naive = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert (g_naive - g_correct).norm() > 1e-2 * g_correct.norm()


def test_token_loss_sum_is_shifted_sum():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    labels = torch.tensor([[IGNORE_INDEX, 1, 2, IGNORE_INDEX, 4], [IGNORE_INDEX, 6, 0, 3, IGNORE_INDEX]])
    expected = sum(
        -torch.log_softmax(logits[b, t - 1], -1)[labels[b, t]]
        for b in range(2)
        for t in range(1, 5)
        if labels[b, t] != IGNORE_INDEX
    )
    torch.testing.assert_close(token_loss_sum(logits, labels), expected)


# ------------------------------------------------------------------ model.loss=chunked
# The same loss and gradients as the full path, computed inside the output head a chunk of
# tokens at a time. The batch is setup["full"]: 8 packed blocks x 32 = 256 tokens, with ignored
# targets (document starts, padding) in places.

CHUNKS = [1, 7, 100, 10_000]  # one token; not dividing 256; not dividing, 3 chunks; one chunk larger than all
NO_DROPOUT = {"gpt2": dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), "llama": {}, "qwen2": {}, "gemma2": {}}


class OutputShapes(TorchDispatchMode):
    """Records (op, output shape) of every tensor an aten op produces, forward and backward."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.seen.append((func.__name__, tuple(t.shape)))
        return out


@pytest.fixture(scope="module")
def chunk_models(tiny_model, tiny_tokenizer):
    """Factory: the same initial weights every call; LLaMA and Qwen2 untied (their default), GPT-2 and Gemma 2
    tied."""

    def make(model_type: str):
        model = tiny_model(
            model_type,
            seed=0,
            attn="eager" if model_type == "gemma2" else "sdpa",  # transformers gives Gemma 2 no sdpa
            tokenizer=tiny_tokenizer,
            initializer_range=INIT_RANGE,
            **NO_DROPOUT[model_type],
        )
        tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
        assert tied == (model_type in ("gpt2", "gemma2"))
        return model

    return make


def loss_and_grads(model, batch, chunk_tokens: int, targets: int):
    """The summed loss and the gradients of loss/targets (the per-token mean the recipe trains on)."""
    model.zero_grad(set_to_none=True)
    loss = forward_loss_sum(model, batch, chunk_tokens)
    (loss / targets).backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(actual: dict, expected: dict, atol_of_max: float = 4e-6):
    """fp32 summed in another order (u = 2^-24): an element is off by ~u sqrt(K) of its tensor's scale,
    K = 300 the longest reduction behind it (the tiny vocabulary), 1e-6, x 2 for two computations
    each off the exact one, x 2 for the tails: an atol of 4e-6 x the tensor's largest entry (and
    rtol 1e-5). Measured: up to 1.3e-6 of it (accumulation, chunked loss, the full path's halves)."""
    assert actual.keys() == expected.keys()
    for name, ref in expected.items():
        torch.testing.assert_close(
            actual[name], ref, rtol=1e-5, atol=atol_of_max * ref.abs().max().item(), msg=name
        )


@pytest.fixture(scope="module")
def full_reference(setup, chunk_models):
    """Per model type: (model, the full path's loss and gradients) on setup["full"]."""
    assert (setup["full"]["labels"][:, 1:] == IGNORE_INDEX).sum() > 10  # ignored targets among the real ones
    cache = {}

    def get(model_type: str):
        if model_type not in cache:
            model = chunk_models(model_type).train()
            cache[model_type] = (model, *loss_and_grads(model, setup["full"], 0, setup["global_targets"]))
        return cache[model_type]

    return get


@pytest.mark.parametrize(
    ("model_type", "chunk_tokens"),
    # chunk size 1 (256 chunks, the slow case) on LLaMA only; Qwen2 is LLaMA's forward with biases; Gemma 2 caps
    # its logits after the head (c tanh(z / c)), which the chunks do inside it
    [*[("llama", c) for c in CHUNKS], *[("gpt2", c) for c in CHUNKS[1:]], ("qwen2", 7), ("gemma2", 7),
     ("gemma2", 10_000)],
)
def test_chunked_loss_and_gradients_equal_the_full_path(model_type, chunk_tokens, setup, full_reference):
    model, loss_ref, grads_ref = full_reference(model_type)
    if model_type == "gemma2":  # the cap bends these logits: without it the loss is another
        assert model.config.final_logit_softcapping == 1.0  # the model's own cap, off for the chunked forward, is back
        model.config.final_logit_softcapping = None
        try:
            uncapped = forward_loss_sum(model, setup["full"], chunk_tokens).item()
        finally:
            model.config.final_logit_softcapping = 1.0
        assert uncapped != pytest.approx(loss_ref.item(), rel=1e-3)
    loss, grads = loss_and_grads(model, setup["full"], chunk_tokens, setup["global_targets"])
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(loss_ref.item(), rel=1e-6)
    assert_same_grads(grads, grads_ref)


def test_linear_cross_entropy_sum_with_a_bias_and_a_frozen_weight():
    """The head's bias (none of the models above has one) and a weight that does not require grad."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 11, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g)
    bias = torch.randn(50, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (3, 11), generator=g)
    targets[0, :4] = targets[2, -1] = IGNORE_INDEX
    expected = F.cross_entropy(
        F.linear(hidden, weight, bias).flatten(0, 1), targets.flatten(), reduction="sum"
    )
    grads_ref = torch.autograd.grad(expected * 0.3, (hidden, bias))
    loss = linear_cross_entropy_sum(hidden, weight, bias, targets, 4)
    grads = torch.autograd.grad(loss * 0.3, (hidden, bias))
    torch.testing.assert_close(loss, expected)
    for actual, ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(actual, ref)


def test_chunked_lora_trains_the_adapter_alone_with_the_same_gradients(setup, make_model):
    from peft import LoraConfig, get_peft_model

    # init_lora_weights=False: a zero B would give A a zero gradient, which any path matches
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = get_peft_model(make_model(), lora).train()
    assert not model.get_output_embeddings().weight.requires_grad
    loss_ref, grads_ref = loss_and_grads(model, setup["full"], 0, setup["global_targets"])
    assert grads_ref and all("lora_" in n for n in grads_ref)
    vocab, hidden = model.get_output_embeddings().weight.shape
    with OutputShapes() as shapes:
        loss, grads = loss_and_grads(model, setup["full"], 7, setup["global_targets"])
    assert loss.item() == pytest.approx(loss_ref.item(), rel=1e-6)
    assert_same_grads(grads, grads_ref)
    # the frozen head's (vocab x hidden) gradient is never computed
    assert (vocab, hidden) not in {shape for _, shape in shapes.seen}


def test_chunked_loss_under_bf16_autocast(setup, chunk_models):
    """Each chunk's logits are the same bf16 matmul rows as the full logits', so the loss agrees to
    within one bf16 rounding (2**-8 relative; measured ~1e-7). The gradients carry bf16 rounding
    either way (1-4% from fp32's here), and the chunked ones are no further from fp32's."""
    targets = setup["global_targets"]
    model = chunk_models("llama").train()
    _, grads_fp32 = loss_and_grads(model, setup["full"], 0, targets)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_full, grads_full = loss_and_grads(model, setup["full"], 0, targets)
        loss, grads = loss_and_grads(model, setup["full"], 7, targets)
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(loss_full.item(), rel=2**-8)

    def distance(a: dict, b: dict) -> float:
        return torch.cat([(a[n] - b[n]).flatten() for n in b]).norm().item()

    assert distance(grads, grads_fp32) <= 1.1 * distance(grads_full, grads_fp32)


def gradient_matmuls(shapes: OutputShapes, chunk_tokens: int, vocab: int, hidden: int) -> int:
    """Matmul outputs of the chunked backward's shapes: d(hidden) chunks and d(weight)."""
    mm = [shape for op, shape in shapes.seen if op.startswith(("mm", "addmm"))]
    return sum(
        1 for s in mm if s == (vocab, hidden) or (len(s) == 2 and s[0] <= chunk_tokens and s[1] == hidden)
    )


def test_chunked_evaluation_gives_the_same_loss_without_gradient_work(setup, chunk_models):
    model = chunk_models("gpt2").eval()
    vocab, hidden = model.get_output_embeddings().weight.shape
    with torch.no_grad():
        expected = forward_loss_sum(model, setup["full"])
        with OutputShapes() as shapes:
            loss = forward_loss_sum(model, setup["full"], 7)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert gradient_matmuls(shapes, 7, vocab, hidden) == 0
    # parameters that do not require grad, with grad mode on: the same, and nothing to backward
    model.requires_grad_(False)
    with OutputShapes() as shapes:
        loss = forward_loss_sum(model, setup["full"], 7)
    assert not loss.requires_grad
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert gradient_matmuls(shapes, 7, vocab, hidden) == 0
    # control: training does that work, in the forward: per chunk (37) a d(hidden) and a d(weight) matmul
    model.requires_grad_(True).train()
    with OutputShapes() as shapes:
        forward_loss_sum(model, setup["full"], 7)
    assert gradient_matmuls(shapes, 7, vocab, hidden) == 2 * 37


def test_chunked_path_never_holds_the_full_logits(setup, make_model):
    """Fails if the chunked path fell back to full logits: no op, forward or backward, outputs more
    than one chunk of rows over the vocabulary; the full path does (the control)."""
    model = make_model().train()
    vocab, hidden = model.get_output_embeddings().weight.shape
    tokens = setup["full"]["labels"].numel()

    def record(chunk_tokens: int) -> list[tuple[str, tuple[int, ...]]]:
        with OutputShapes() as shapes:
            forward_loss_sum(model, setup["full"], chunk_tokens).backward()
        return shapes.seen

    def vocab_rows(seen) -> list[int]:
        # (hidden, vocab) is the weight's transpose, which F.linear makes: no logits
        return [math.prod(s[:-1]) for _, s in seen if s and s[-1] == vocab and s != (hidden, vocab)]

    chunked = record(7)
    assert max(vocab_rows(chunked)) == 7
    # one projection matmul per chunk (36 of 7 rows, the last of 4), and none in the backward
    projections = [shape for op, shape in chunked if op.startswith(("mm", "addmm")) and shape[-1] == vocab]
    assert len(projections) == math.ceil(tokens / 7)
    assert max(vocab_rows(record(0))) == tokens


class Wrapper(torch.nn.Module):
    """Stands in for DDP / DeepSpeed's engine: the model under `.module`."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, **kwargs):
        return self.module(**kwargs)


def test_head_forward_is_restored_after_the_call_and_after_an_error(setup, make_model):
    model = make_model().eval()
    head = model.get_output_embeddings()
    ids = setup["full"]["input_ids"][:2]
    generated = model.generate(ids[:, :5], max_new_tokens=4, do_sample=False)

    forward_loss_sum(Wrapper(model), setup["full"], 7)
    assert "forward" not in vars(head)
    assert model(input_ids=ids).logits.shape == (*ids.shape, head.weight.shape[0])
    assert torch.equal(model.generate(ids[:, :5], max_new_tokens=4, do_sample=False), generated)

    def fail(module, args):
        raise RuntimeError("boom inside the forward")

    hook = head.register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="boom"):
        forward_loss_sum(model, setup["full"], 7)
    hook.remove()
    assert "forward" not in vars(head)
    assert model(input_ids=ids).logits.shape == (*ids.shape, head.weight.shape[0])

    # a forward already set on the instance (accelerate's hooks do that) is put back as it was
    own = head.forward
    head.forward = own
    forward_loss_sum(model, setup["full"], 7)
    assert vars(head)["forward"] is own


def test_chunked_refuses_an_adapter_on_the_output_head(setup, make_model):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(make_model(), LoraConfig(r=4, target_modules=["lm_head"]))
    with pytest.raises(UserError, match="must be a torch Linear layer.*model.loss=full"):
        forward_loss_sum(model, setup["full"], 7)


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])  # an untied head, and one tied to the embeddings
def test_chunked_trains_a_head_in_modules_to_save_with_the_same_gradients(model_type, setup, chunk_models):
    """adapter.modules_to_save=[lm_head] (the README's advice after adding tokens): peft's wrapper calls a trained
    copy of the head, a plain Linear, whose loss the chunks compute as the full path does."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"] if model_type == "gpt2" else ["q_proj"],
                      modules_to_save=["lm_head"], init_lora_weights=False)
    model = get_peft_model(chunk_models(model_type), lora).train()
    loss_ref, grads_ref = loss_and_grads(model, setup["full"], 0, setup["global_targets"])
    assert any("modules_to_save" in n and "lm_head" in n for n in grads_ref)  # the head's copy trains
    loss, grads = loss_and_grads(model, setup["full"], 7, setup["global_targets"])
    assert loss.item() == pytest.approx(loss_ref.item(), rel=1e-6)
    assert_same_grads(grads, grads_ref)


def test_flex_attention_compiles_again_at_other_shapes(setup, make_model):
    """An evaluation's short last batch, or a shorter sequence, compiles flex_attention again. On CPU a
    recompile with symbolic sizes writes C++ that does not build (torch 2.13); these shapes trip it
    under transformers 5.23 (the length alone changes) and 5.24 (the rows and the length both), unless
    forward_loss_sum compiles each shape statically. Dynamo forgets earlier tests' compiles first: they
    would decide which of these shapes are new."""
    torch._dynamo.reset()
    masked_model, flex_model = make_model().eval(), make_model().eval()
    flex_model.set_attn_implementation("flex_attention")
    full = setup["full"]
    # not a length of 8 past a multiple of 16: torch 2.13's compiled CPU flex_attention computes those wrong
    # on a CPU without AVX-512 (8, 24, 40: off by 0.6, at times NaN), with or without a mask. 5 x 32 is also
    # test_packing.py's shape: one compile serves both (inductor's cache)
    for rows, length in [(8, SEQ_LEN), (8, SEQ_LEN // 2), (5, SEQ_LEN)]:
        flex_batch = {k: v[:rows, :length] for k, v in full.items() if k != "attention_mask"}
        mask = full["attention_mask"][:rows, :, :length, :length]
        with torch.no_grad():
            masked = forward_loss_sum(masked_model, flex_batch | {"attention_mask": mask})
            flex = forward_loss_sum(flex_model, flex_batch)
        torch.testing.assert_close(flex, masked, rtol=1e-5, atol=0)


# after test_flex_attention_compiles_again_at_other_shapes, whose first shape is this test's (8 x SEQ_LEN): in the
# file's order dynamo's compile of that shape serves both cases here, where before it this test compiled it and that
# one, after its reset, traced it again (~3 CPU-s of dynamo; inductor's kernels came from its cache); run alone,
# this test compiles its own
@pytest.mark.parametrize("chunk_tokens", [0, 50])
def test_flex_attention_loss_equals_the_masked_sdpa_loss(setup, make_model, chunk_tokens):
    """flex_attention reads document boundaries from position ids only without a KV cache; the
    model's config asks for one here (as a model loaded for inference does), so this fails unless
    forward_loss_sum turns it off. Forward only: torch has no CPU backward for flex_attention."""
    model = make_model().eval()
    model.config.use_cache = True
    blocks = setup["full"]
    flex_batch = {k: v for k, v in blocks.items() if k != "attention_mask"}  # what collate gives flex
    with torch.no_grad():
        masked = forward_loss_sum(model, blocks, chunk_tokens)
        model.set_attn_implementation("flex_attention")
        flex = forward_loss_sum(model, flex_batch, chunk_tokens)
    torch.testing.assert_close(flex, masked, rtol=1e-5, atol=0)


# ------------------------------------------------------------------ model.loss_positions=targets


@pytest.fixture(scope="module")
def prompted(setup):
    """setup["full"] as a chat fine-tune's batch looks: each block's first 20 labels masked (its prompt), so that
    most positions carry no target."""
    batch = {k: v.clone() for k, v in setup["full"].items()}
    batch["labels"][:, :20] = IGNORE_INDEX
    targets = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
    assert 0 < targets < batch["labels"].numel() // 2
    return batch, targets


def head_rows(model, batch, chunk_tokens: int) -> int:
    """How many positions the head projects in a forward and backward: the largest (rows x vocab) tensor's rows on
    the full path; on the chunked path, the rows of its projection matmuls, a chunk each."""
    vocab, hidden = model.get_output_embeddings().weight.shape
    with OutputShapes() as shapes:
        forward_loss_sum(model, batch, chunk_tokens).backward()
    model.zero_grad(set_to_none=True)
    if chunk_tokens:
        return sum(s[0] for op, s in shapes.seen if op.startswith(("mm", "addmm")) and len(s) == 2 and s[1] == vocab)
    return max(math.prod(s[:-1]) for _, s in shapes.seen if s and s[-1] == vocab and s != (hidden, vocab))


@pytest.mark.parametrize(("model_type", "chunk_tokens"),
                         [("llama", 0), ("llama", 7), ("gpt2", 0), ("gemma2", 0), ("gemma2", 7), ("qwen2", 10_000)])
def test_the_head_on_target_positions_alone_gives_the_same_loss_and_gradients(model_type, chunk_tokens, prompted,
                                                                              chunk_models):
    """Fails if a masked position reaches the head (the rows it projects are counted) or a target is dropped (the
    loss and every gradient, the head's and the embedding's included, are compared)."""
    batch, targets = prompted
    model = chunk_models(model_type).train()
    loss_ref, grads_ref = loss_and_grads(model, batch, 0, targets)
    assert head_rows(model, batch, chunk_tokens) == batch["labels"].numel()
    loss_on_targets(model)
    try:
        loss, grads = loss_and_grads(model, batch, chunk_tokens, targets)
        assert loss.item() == pytest.approx(loss_ref.item(), rel=1e-6)
        assert_same_grads(grads, grads_ref)
        assert head_rows(model, batch, chunk_tokens) == targets
        # the rows found on the host, as the step hands them, are the same rows
        assert torch.equal(with_target_rows(batch)["target_rows"], target_rows(targets_of(batch)))
        assert forward_loss_sum(model, with_target_rows(batch), chunk_tokens).item() == loss.item()
    finally:
        delattr(model, TARGETS_ONLY)


@pytest.mark.parametrize("chunk_tokens", [0, 7])
def test_the_head_on_targets_under_a_lora_and_with_a_head_trained_whole(chunk_tokens, prompted, make_model):
    """peft wraps the head (modules_to_save) or leaves it frozen: the pre-hook and the chunks see the rows alike."""
    from peft import LoraConfig, get_peft_model

    batch, targets = prompted
    for save in (None, ["lm_head"]):
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                          modules_to_save=save)
        model = get_peft_model(make_model(), lora).train()
        loss_ref, grads_ref = loss_and_grads(model, batch, 0, targets)
        loss_on_targets(model)
        loss, grads = loss_and_grads(model, batch, chunk_tokens, targets)
        assert loss.item() == pytest.approx(loss_ref.item(), rel=1e-6)
        assert_same_grads(grads, grads_ref)
        assert any("lm_head" in n for n in grads) == bool(save)


@pytest.mark.parametrize("chunk_tokens", [0, 7])
def test_a_micro_batch_without_targets_gives_zero_and_a_backward(chunk_tokens, setup, make_model):
    """A block whose every answer was cut (overlong: truncate) still runs the backward every strategy waits for."""
    model = make_model().train()
    loss_on_targets(model)
    batch = {k: v.clone() for k, v in setup["full"].items()}
    batch["labels"][:] = IGNORE_INDEX
    loss = forward_loss_sum(model, with_target_rows(batch), chunk_tokens)
    assert loss.item() == 0.0
    loss.backward()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters() if p.requires_grad)


def test_preference_log_probabilities_on_target_positions_alone(prompted, make_model):
    from toolkit.models.preference_loss import token_logps

    batch, _ = prompted
    model = make_model().eval()
    with torch.no_grad():
        every = token_logps(model, batch)
        loss_on_targets(model)
        only = token_logps(model, with_target_rows(batch))
    assert (every[targets_of(batch) == IGNORE_INDEX] == 0).all()
    torch.testing.assert_close(only, every, rtol=1e-6, atol=1e-6)
