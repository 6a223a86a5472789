"""Causal-LM loss normalised by target tokens over the whole global batch.

Averaging per micro-batch and then over micro-batches/ranks (what transformers did before #34191 was fixed)
weights a token in a short micro-batch more than one in a long micro-batch. Here every micro-batch contributes
its *sum* of token losses, divided by the number of target tokens in the entire global batch, so accumulation
and data parallelism change nothing. model.loss=chunked computes the same sum and gradients inside the output head,
a chunk of tokens at a time, without the full logits; model.loss_positions=targets (`loss_on_targets`) has the head
project only the positions that carry a target, in either path.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from toolkit.config.errors import UserError
from toolkit.data.packing import IGNORE_INDEX


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropies over non-ignored targets (labels unshifted).

    The labels are shifted, not the logits: `logits[:, :-1]` is not contiguous, and reshaping it
    copies the whole (batch x seq x vocab) tensor, forward and backward (measured: +6% step time
    on the tiny model; hundreds of MB per micro-batch with a 50k+ vocabulary).
    """
    return target_loss_sum(logits, next_token_targets(labels))


def next_token_targets(labels: torch.Tensor) -> torch.Tensor:
    """Each position's target, the next token's label (the last position has none)."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def target_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of cross-entropies of each position's logits against its target (already the next token)."""
    flat_logits = logits.reshape(-1, logits.shape[-1]).float()
    return F.cross_entropy(flat_logits, targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")


def targets_of(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each position's target: `shift_labels` where a batch has them (context parallel shifts before it
    splits a sequence), else its `labels` shifted by one."""
    if "shift_labels" in batch:
        return batch["shift_labels"]
    return next_token_targets(batch["labels"])


def backward_scale(global_targets: int, world_size: int, accumulation_steps: int) -> float:
    """Factor turning a micro-batch loss *sum* into its share of the global per-token mean.

    Accelerate divides the loss by `accumulation_steps` in `backward()` (DeepSpeed's engine
    does the same), and DDP/ZeRO/FSDP average gradients over ranks: both are undone here so
    that the summed gradient is exactly d(sum of token losses)/d(theta) / global_targets.
    """
    return world_size * accumulation_steps / max(1, global_targets)


NOT_INPUTS = ("labels", "shift_labels", "target_rows")  # a batch's columns the model's forward does not take


def forward_loss_sum(model, batch: dict[str, torch.Tensor], chunk_tokens: int = 0) -> torch.Tensor:
    """This micro-batch's summed token loss (a 0-d fp32 tensor to backward).

    `chunk_tokens` 0: from the model's full logits; > 0 (model.loss=chunked): computed inside the
    output head `chunk_tokens` tokens at a time, with the same value and gradients. A model marked by
    `loss_on_targets`: the head projects only the positions with a target (`rows_of`).
    """
    targets = targets_of(batch)
    # No KV cache: training never reads one, and with one transformers stops reading document
    # boundaries from position ids (flex_attention would then let documents see each other).
    inputs = {k: v for k, v in batch.items() if k not in NOT_INPUTS} | {"use_cache": False}
    with static_flex_on_cpu(model, targets.device):
        inner = unwrapped(model)
        if getattr(inner, LOSS_IN_FORWARD, False):
            return loss_from_forward(model, inner, inputs, targets)
        rows = rows_of(batch, targets) if on_targets(model) else None
        if chunk_tokens <= 0:
            with head_at(model, rows):
                logits = model(**inputs).logits
            return target_loss_sum(logits, targets if rows is None else targets.reshape(-1)[rows])
        with loss_in_head(model, targets, chunk_tokens, rows) as returned:
            loss = model(**inputs).logits
    if len(returned) != 1 or loss.dim() != 0:
        raise RuntimeError(
            f"model.loss=chunked: {type(model).__name__}'s forward called its output head {len(returned)} times "
            f"and returned logits of shape {tuple(loss.shape)}, not the loss the head computed; use model.loss=full"
        )
    return loss


# ------------------------------------------------------------------ model.loss_positions=targets
TARGETS_ONLY = "_toolkit_loss_on_targets"


def loss_on_targets(model: torch.nn.Module) -> None:
    """From now on the output head of `model` projects only the positions that carry a target (forward_loss_sum and
    the preference objectives' token_logps): the same sum and gradients, less of the head's compute and memory."""
    setattr(unwrapped(model), TARGETS_ONLY, True)


def on_targets(model: torch.nn.Module) -> bool:
    return bool(getattr(unwrapped(model), TARGETS_ONLY, False))


def target_rows(targets: torch.Tensor) -> torch.Tensor:
    """The positions of `targets` (already shifted) that carry one, as indices into its flattened (rows x positions)."""
    return (targets.reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1)


def with_target_rows(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`batch` (on the host) with its `target_rows`: found where its labels are, so that the device never waits
    for the host to read them (a GPU's nonzero() would, at every micro-batch)."""
    return batch | {"target_rows": target_rows(targets_of(batch))}


def rows_of(batch: dict[str, torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
    """The rows of `targets` to project: those `with_target_rows` found on the host, else found here (a context- or
    sequence-parallel shard is a batch of its own, made on the device)."""
    rows = batch.get("target_rows")
    return rows if rows is not None else target_rows(targets)


@contextlib.contextmanager
def head_at(model: torch.nn.Module, rows: torch.Tensor | None):
    """For one forward of `model`: its output head gets only the hidden states at `rows` (flattened positions), and
    the model returns their logits, (len(rows) x vocab); every position where `rows` is None. A pre-hook, so that the
    hooks of ZeRO-3, FSDP2 and peft's wrappers around the head still run as they do."""
    if rows is None:
        yield
        return

    def select(module, args):
        hidden = args[0]
        return (hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows), *args[1:])

    handle = unwrapped(model).get_output_embeddings().register_forward_pre_hook(select)
    try:
        yield
    finally:
        handle.remove()


LOSS_IN_FORWARD = "_toolkit_loss_in_forward"  # True, then "checked" after the first forward agreed with target_loss_sum


def put_loss_in_forward(model: torch.nn.Module) -> None:
    """From now on forward_loss_sum has `model` (a transformers causal LM) compute its loss in its forward."""
    setattr(model, LOSS_IN_FORWARD, True)


def loss_from_forward(model, inner: torch.nn.Module, inputs: dict, targets: torch.Tensor) -> torch.Tensor:
    """transformers' own loss, computed in the forward (inside the graph of a whole compiled forward,
    model.compile=model): the fp32 cross-entropy summed over the targets given, divided by num_items_in_batch=1.
    A mixture of experts' router loss stays the toolkit's (toolkit.models.router), never added to it here. `inner`:
    `model` unwrapped, where the marker and the config are."""
    routers = {"output_router_logits": False} if hasattr(inner.config, "output_router_logits") else {}
    out = model(**inputs, labels=targets, shift_labels=targets, num_items_in_batch=1, **routers)
    if getattr(inner, LOSS_IN_FORWARD) != "checked":
        # Most causal LMs hand these to transformers' ForCausalLMLoss; some compute a mean of their own and
        # ignore them (BartForCausalLM among them): checked once, on the first batch, against the logits.
        expected = target_loss_sum(out.logits.detach(), targets)
        if out.loss is None or not torch.allclose(out.loss.detach().float(), expected, rtol=1e-2, atol=1e-3):
            raise UserError(
                f"model.compile=model: {type(inner).__name__} computes another loss in its forward than the sum over "
                f"the targets it is given ({float(out.loss.detach()) if out.loss is not None else None} against "
                f"{float(expected)}); use model.compile=layers"
            )
        setattr(inner, LOSS_IN_FORWARD, "checked")
    return out.loss


# ------------------------------------------------------------------ model.loss=chunked
# The full path holds the micro-batch's logits in fp32 (tokens x vocab x 4 bytes: 2.1 GB for
# 8 x 2048 tokens and a 32k vocabulary) plus their bf16 copy and their gradient. The chunked
# path runs the output projection and the cross-entropy a chunk of tokens at a time and keeps
# only what the backward needs: d(loss)/d(hidden) (tokens x hidden) and d(loss)/d(weight).


class _LinearCrossEntropySum(torch.autograd.Function):
    """sum_t CE(hidden_t @ W.T + b, target_t) and, in the same pass, its gradients; with `softcap` c the logits
    are c tanh(z / c) of the projection's z first (Gemma 2's final_logit_softcapping).

    The gradients are computed in the forward (the backward only scales them by the incoming
    scalar), so the weight is needed only while the head's forward runs: exactly when ZeRO-3
    and FSDP have gathered it through their module hooks.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_tokens: int, needs: tuple[bool, bool, bool],
                softcap: float | None = None):
        device = hidden.device.type
        # what F.linear would compute in: the autocast dtype (bf16 on GPUs) or the weight's own;
        # the weight is cast once here, not per chunk (autocast caches no casts with grad off)
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
        w = weight.to(dtype)
        b = None if bias is None else bias.to(dtype)
        x = hidden.reshape(-1, hidden.shape[-1])
        valid = targets.reshape(-1) != IGNORE_INDEX
        safe = targets.reshape(-1).masked_fill(~valid, 0)  # any class: an ignored row is zeroed below
        rows = torch.arange(min(chunk_tokens, x.shape[0]), device=x.device)
        need_x, need_w, need_b = needs
        grad_x = torch.empty_like(x) if need_x else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        sums = []
        for start in range(0, x.shape[0], chunk_tokens):
            end = start + chunk_tokens
            x_c = x[start:end].to(dtype)
            valid_c, safe_c = valid[start:end], safe[start:end]
            logp = F.linear(x_c, w, b).float()
            if softcap:  # tanh(z / c) kept for the backward: d(c tanh(z / c))/dz = 1 - tanh^2
                capped = logp.div_(softcap).tanh_()
                logp = capped * softcap
            logp -= torch.logsumexp(logp, dim=-1, keepdim=True)  # in place: one (chunk x vocab) fp32 buffer
            sums.append(-(logp.gather(1, safe_c[:, None]).squeeze(1) * valid_c).sum())
            if not (need_x or need_w or need_b):
                continue
            # d(sum of CE)/d(logits) = softmax - onehot(target); an ignored target adds nothing
            grad = logp.exp_()
            grad[rows[: grad.shape[0]], safe_c] -= 1.0
            grad *= valid_c[:, None]
            if softcap:
                grad *= 1.0 - capped.square_()
                del capped
            # rounded to the compute dtype as autograd would hand it to linear's backward
            g = grad.to(dtype)
            del logp, grad
            if need_x:
                grad_x[start:end] = g @ w
            if need_w:
                if g.dtype == torch.float32:
                    grad_w.addmm_(g.t(), x_c)
                else:
                    grad_w += g.t() @ x_c
            if need_b:
                grad_b += g.sum(0, dtype=torch.float32)
        ctx.save_for_backward(
            None if grad_x is None else grad_x.view_as(hidden),
            None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(bias.dtype),
        )
        # pairwise summation of the chunk sums: with chunk_tokens=1, adding thousands of scalars
        # one by one in fp32 would drift from the full path's sum
        return torch.stack(sums).sum() if sums else hidden.new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad_out):
        grads = [None if g is None else g * grad_out for g in ctx.saved_tensors]
        return *grads, None, None, None, None


def linear_cross_entropy_sum(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor, chunk_tokens: int,
    softcap: float | None = None,
) -> torch.Tensor:
    """`F.cross_entropy(F.linear(hidden, weight, bias), targets, reduction="sum")` (targets already
    shifted, IGNORE_INDEX skipped; the logits capped at `softcap` first, if given), never holding more than
    `chunk_tokens` rows of logits."""
    grad_on = torch.is_grad_enabled()
    needs = (
        grad_on and hidden.requires_grad,
        grad_on and weight.requires_grad,  # a frozen head (LoRA) gets no (vocab x hidden) gradient
        grad_on and bias is not None and bias.requires_grad,
    )
    return _LinearCrossEntropySum.apply(hidden, weight, bias, targets, chunk_tokens, needs, softcap)


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside DDP/DeepSpeed wrappers, torch.compile's and peft's."""
    inner = model
    while isinstance(getattr(inner, "module", None), torch.nn.Module):  # DDP, DeepSpeed's engine
        inner = inner.module
    inner = getattr(inner, "_orig_mod", inner)  # torch.compile's wrapper
    if hasattr(inner, "get_base_model"):  # peft
        inner = inner.get_base_model()
    return inner


def static_flex_on_cpu(model: torch.nn.Module, device: torch.device):
    """Where `model` runs flex_attention on CPU: no automatic dynamic shapes while it compiles.

    transformers compiles flex_attention with torch.compile's default (dynamic=None), so a forward at a
    second shape (an evaluation's short last batch, a shorter sequence) recompiles it with symbolic
    sizes, and inductor's CPU flex template then writes C++ that does not build (torch 2.13:
    "'cur_qSplitSize2' was not declared"). Which size changes trip it depends on the mask
    transformers composes (5.23: the batch alone or the length alone; 5.24: both at once), so no
    transformers version is safe. Static, each new shape compiles a kernel of its own (past dynamo's
    recompile limit, flex_attention runs uncompiled). GPUs (Triton) keep the default.
    """
    attention = getattr(getattr(unwrapped(model), "config", None), "_attn_implementation", None)
    if device.type == "cpu" and attention == "flex_attention":
        return torch._dynamo.config.patch(automatic_dynamic_shapes=False)
    return contextlib.nullcontext()


def output_head(model: torch.nn.Module) -> torch.nn.Module:
    """The output projection of a (possibly DDP/DeepSpeed-wrapped, compiled or peft) causal LM: with
    adapter.modules_to_save=[lm_head], the trained copy peft's wrapper calls (itself a plain Linear)."""
    inner = unwrapped(model)
    name = type(inner).__name__
    head = inner.get_output_embeddings()
    copies = getattr(head, "modules_to_save", None)  # peft's ModulesToSaveWrapper calls its active adapter's copy
    if isinstance(copies, torch.nn.ModuleDict) and getattr(head, "active_adapters", None):
        head = copies[head.active_adapters[0]]
    # model.new_tokens under a LoRA: peft's trainable tokens wrap the head, whose weight is then head_weight's
    tokens = getattr(head, "token_adapter", None)
    # isinstance, not type(): FSDP2 turns the class into a subclass when it shards the head
    if not isinstance(tokens.base_layer if tokens is not None else head, torch.nn.Linear):
        raise UserError(
            f"model.loss=chunked computes the loss inside the output head, which must be a torch Linear layer; "
            f"{name}'s is {type(head).__name__} (a LoRA on it: adapter.target_modules names it?); use model.loss=full "
            "or leave the output head out of adapter.target_modules"
        )
    return head


def head_weight(head: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) the output head projects with: a Linear's own, or the base's with peft's trainable token rows
    in place (model.new_tokens under a LoRA), as peft's own forward computes it."""
    tokens = getattr(head, "token_adapter", None)
    if tokens is None:
        return head.weight, head.bias
    base = tokens.base_layer
    if tokens.disable_adapters or tokens.merged or not tokens.active_adapters:  # a DPO reference: the base's rows
        return base.weight, base.bias
    return tokens.get_merged_weights(tokens.active_adapters), base.bias


def logit_softcap(model: torch.nn.Module) -> float | None:
    """The cap a model puts on its logits after the output head (Gemma 2's final_logit_softcapping), or None."""
    return getattr(getattr(unwrapped(model), "config", None), "final_logit_softcapping", None) or None


@contextlib.contextmanager
def loss_in_head(model: torch.nn.Module, targets: torch.Tensor, chunk_tokens: int, rows: torch.Tensor | None = None):
    """For one forward of `model`: its output head returns the summed token loss instead of logits (computed at
    `rows` alone, the flattened positions with a target, where they are given).

    The instance `forward` is replaced, not the class's: the module's hooks still run around it
    (ZeRO-3 gathers the weight before, FSDP2 unshards it before and reshards it after), and
    `head.weight` is read at call time, when it is the gathered/unsharded parameter. Yields the
    list of losses the head returned, for the caller to check it ran exactly once.

    A model that caps its logits after the head (Gemma 2) has the cap applied inside the chunks and its own
    turned off for the forward, so that the model returns the head's loss itself: a loss taken from the head
    beside the model's output would leave the model's own output out of the backward, whose hooks ZeRO-3 needs
    (measured: DeepSpeed's "active_backward_submodules is empty").
    """
    head = output_head(model)
    cap = logit_softcap(model)
    config = unwrapped(model).config
    returned: list[torch.Tensor] = []

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[:-1] != targets.shape:
            raise ValueError(
                f"model.loss=chunked: the output head got hidden states {tuple(hidden.shape)} for labels "
                f"{tuple(targets.shape)}; the model must project every position (logits_to_keep=0)"
            )
        kept = targets
        if rows is not None:
            hidden, kept = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows), targets.reshape(-1)[rows]
        returned.append(linear_cross_entropy_sum(hidden, *head_weight(head), kept, chunk_tokens, cap))
        return returned[-1]

    own = head.__dict__.get("forward")  # a forward already set on the instance (accelerate hooks do that)
    head.forward = forward
    if cap:
        config.final_logit_softcapping = None
    try:
        yield returned
    finally:
        if cap:
            config.final_logit_softcapping = cap
        if own is None:
            del head.forward
        else:
            head.forward = own
