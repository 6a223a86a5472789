"""Generations for the prompts of a run's YAML, before and after training, into samples.md.

Greedy decoding, so that a difference between before and after is the training's doing and
not the sampler's. In chat mode each prompt is one user turn rendered with the chat template.
"""

from __future__ import annotations

from pathlib import Path

import torch


@torch.no_grad()
def generate(model, tokenizer, prompts: list[str], max_new_tokens: int, chat_template: str | None = None) -> list[str]:
    """The continuation of each prompt (prompt text not repeated); chat_template = render as a user turn."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    outputs = []
    for prompt in prompts:
        if chat_template is not None:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True,
                chat_template=chat_template,
            )
            ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        else:
            ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        out = model.generate(
            input_ids=ids.to(device), attention_mask=torch.ones_like(ids).to(device), max_new_tokens=max_new_tokens,
            do_sample=False, pad_token_id=tokenizer.pad_token_id, use_cache=True,
        )
        outputs.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip())
    model.train(was_training)
    return outputs


def write_samples(path: Path, prompts: list[str], before: list[str], after: list[str], header: str) -> Path:
    lines = [f"# Samples: {header}", "", "Greedy decoding; the same prompts before and after training.", ""]
    for i, (prompt, b, a) in enumerate(zip(prompts, before, after, strict=True), 1):
        lines += [f"## {i}. {prompt}", "", "**before**", "", _quote(b), "", "**after**", "", _quote(a), ""]
    path.write_text("\n".join(lines))
    return path


def _quote(text: str) -> str:
    return "\n".join(f"> {line}" for line in (text or "(nothing)").splitlines()) or "> (nothing)"
