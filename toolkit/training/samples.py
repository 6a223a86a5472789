"""Generations for the prompts of a run's YAML, before and after training, into samples.md.

Greedy decoding, so that a difference between before and after is the training's doing and not the sampler's;
in chat mode each prompt is one user turn rendered with the chat template. Generation here is always one
process's own business: a whole model, `synced_gpus=False`. transformers would otherwise turn on its
cross-rank sync (an all-reduce per decoding step) whenever ZeRO-3 is configured or the module is FSDP-managed,
and a rank generating alone then waits forever for ranks that are elsewhere. A sharded model is refused
instead of hanging.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from toolkit.config.declarations import ALWAYS, free
from toolkit.config.errors import UserError
from toolkit.config.load import field
from toolkit.run.writes import writing
from toolkit.strategy.distributed import check_whole

AGAIN = free("generated from the base again on a resume (recipes/finetune.py)")


@dataclass
class SamplesConfig:
    prompts: list[str] = field(
        default_factory=lambda: ["The"],
        help="prompts to generate from: pretraining samples from final/, fine-tuning compares before and after in samples.md",
        resume=AGAIN, used_when=ALWAYS, path=None, unique=False,  # a prompt asked twice is sampled twice
        accepts={"[]": "no samples"},
    )
    max_new_tokens: int = field(
        48, help="tokens generated per prompt; 0 = no samples", resume=AGAIN,
        used_when=ALWAYS,  # 0 is the samples' off switch
        accepts={"0": "no samples", "2**31": "finetune: refused once the base model is loaded, before any sample or "
                 "training (recipes/finetune.py: more than its positions)"},
    )

    def validate(self) -> list[str]:
        problems = [] if self.max_new_tokens >= 0 else [f"max_new_tokens={self.max_new_tokens} must be >= 0"]
        # an empty prompt is no tokens to continue from: generate would fail after training, with nothing saved of it
        problems += [f"prompts[{i}] is empty; give text to continue from, or drop it" for i, prompt in
                     enumerate(self.prompts) if not str(prompt).strip()]
        return problems


@torch.no_grad()
def generate(model, tokenizer, prompts: list[str], max_new_tokens: int, chat_template: str | None = None,
             bar=None) -> list[str]:
    """The continuation of each prompt (prompt text not repeated); chat_template = render as a user turn. `bar`
    (toolkit.training.phases) is updated after each prompt."""
    check_whole(model)
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    outputs = []
    for prompt in prompts:
        ids = prompt_ids(tokenizer, prompt, chat_template)
        # eagerly: a compiled model (model.compile) would compile its forward again for the cache's new lengths
        with torch.compiler.set_stance("force_eager"):
            out = model.generate(
                input_ids=ids.to(device), attention_mask=torch.ones_like(ids).to(device), max_new_tokens=max_new_tokens,
                do_sample=False, pad_token_id=tokenizer.pad_token_id, use_cache=True, synced_gpus=False,
            )
        outputs.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip())
        if bar is not None:
            bar.update()
    model.train(was_training)
    return outputs


def prompt_ids(tokenizer, prompt: str, chat_template: str | None = None) -> torch.Tensor:
    """The ids generation starts from: the prompt, or in chat mode the prompt as a user turn (1 x tokens)."""
    if chat_template is not None:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True, chat_template=chat_template,
        )
        return tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    return tokenizer(prompt, return_tensors="pt")["input_ids"]


def check_prompt_lengths(tokenizer, samples: SamplesConfig, limit: int | None, chat_template: str | None = None,
                         whose: str = "the model's") -> None:
    """Refuse, before training, a prompt whose tokens and samples.max_new_tokens together pass the model's positions:
    generate fails there (learned positions, GPT-2: an IndexError), after training, with no sample written. The
    check of max_new_tokens alone (the config's) cannot see the prompt's tokens."""
    if limit is None or not samples.max_new_tokens:
        return
    for i, prompt in enumerate(samples.prompts):
        n = prompt_ids(tokenizer, prompt, chat_template).shape[1]
        if n + samples.max_new_tokens > limit:
            raise UserError(
                f"samples.prompts[{i}] is {n} tokens, and with samples.max_new_tokens={samples.max_new_tokens} a sample "
                f"would be {n + samples.max_new_tokens} tokens, more than {whose} {limit} positions; use "
                + (f"samples.max_new_tokens={limit - n} or less, or a shorter prompt" if n < limit else "a shorter prompt")
            )


@torch.no_grad()
def sample_folder(folder: Path, prompt: str, max_new_tokens: int, seed: int) -> str:
    """A sampled continuation from a saved HF folder (which also proves that it loads).

    Call it inside `toolkit.strategy.accelerator.outside_training` when training ran in this process.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    check_whole(model)
    inputs = tokenizer(prompt, return_tensors="pt")
    torch.manual_seed(seed)
    out = model.generate(
        **inputs, max_new_tokens=max_new_tokens, do_sample=True, temperature=0.8, top_k=50,
        pad_token_id=tokenizer.pad_token_id, synced_gpus=False,
    )
    return tokenizer.decode(out[0], skip_special_tokens=True)


def write_samples(path: Path, prompts: list[str], before: list[str], after: list[str], header: str,
                  say: Callable[[str], None] = print, note: str | None = None) -> Path | None:
    """samples.md, `note` (when given) under its title; None where it could not be written (said through `say`:
    final/ is complete, the run goes on)."""
    lines = [f"# Samples: {header}", "", *([f"> {note}", ""] if note else []),
             "Greedy decoding; the same prompts before and after training.", ""]
    for i, (prompt, b, a) in enumerate(zip(prompts, before, after, strict=True), 1):
        lines += [f"## {i}. {prompt}", "", "**before**", "", _quote(b), "", "**after**", "", _quote(a), ""]
    with writing("samples", path, say=say):
        path.write_text("\n".join(lines))
        return path
    return None


def _quote(text: str) -> str:
    return "\n".join(f"> {line}" for line in (text or "(nothing)").splitlines()) or "> (nothing)"
