"""Tokens a fine-tune adds to its base (model.new_tokens): into the tokenizer as special tokens, and into the model as
embedding and head rows set to the mean of the existing ones, which a full fine-tune trains with every weight and a
LoRA through peft's own trainable_token_indices (saved in adapter/, loadable by peft alone once the base is resized).

`template` in the list stands for the markers the run's chat template writes that the tokenizer lacks: the literal
`<|...|>` and `<...>` words of the template's text (`<|im_start|>`, `<start_of_turn>`, `</s>`; no spaces inside)
that are no token of the tokenizer yet.
"""

from __future__ import annotations

import re

import torch

from toolkit.config.errors import UserError
from toolkit.data.chat import chat_template_for

TEMPLATE = "template"  # the entry that stands for the template's missing markers
MARKER = re.compile(r"<\|[^\s<>|]{1,64}\|>|</?[A-Za-z_][A-Za-z0-9_.:-]{0,63}>")
_IDS = "toolkit_new_token_ids"  # set on the resized model: what apply_adapter trains under a LoRA


def entry_problems(entries: list) -> list[str]:
    """What config validation says of the list: each entry a non-blank string (a repeat is refused as every unique
    list's is)."""
    return [f"new_tokens has {entry!r}; each entry is a token's text (a non-blank string), or {TEMPLATE}"
            for entry in entries if not isinstance(entry, str) or not entry.strip()]


def template_markers(template: str) -> list[str]:
    """The `<|...|>` and `<...>` words of a chat template's text, in order, each once."""
    return list(dict.fromkeys(MARKER.findall(template)))


def tokens_to_add(tokenizer, entries: list[str], template: str | None, source: str) -> list[str]:
    """The texts of `entries` to add: listed tokens (one the tokenizer has is refused), and for `template` the
    template's markers the tokenizer lacks."""
    vocab = tokenizer.get_vocab()
    out: list[str] = []
    for entry in entries:
        if entry == TEMPLATE:
            out += [m for m in template_markers(template or "") if m not in vocab and m not in out]
        elif entry in vocab:
            raise UserError(f"model.new_tokens: {entry} is already token {vocab[entry]} of {source}'s tokenizer; "
                            "drop it from model.new_tokens")
        elif entry not in out:
            out.append(entry)
    return out


def add_new_tokens(tokenizer, entries: list[str], chat_template: str | None, source: str) -> list[str]:
    """Add model.new_tokens to `tokenizer` as special tokens (`chat_template`: data.chat_template, for `template`);
    the texts added, none when the list is empty."""
    if not entries:
        return []
    template = None
    if TEMPLATE in entries:
        try:
            template = chat_template_for(tokenizer, chat_template)
        except UserError as exc:
            if chat_template:  # a data.chat_template file that is empty or not UTF-8: its own line
                raise
            raise UserError(f"model.new_tokens has {TEMPLATE}, which reads the markers of the chat template, and "
                            f"{source}'s tokenizer has none: list the tokens to add (model.new_tokens=[<|im_start|>, "
                            "<|im_end|>]), or, for chat data, set data.chat_template") from exc
    added = tokens_to_add(tokenizer, entries, template, source)
    if added:
        tokenizer.add_tokens(added, special_tokens=True)
    return added


def resize_for_new_tokens(model: torch.nn.Module, tokenizer, added: list[str]) -> str:
    """Give `model` rows for the `added` tokens (embedding and head, tied or not), each the mean of the existing rows;
    the line for the log."""
    ids = tokenizer.convert_tokens_to_ids(added)
    embed = model.get_input_embeddings()
    old = embed.num_embeddings
    if len(tokenizer) > old:
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)  # the rows are set below
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    kept = torch.ones(old, dtype=torch.bool)
    kept[[i for i in ids if i < old]] = False  # rows past the tokenizer's (padded vocabularies): not existing tokens
    with torch.no_grad():
        for layer in (embed, head):
            if layer is None or (layer is head and head.weight is embed.weight) or layer.weight.is_meta:  # the planner's
                continue
            weight = layer.weight
            rows = kept.to(weight.device)
            weight[ids] = weight[:old][rows].float().mean(0).to(weight.dtype)
    setattr(model, _IDS, ids)
    tied = head is not None and head.weight is embed.weight
    return (f"model.new_tokens: added {len(added)} tokens ({', '.join(added)}), their embedding "
            f"{'(tied to the head) ' if tied else 'and head '}rows set to the mean of the existing {int(kept.sum())}")


def new_token_ids(model: torch.nn.Module) -> list[int]:
    """The ids resize_for_new_tokens gave rows to, for the adapter to train; none for a model it did not resize."""
    return list(getattr(model, _IDS, []))
