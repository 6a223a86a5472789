"""A tiny LLaMA whose greedy answer is known and ends with a stop: what a test of where generation stops needs (a
random model never stops)."""

from __future__ import annotations

import torch


def stopping_model(tiny_model, tokenizer, answer: int):
    """A tiny LLaMA that answers the ChatML generation prompt with the token `answer`, then ends its turn with
    <|im_end|> (never with its EOS): residual dims 0 and 1 carry a constant and "this is the last token of the
    generation prompt", which no layer writes over, and the head reads only those two."""
    model = tiny_model(tokenizer=tokenizer)
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False, add_generation_prompt=True)
    last = tokenizer(prompt, add_special_tokens=False)["input_ids"][-1]
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        embed[:, 0], embed[:, 1] = 1.0, 0.0
        embed[last, 1] = 1.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[:2] = 0
            layer.mlp.down_proj.weight[:2] = 0
        head = model.lm_head.weight
        head.zero_()
        head[:, 0] = -1.0  # every token below <|im_end|>'s 0 ...
        head[eot, 0] = 0.0
        head[answer] = 0.0
        head[answer, 0], head[answer, 1] = -0.5, 2.0  # ... but `answer` right after the generation prompt
    assert eot != tokenizer.eos_token_id and not model.config.tie_word_embeddings
    return model
